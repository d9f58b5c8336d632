"""Triton kernel writing new K/V rows into per-head slots. Loaded lazily by ``write_kv.py``."""

import triton
import triton.language as tl

from ._triton_support import load_kernel_module

fp8_encode = load_kernel_module("_triton_helpers").fp8_encode


@triton.jit
def write_kv_kernel(
    key_ptr,
    value_ptr,
    pool_ptr,
    slot_mapping_ptr,
    num_kv_heads,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_slot_tok,
    stride_slot_head,
    stride_pool_page,
    stride_pool_kv,
    stride_pool_tok,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    k_scale,
    v_scale,
    KV_FP8: tl.constexpr,
):
    """One program: one token, BLOCK_H of its KV heads (each head has its own slot)."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM_PAD)
    slot = tl.load(
        slot_mapping_ptr + token * stride_slot_tok + heads * stride_slot_head,
        mask=heads < num_kv_heads,
        other=-1,
    ).to(tl.int64)
    mask = (slot >= 0)[:, None] & (dims < HEAD_DIM)[None, :]
    dst = (slot // PAGE_SIZE) * stride_pool_page + (slot % PAGE_SIZE) * stride_pool_tok
    key = tl.load(
        key_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask=mask
    )
    value = tl.load(
        value_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :], mask=mask
    )
    if KV_FP8:
        # fp8 pages (uint8 pool): the codes of x / scale; an IEEE division (``/`` is an
        # approximate one on GPUs) so the bytes are those of the reference.
        key = fp8_encode(tl.math.div_rn(key.to(tl.float32), k_scale), KV_FP8)
        value = fp8_encode(tl.math.div_rn(value.to(tl.float32), v_scale), KV_FP8)
    else:
        element = pool_ptr.dtype.element_ty
        key = key.to(element)
        value = value.to(element)
    tl.store(pool_ptr + dst[:, None] + dims[None, :], key, mask=mask)
    tl.store(pool_ptr + stride_pool_kv + dst[:, None] + dims[None, :], value, mask=mask)
