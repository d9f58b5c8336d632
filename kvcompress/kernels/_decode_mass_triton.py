"""Triton kernel finishing the fused decode scores. Loaded lazily by ``decode_mass.py``.

Grid ``(request of the attention call, KV head)``. A scored program reads its query's LSE
(natural log, sink included) for the GROUP query heads and, tile by tile over the W offsets,
the base-2 logits the attention kernel stored: ``exp2(s - lse * log2(e))`` is the very
probability the attention's softmax gave the key (same logit, same denominator). Positions
at or past the row's length are never read (their scratch is unwritten) and give 0.
"""

import triton
import triton.language as tl

from ._triton_support import load_kernel_module

_helpers = load_kernel_module("_triton_helpers")
row_sum = _helpers.row_sum
row_max = _helpers.row_max

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def decode_mass_kernel(
    score_logits_ptr,
    lse_ptr,
    query_start_loc_ptr,
    kv_lens_ptr,
    slots_ptr,
    begin_ptr,
    reduce_codes_ptr,
    mass_ptr,
    width,
    stride_lse_tok,
    stride_lse_head,
    stride_len_req,
    stride_len_head,
    stride_begin_slot,
    stride_begin_head,
    stride_mass_slot,
    stride_mass_head,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = tl.load(slots_ptr + req)
    if slot < 0:
        return  # not scored
    slot = slot.to(tl.int64)
    token = (tl.load(query_start_loc_ptr + req + 1) - 1).to(tl.int64)  # its newest query
    kv_len = tl.load(kv_lens_ptr + req * stride_len_req + kv_head * stride_len_head)
    begin = tl.load(begin_ptr + slot * stride_begin_slot + kv_head * stride_begin_head)
    held_count = kv_len - begin  # offsets [0, held_count) lie inside the row
    code = tl.load(reduce_codes_ptr + slot)

    group = tl.arange(0, GROUP_PAD)
    group_valid = group < GROUP
    lse = tl.load(lse_ptr + token * stride_lse_tok + (kv_head * GROUP + group) * stride_lse_head,
                  mask=group_valid, other=0.0)
    lse2 = lse * LOG2E
    row_base = ((slot * NUM_KV_HEADS + kv_head) * GROUP + group) * width  # [GROUP_PAD]
    mass_base = mass_ptr + slot * stride_mass_slot + kv_head * stride_mass_head
    for start in range(0, width, BLOCK_W):
        offsets = start + tl.arange(0, BLOCK_W)
        held = (offsets < held_count) & (offsets < width)
        s = tl.load(score_logits_ptr + row_base[:, None] + offsets[None, :],
                    mask=group_valid[:, None] & held[None, :], other=float("-inf"))
        probs = tl.exp2(s - lse2[:, None])  # masked entries: exp2(-inf) = 0
        summed = row_sum(probs, 0)
        combined = tl.where(code == 0, summed * (1.0 / GROUP), summed)
        combined = tl.where(code == 1, row_max(probs, 0), combined)
        tl.store(mass_base + offsets, tl.where(held, combined, 0.0), mask=offsets < width)
