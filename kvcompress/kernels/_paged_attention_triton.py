"""Triton kernels for per-head paged attention. Loaded lazily by ``paged_attention.py``.

Grid ``(query block, kv head, kv split)``. A program owns BLOCK_Q query tokens of one request and
all GROUP query heads that share one KV head: its tile has BLOCK_M = BLOCK_Q * GROUP rows (row m is
query token m // GROUP, query head m % GROUP of the group), so every K/V page is read once for the
whole GQA group. Keys are gathered token by token through the head's page table, so any tile width
works with any page size. Online softmax in fp32 (base-2 exponent, scale folded in), optionally
soft-capped (HAS_SOFT_CAP) and with a sink logit per query head (HAS_SINKS): the sink starts the
running max and sum of split 0, so it joins the denominator once and adds nothing to the output.
With a sliding window (HAS_WINDOW, ``window_left`` = W - 1) a query at row position q sees only
``[q - window_left, q]``, and a program scans from its first query's window start (floored to
BLOCK_N), so its work is O(W + BLOCK_Q) whatever the row's length.

With STORE_SCORES (fused decode scores, ``decode_mass.py``) the newest query row of each scored
request (``score_slots[req] >= 0``) also stores its final base-2 logits (capped, masked) of
the positions ``[begin, begin + score_width)`` into ``score_logits [n, H_kv, GROUP, W]``: each
split stores the tiles it scans, and ``decode_mass_kernel`` normalizes them with the LSE once
the splits are merged, so no key is read twice.
"""

import triton
import triton.language as tl

from ._triton_support import load_kernel_module

_helpers = load_kernel_module("_triton_helpers")
row_sum = _helpers.row_sum
row_max = _helpers.row_max
soft_cap = _helpers.soft_cap
fp8_decode = _helpers.fp8_decode

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)  # must be a constexpr instance, not an annotation


@triton.jit
def find_request(q_block_id, query_start_loc_ptr, num_requests, BLOCK_Q: tl.constexpr):
    """Request owning q-block ``q_block_id``.

    Request r owns the q-block ids ``[qsl[r] // BLOCK_Q + r, qsl[r + 1] // BLOCK_Q + r + 1)``:
    a contiguous range that always covers its ``ceil(query_len / BLOCK_Q)`` blocks, so the grid
    size ``T // BLOCK_Q + R`` is known on the host without reading query_start_loc (no sync).
    """
    lo = 0
    hi = num_requests - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        go_right = first_block <= q_block_id
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    return lo


@triton.jit
def paged_attention_kernel(
    query_ptr,
    pool_ptr,
    page_tables_ptr,
    kv_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    lse_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    sinks_ptr,
    soft_cap_log2,
    scale_log2,
    window_left,
    num_requests,
    num_query_tokens,
    num_query_heads,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_pool_page,
    stride_pool_kv,
    stride_pool_tok,
    stride_pt_req,
    stride_pt_head,
    stride_len_req,
    stride_len_head,
    stride_lse_tok,
    stride_lse_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    STORE_LSE: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    v_scale,
    KV_FP8: tl.constexpr,
    score_slots_ptr,
    score_begin_ptr,
    score_logits_ptr,
    score_width,
    stride_begin_slot,
    stride_begin_head,
    STORE_SCORES: tl.constexpr,
):
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    req = find_request(q_block_id, query_start_loc_ptr, num_requests, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    first_q = (q_block_id - (q_begin // BLOCK_Q + req)) * BLOCK_Q
    if first_q >= query_len:
        return  # spare block of the over-covering grid

    rows = tl.arange(0, BLOCK_M)
    q_pos = first_q + rows // GROUP
    q_head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_pos < query_len)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    token = (q_begin + q_pos).to(tl.int64)

    q = tl.load(
        query_ptr + token[:, None] * stride_q_tok + q_head[:, None] * stride_q_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    kv_len = tl.load(kv_lens_ptr + req * stride_len_req + kv_head * stride_len_head)
    # The request's new tokens are the last query_len physical positions of every head.
    context_len = kv_len - query_len
    row_limit = context_len + q_pos  # last visible physical position (inclusive)
    scan_len = context_len + tl.minimum(first_q + BLOCK_Q, query_len)
    if HAS_WINDOW:
        # The block's first query sees the earliest positions: skip the tiles before its window.
        scan_start = tl.maximum(context_len + first_q - window_left, 0) // BLOCK_N * BLOCK_N
    else:
        scan_start = 0

    if NUM_SPLITS == 1:
        scan_begin = scan_start
        scan_end = scan_len
    else:
        num_tiles = (scan_len - scan_start + BLOCK_N - 1) // BLOCK_N
        tiles_per_split = (num_tiles + NUM_SPLITS - 1) // NUM_SPLITS
        scan_begin = scan_start + split * tiles_per_split * BLOCK_N
        scan_end = tl.minimum(scan_begin + tiles_per_split * BLOCK_N, scan_len)

    page_row_ptr = page_tables_ptr + req.to(tl.int64) * stride_pt_req + kv_head * stride_pt_head
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, dtype=tl.float32)
    if HAS_SINKS:
        # exp2(sink - m) == 1 at m == sink. Only split 0 carries it, so the merge counts it once.
        sink = tl.load(sinks_ptr + q_head, mask=row_valid, other=0.0) * LOG2E
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    if STORE_SCORES:
        score_slot = tl.load(score_slots_ptr + req)
        safe_slot = tl.maximum(score_slot, 0).to(tl.int64)  # unscored: a valid address, masked
        score_begin = tl.load(
            score_begin_ptr + safe_slot * stride_begin_slot + kv_head * stride_begin_head
        )
        # An unscored request stores nothing: no offset is below a width of 0.
        score_limit = tl.where(score_slot >= 0, score_width, 0)
        score_rows = row_valid & (q_pos == query_len - 1)
        score_head = (safe_slot * tl.num_programs(1) + kv_head) * GROUP
        score_base = (score_head + rows % GROUP) * score_width

    for start in range(scan_begin, scan_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_valid = keys < scan_end
        page = tl.load(page_row_ptr + keys // PAGE_SIZE, mask=key_valid, other=0).to(tl.int64)
        token_offset = page * stride_pool_page + (keys % PAGE_SIZE) * stride_pool_tok
        k_t = tl.load(  # [HEAD_DIM_PAD, BLOCK_N], loaded transposed for the QK^T dot
            pool_ptr + token_offset[None, :] + dims[:, None],
            mask=key_valid[None, :] & dim_valid[:, None],
            other=0.0,
        )
        v = tl.load(
            pool_ptr + stride_pool_kv + token_offset[:, None] + dims[None, :],
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        if KV_FP8:
            # uint8 codes -> the query dtype (exact); the scales: K's is in scale_log2, V's
            # applied after the loop.
            k_t = fp8_decode(k_t, KV_FP8).to(q.dtype)
            v = fp8_decode(v, KV_FP8).to(q.dtype)
        if DOT_FP32:
            k_t = k_t.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2
        if HAS_SOFT_CAP:
            s = soft_cap(s, soft_cap_log2)
        visible = (keys[None, :] <= row_limit[:, None]) & key_valid[None, :]
        if HAS_WINDOW:
            visible = visible & (keys[None, :] >= row_limit[:, None] - window_left)
        s = tl.where(visible, s, float("-inf"))
        # Nested: the constexpr test prunes the names the runtime one reads.
        if STORE_SCORES:  # noqa: SIM102
            # Only tiles overlapping the scored range store (prompt tiles, unscored requests:
            # none), so the masked stores cost nothing where nothing is kept.
            if (start + BLOCK_N > score_begin) & (start < score_begin + score_limit):
                score_offsets = keys - score_begin
                score_keys = key_valid & (score_offsets >= 0) & (score_offsets < score_limit)
                tl.store(score_logits_ptr + score_base[:, None] + score_offsets[None, :], s,
                         mask=score_rows[:, None] & score_keys[None, :])
        m_new = tl.maximum(m_i, row_max(s, 1))
        # Rows that have seen no key yet keep -inf; subtract 0 there to avoid (-inf) - (-inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + row_sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if KV_FP8:
        acc = acc * v_scale  # once per output element, not per key
    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_o_tok + q_head[:, None] * stride_o_head
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
        if STORE_LSE:
            lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
            tl.store(
                lse_ptr + token * stride_lse_tok + q_head * stride_lse_head, lse, mask=row_valid
            )
    else:
        # Partials: [NUM_SPLITS, T, H_q] max/sum and [NUM_SPLITS, T, H_q, HEAD_DIM_PAD] acc.
        index = (split * num_query_tokens + token) * num_query_heads + q_head
        tl.store(partial_max_ptr + index, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + index, l_i, mask=row_valid)
        tl.store(
            partial_acc_ptr + index[:, None] * HEAD_DIM_PAD + dims[None, :],
            acc,
            mask=row_valid[:, None],
        )


@triton.jit
def combine_splits_kernel(
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    out_ptr,
    lse_ptr,
    num_query_tokens,
    num_query_heads,
    stride_o_tok,
    stride_o_head,
    stride_lse_tok,
    stride_lse_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    """Merge the split-K partial softmax states of one (query token, query head)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    index = (splits * num_query_tokens + token) * num_query_heads + head
    m = tl.load(partial_max_ptr + index)
    l_split = tl.load(partial_sum_ptr + index)
    m_max = row_max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp2(m - m_safe)
    total = row_sum(l_split * weight, 0)
    acc = tl.load(partial_acc_ptr + index[:, None] * HEAD_DIM_PAD + dims[None, :])
    total_safe = tl.where(total == 0.0, 1.0, total)
    out = row_sum(acc * weight[:, None], 0) / total_safe
    tl.store(
        out_ptr + token * stride_o_tok + head * stride_o_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )
    if STORE_LSE:
        lse = tl.where(total == 0.0, float("-inf"), (m_safe + tl.log2(total_safe)) * LN2)
        tl.store(lse_ptr + token * stride_lse_tok + head * stride_lse_head, lse)
