"""Triton kernels for observation-window scores. Loaded lazily by ``window_scores.py``.

Two passes, both gathering keys through the per-head page tables:
1. ``window_lse_kernel`` (grid: request, kv head, window block): log-sum-exp of every window row,
   online, keys only. Skipped when the caller passes the LSE from the attention kernel.
2. ``window_scores_kernel`` (grid: request, kv head, key tile): loads its key tile once, loops
   over the window rows (BLOCK_Q tokens x GROUP heads per step), sums their probabilities per key
   and adds the column sums into ``scores[r, h, tile]``. Each program owns its tile: no atomics,
   deterministic.
Scores are soft-capped before the softmax when HAS_SOFT_CAP; a sink logit per query head
(HAS_SINKS) starts pass 1's running max and sum, so it is in the LSE that pass 2 divides by.
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
def window_lse_kernel(
    query_ptr,
    pool_ptr,
    page_tables_ptr,
    kv_lens_ptr,
    query_start_loc_ptr,
    window_start_ptr,
    lse_ptr,
    sinks_ptr,
    soft_cap_log2,
    scale_log2,
    stride_q_tok,
    stride_q_head,
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
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_begin = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    first_q = tl.load(window_start_ptr + req) + tl.program_id(2) * BLOCK_Q
    if first_q >= query_len:
        return

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
    context_len = kv_len - query_len
    row_limit = context_len + q_pos
    scan_len = context_len + tl.minimum(first_q + BLOCK_Q, query_len)
    page_row_ptr = page_tables_ptr + req.to(tl.int64) * stride_pt_req + kv_head * stride_pt_head

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    if HAS_SINKS:
        # The sink joins the denominator: exp2(sink - m) == 1 at m == sink.
        m_i = tl.load(sinks_ptr + q_head, mask=row_valid, other=0.0) * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    for start in range(0, scan_len, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_valid = keys < scan_len
        page = tl.load(page_row_ptr + keys // PAGE_SIZE, mask=key_valid, other=0).to(tl.int64)
        token_offset = page * stride_pool_page + (keys % PAGE_SIZE) * stride_pool_tok
        k_t = tl.load(
            pool_ptr + token_offset[None, :] + dims[:, None],
            mask=key_valid[None, :] & dim_valid[:, None],
            other=0.0,
        )
        if KV_FP8:  # uint8 codes -> the query dtype; K's scale is in scale_log2
            k_t = fp8_decode(k_t, KV_FP8).to(q.dtype)
        if DOT_FP32:
            k_t = k_t.to(tl.float32)
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2
        if HAS_SOFT_CAP:
            s = soft_cap(s, soft_cap_log2)
        s = tl.where((keys[None, :] <= row_limit[:, None]) & key_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, row_max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + row_sum(tl.exp2(s - m_safe[:, None]), 1)
        m_i = m_new

    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i))) * LN2)
    tl.store(lse_ptr + token * stride_lse_tok + q_head * stride_lse_head, lse, mask=row_valid)


@triton.jit
def window_scores_kernel(
    query_ptr,
    pool_ptr,
    page_tables_ptr,
    kv_lens_ptr,
    query_start_loc_ptr,
    window_start_ptr,
    lse_ptr,
    scores_ptr,
    soft_cap_log2,
    scale_log2,
    max_positions,
    stride_q_tok,
    stride_q_head,
    stride_pool_page,
    stride_pool_kv,
    stride_pool_tok,
    stride_pt_req,
    stride_pt_head,
    stride_len_req,
    stride_len_head,
    stride_lse_tok,
    stride_lse_head,
    stride_sc_req,
    stride_sc_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile_start = tl.program_id(2) * BLOCK_N
    q_begin = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    window_start = tl.load(window_start_ptr + req)
    kv_len = tl.load(kv_lens_ptr + req * stride_len_req + kv_head * stride_len_head)
    context_len = kv_len - query_len
    # Window rows before this one see no key of the tile (their limit is below tile_start).
    first_q = tl.maximum(window_start, tile_start - context_len)
    if first_q >= query_len:
        return

    keys = tile_start + tl.arange(0, BLOCK_N)
    key_valid = (keys < kv_len) & (keys < max_positions)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    page_row_ptr = page_tables_ptr + req.to(tl.int64) * stride_pt_req + kv_head * stride_pt_head
    page = tl.load(page_row_ptr + keys // PAGE_SIZE, mask=key_valid, other=0).to(tl.int64)
    token_offset = page * stride_pool_page + (keys % PAGE_SIZE) * stride_pool_tok
    k_t = tl.load(
        pool_ptr + token_offset[None, :] + dims[:, None],
        mask=key_valid[None, :] & dim_valid[:, None],
        other=0.0,
    )
    if KV_FP8:  # uint8 codes -> the query dtype; K's scale is in scale_log2
        k_t = fp8_decode(k_t, KV_FP8).to(query_ptr.dtype.element_ty)
    if DOT_FP32:
        k_t = k_t.to(tl.float32)

    rows = tl.arange(0, BLOCK_M)
    column_sums = tl.full([BLOCK_N], 0.0, dtype=tl.float32)
    for block_first_q in range(first_q, query_len, BLOCK_Q):
        q_pos = block_first_q + rows // GROUP
        q_head = kv_head * GROUP + rows % GROUP
        row_valid = (rows < BLOCK_Q * GROUP) & (q_pos < query_len)
        token = (q_begin + q_pos).to(tl.int64)
        q = tl.load(
            query_ptr + token[:, None] * stride_q_tok + q_head[:, None] * stride_q_head
            + dims[None, :],
            mask=row_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        if DOT_FP32:
            q = q.to(tl.float32)
        lse_log2 = tl.load(
            lse_ptr + token * stride_lse_tok + q_head * stride_lse_head, mask=row_valid, other=0.0
        ) * LOG2E
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2
        if HAS_SOFT_CAP:
            s = soft_cap(s, soft_cap_log2)
        visible = (keys[None, :] <= (context_len + q_pos)[:, None]) & key_valid[None, :]
        visible = visible & row_valid[:, None]
        probs = tl.where(visible, tl.exp2(s - lse_log2[:, None]), 0.0)
        column_sums += row_sum(probs, 0)

    score_ptrs = scores_ptr + req.to(tl.int64) * stride_sc_req + kv_head * stride_sc_head + keys
    current = tl.load(score_ptrs, mask=key_valid, other=0.0)
    tl.store(score_ptrs, current + column_sums, mask=key_valid)
