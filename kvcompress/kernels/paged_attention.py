"""Varlen paged attention over per-head page tables (decode and prefill chunks in one call).

Semantics shared by the torch reference and the Triton kernel:

* ``query: [T, H_q, D]`` flattened varlen queries; request r owns rows
  ``query_start_loc[r] : query_start_loc[r + 1]`` (its ``query_len`` new tokens).
* ``pool: [num_pages, 2, page_size, D]`` (index 1: 0 = K, 1 = V).
* ``page_tables: int32[R, H_kv, max_pages]``: the per-layer view (any strides with a unit last
  stride, e.g. ``tables[:, layer]``); ``kv_lens: int32[R, H_kv]``: physical length of each head,
  *including* the new tokens already written (any strides).
* Causal rule: query i (0-based in its request) of kv head h sees physical positions
  ``j <= kv_lens[r, h] - query_len + i``. GQA: query head hq uses kv head ``hq // (H_q // H_kv)``.
* fp32 softmax/accumulation, result written into ``out: [T, H_q, D]`` (query dtype). Optional
  ``lse_out: float32[T, H_q]`` receives the natural-log log-sum-exp of the scaled scores (usable by
  :func:`kvcompress.kernels.window_scores` to skip its statistics pass).
* The model's softmax (:mod:`kvcompress.kernels.logits`): ``soft_cap`` (float, None or 0 for none)
  caps every scaled score to ``soft_cap * tanh(score / soft_cap)``; ``sinks: [H_q]`` (any float
  dtype) adds one logit per query head to the softmax denominator only. The LSE includes the sink.
* ``sliding_window`` W (None or 0: full attention): query i additionally sees only the positions
  ``j >= kv_lens[r, h] - query_len + i - (W - 1)``, i.e. the W positions ``[q - W + 1, q]`` of its
  own row position q (vLLM's convention). Positions count within each head's row, so a row whose
  leading tokens were dropped (shorter ``kv_lens``, shifted page table) sees the same keys.
* fp8 pages (``kv_fp8`` = ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``, ``pool`` uint8 as
  :func:`kvcompress.kernels.write_kv` fills it): K and V are the decoded codes times ``k_scale``
  / ``v_scale``. The scales are applied once: K's folded into the logit scale, V's to the
  output; the queries keep their dtype.
* ``decode_scores`` (:class:`kvcompress.kernels.decode_mass.DecodeScoreTarget`, full attention
  only): the newest query's probabilities of chosen requests, combined over each GQA group,
  are written too; in Triton from the same logits and LSE as the output (no second K pass).
"""

from __future__ import annotations

import math

import torch

from ._common import check_paged_inputs, check_sinks, gather_head_tokens, sinks_per_row
from ._triton_support import (
    FP8_DECODE_FACTOR,
    can_run_triton,
    check_triton_device,
    device_compute_units,
    dot_in_fp32,
    dot_precision,
    fp8_kind,
    load_kernel_module,
    next_power_of_2,
    triton_softmax_args,
)
from .decode_mass import DecodeScoreTarget, decode_mass_triton, decode_scores_ref
from .logits import attention_lse, attention_probs

# Split-K: aim for this many programs per SM, never give a split fewer tokens than this.
_TARGET_PROGRAMS_PER_SM = 4
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 32
# Reference: cap on fp32 elements of one score / gathered-KV block (bounds CPU memory).
_REF_BLOCK_ELEMENTS = 1 << 25


def paged_attention(
    query: torch.Tensor,
    pool: torch.Tensor,
    page_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    lse_out: torch.Tensor | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    max_kv_len: int | None = None,
    num_splits: int | None = None,
    kv_fp8: torch.dtype | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    use_triton: bool | None = None,
    decode_scores: DecodeScoreTarget | None = None,
) -> torch.Tensor:
    """Dispatch: Triton on GPU tensors (or under ``TRITON_INTERPRET=1``), torch otherwise.

    The hints only matter to Triton; see :func:`paged_attention_triton`.
    """
    if use_triton is None:
        use_triton = query.is_cuda and can_run_triton(query)
    if use_triton:
        return paged_attention_triton(
            query, pool, page_tables, kv_lens, query_start_loc, scale, out,
            lse_out=lse_out, soft_cap=soft_cap, sinks=sinks, sliding_window=sliding_window,
            max_query_len=max_query_len, max_kv_len=max_kv_len, num_splits=num_splits,
            kv_fp8=kv_fp8, k_scale=k_scale, v_scale=v_scale,
            decode_scores=decode_scores,
        )
    return paged_attention_ref(
        query, pool, page_tables, kv_lens, query_start_loc, scale, out, lse_out=lse_out,
        soft_cap=soft_cap, sinks=sinks, sliding_window=sliding_window, kv_fp8=kv_fp8,
        k_scale=k_scale, v_scale=v_scale, decode_scores=decode_scores,
    )


def window_left_extent(sliding_window: int | None) -> int:
    """How many positions before its own a query sees under ``sliding_window`` W: W - 1, or
    -1 for full attention (None or 0)."""
    if sliding_window is None or sliding_window == 0:
        return -1
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be None, 0 (full) or positive, got {sliding_window}")
    return int(sliding_window) - 1


def _check_decode_scores(target: DecodeScoreTarget | None, num_requests: int,
                         num_kv_heads: int, sliding_window: int | None) -> None:
    if target is None:
        return
    target.check(num_requests, num_kv_heads)
    if window_left_extent(sliding_window) >= 0:
        # Sliding-window layers are never compressed by a policy, so never scored.
        raise ValueError("decode_scores are not taken on sliding-window layers")


# --------------------------------------------------------------------------- torch reference


def paged_attention_ref(
    query: torch.Tensor,
    pool: torch.Tensor,
    page_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    lse_out: torch.Tensor | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    max_kv_len: int | None = None,
    kv_fp8: torch.dtype | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    decode_scores: DecodeScoreTarget | None = None,
) -> torch.Tensor:
    """Torch reference (any device, GPU page format).

    Decode requests are batched together; prefill chunks run per request, in row blocks.

    ``max_query_len`` / ``max_kv_len`` are accepted for signature parity and ignored.
    """
    del max_query_len, max_kv_len
    num_requests, num_kv_heads, _ = check_paged_inputs(
        query, pool, page_tables, kv_lens, query_start_loc
    )
    check_sinks(sinks, query.shape[1])
    fp8_kind(kv_fp8, pool)  # validates the fp8 arguments
    _check_decode_scores(decode_scores, num_requests, num_kv_heads, sliding_window)
    if decode_scores is not None:
        decode_scores_ref(query, pool, page_tables, kv_lens, query_start_loc, scale,
                          decode_scores, soft_cap=soft_cap, sinks=sinks, kv_fp8=kv_fp8,
                          k_scale=k_scale)
    softmax = dict(soft_cap=soft_cap, sinks=sinks,
                   window_left=window_left_extent(sliding_window))
    if kv_fp8 is not None:
        scale = scale * k_scale  # K's scale folded into the logit scale, V's in _attend_rows
    fp8 = dict(kv_fp8=kv_fp8, v_scale=v_scale)
    starts = query_start_loc.tolist()
    lens_cpu = kv_lens.to("cpu", torch.long)
    head_size = pool.shape[3]

    decode_requests = [r for r in range(num_requests) if starts[r + 1] - starts[r] == 1]
    if decode_requests:
        # Batch decode requests, a block of them at a time to bound the gathered K/V size.
        per_request = num_kv_heads * max(1, int(lens_cpu[decode_requests].max())) * head_size
        block = max(1, _REF_BLOCK_ELEMENTS // per_request)
        for i in range(0, len(decode_requests), block):
            chunk = decode_requests[i : i + block]
            tokens = torch.tensor([starts[r] for r in chunk]).unsqueeze(1)
            _attend_rows(
                query, pool, page_tables, lens_cpu, scale, out, lse_out, chunk, tokens,
                query_positions=torch.zeros_like(tokens), query_lens=torch.ones(len(chunk)),
                **softmax, **fp8,
            )

    for r in range(num_requests):
        query_len = starts[r + 1] - starts[r]
        if query_len <= 1:
            continue
        max_len = max(1, int(lens_cpu[r].max()))
        rows_per_chunk = max(1, _REF_BLOCK_ELEMENTS // (query.shape[1] * max_len))
        for first in range(0, query_len, rows_per_chunk):
            positions = torch.arange(first, min(first + rows_per_chunk, query_len)).unsqueeze(0)
            _attend_rows(
                query, pool, page_tables, lens_cpu, scale, out, lse_out, [r],
                starts[r] + positions, query_positions=positions,
                query_lens=torch.tensor([query_len]), **softmax, **fp8,
            )
    return out


def _attend_rows(
    query: torch.Tensor,
    pool: torch.Tensor,
    page_tables: torch.Tensor,
    lens_cpu: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse_out: torch.Tensor | None,
    requests: list[int],
    tokens: torch.Tensor,
    query_positions: torch.Tensor,
    query_lens: torch.Tensor,
    soft_cap: float | None,
    sinks: torch.Tensor | None,
    window_left: int,
    kv_fp8: torch.dtype | None,
    v_scale: float,
) -> None:
    """Attention for ``tokens: [B, n]`` (global query rows) of ``requests`` (B of them);
    ``window_left``: positions before its own a query sees (-1: all). fp8 pages: K/V decoded
    unscaled (``scale`` holds K's scale), V's scale applied to the result."""
    num_requests = len(requests)
    num_tokens = tokens.shape[1]
    num_kv_heads = page_tables.shape[1]
    num_query_heads = query.shape[1]
    group = num_query_heads // num_kv_heads
    head_size = pool.shape[3]
    request_index = torch.tensor(requests)
    lens = lens_cpu[request_index]  # [B, H_kv]
    max_len = max(1, int(lens.max()))

    page_rows = page_tables[request_index.to(page_tables.device)].flatten(0, 1)
    keys, values, _ = gather_head_tokens(pool, page_rows, lens.flatten(), max_len)
    if kv_fp8 is not None:
        keys, values = keys.view(kv_fp8), values.view(kv_fp8)
    keys = keys.reshape(num_requests, num_kv_heads, max_len, head_size).float()
    values = values.reshape(num_requests, num_kv_heads, max_len, head_size).float()

    flat_tokens = tokens.flatten().to(query.device)
    q = query[flat_tokens].float().view(num_requests, num_tokens, num_kv_heads, group, head_size)
    q = q.permute(0, 2, 3, 1, 4).reshape(num_requests, num_kv_heads, group * num_tokens, head_size)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [B, H_kv, G * n, L]

    # Row (g, i) of head h sees positions <= len[h] - query_len + i (and, with a window,
    # >= that limit - window_left).
    limits = lens[:, :, None] - query_lens.view(-1, 1, 1).long() + query_positions[:, None, :]
    limits = limits[:, :, None, :].expand(-1, -1, group, -1).reshape(
        num_requests, num_kv_heads, group * num_tokens
    )
    positions = torch.arange(max_len)
    visible = positions.view(1, 1, 1, -1) <= limits.unsqueeze(-1)
    if window_left >= 0:
        visible &= positions.view(1, 1, 1, -1) >= (limits - window_left).unsqueeze(-1)
    visible = visible.to(scores.device)
    scores = scores.masked_fill(~visible, float("-inf"))

    row_sinks = sinks_per_row(sinks, num_kv_heads, num_tokens)
    probs = attention_probs(scores, soft_cap, row_sinks).nan_to_num_(0.0)  # no key seen: 0
    result = torch.matmul(probs, values)  # [B, H_kv, G * n, D]
    if kv_fp8 is not None:
        result = result * v_scale

    result = result.view(num_requests, num_kv_heads, group, num_tokens, head_size)
    result = result.permute(0, 3, 1, 2, 4).reshape(-1, num_query_heads, head_size)
    out[flat_tokens] = result.to(out.dtype)
    if lse_out is not None:
        lse = attention_lse(scores, soft_cap, row_sinks)
        lse = lse.view(num_requests, num_kv_heads, group, num_tokens).permute(0, 3, 1, 2)
        lse_out[flat_tokens] = lse.reshape(-1, num_query_heads).to(lse_out.dtype)


# --------------------------------------------------------------------------- Triton launcher


def paged_attention_triton(
    query: torch.Tensor,
    pool: torch.Tensor,
    page_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    lse_out: torch.Tensor | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    max_kv_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    kv_fp8: torch.dtype | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    decode_scores: DecodeScoreTarget | None = None,
) -> torch.Tensor:
    """Triton launch of the same computation.

    Hints (pass them from host-side metadata to avoid device->host syncs, e.g. under CUDA graph
    capture): ``max_query_len`` (picks the decode or prefill tile; synced from query_start_loc when
    None) and ``max_kv_len`` (bounds split-K; synced from kv_lens only when splitting is
    considered). ``num_splits`` (power of two), ``block_n``, ``num_warps``, ``num_stages`` override
    the heuristics (benchmark sweeps). With a ``sliding_window`` each program scans only the
    keys its queries can see (from the first one's window start, floored to ``block_n``).
    fp8 pages: the scales are host floats (no device read); K's joins the logit scale.
    """
    num_requests, num_kv_heads, group = check_paged_inputs(
        query, pool, page_tables, kv_lens, query_start_loc
    )
    check_triton_device(query, pool, page_tables, kv_lens, query_start_loc, out)
    check_sinks(sinks, query.shape[1])
    window_left = window_left_extent(sliding_window)
    kind = fp8_kind(kv_fp8, pool)
    if not kind and query.dtype != pool.dtype:
        raise TypeError(f"query dtype {query.dtype} != pool dtype {pool.dtype}")
    if kind:  # the scales, with what the kernel's decode leaves out, applied once each
        scale = float(scale) * float(k_scale) * FP8_DECODE_FACTOR[kind]
        v_scale = float(v_scale) * FP8_DECODE_FACTOR[kind]
    if query.stride(-1) != 1 or out.stride(-1) != 1 or page_tables.stride(-1) != 1:
        raise ValueError("query, out and page_tables need a unit stride in their last dimension")
    if out.shape != query.shape:
        raise ValueError(f"out shape {tuple(out.shape)} != query shape {tuple(query.shape)}")
    num_tokens, num_query_heads, head_size = query.shape
    if num_requests == 0 or num_tokens == 0:
        return out
    if lse_out is not None and (lse_out.shape != (num_tokens, num_query_heads)
                                or lse_out.dtype != torch.float32):
        raise ValueError("lse_out must be float32 [T, H_q]")
    _check_decode_scores(decode_scores, num_requests, num_kv_heads, sliding_window)
    store_scores = decode_scores is not None and decode_scores.mass.shape[0] > 0 \
        and decode_scores.width > 0
    if store_scores and lse_out is None:
        # The finishing kernel needs every scored row's final LSE.
        lse_out = torch.empty((num_tokens, num_query_heads), dtype=torch.float32,
                              device=query.device)

    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    # Decode: one query token per request, a 16-row tile is the smallest tl.dot; prefill: 64 rows.
    block_m = max(16 if max_query_len <= 1 else 64, next_power_of_2(group))
    block_q = block_m // group
    grid_q_blocks = num_tokens // block_q + num_requests
    head_dim_pad = next_power_of_2(head_size)
    if block_n is None:
        block_n = 64 if head_dim_pad <= 128 else 32

    if num_splits is None:
        active_blocks = min(grid_q_blocks, num_requests * math.ceil(max_query_len / block_q))
        target = _TARGET_PROGRAMS_PER_SM * device_compute_units(query.device)
        num_splits = 1
        if active_blocks * num_kv_heads < target:
            # A program scans at most window - 1 + block_q keys (+ < block_n from flooring).
            window_span = window_left + block_q + block_n if window_left >= 0 else None
            if max_kv_len is None:
                max_kv_len = window_span or int(kv_lens.max())
            elif window_span is not None:
                max_kv_len = min(max_kv_len, window_span)
            by_occupancy = next_power_of_2(math.ceil(target / (active_blocks * num_kv_heads)))
            by_length = max(1, max_kv_len // _MIN_TOKENS_PER_SPLIT)
            num_splits = max(1, min(by_occupancy, _MAX_SPLITS, 1 << (by_length.bit_length() - 1)))
    if num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")

    store_lse = lse_out is not None
    lse_arg = lse_out if store_lse else out  # dummy pointer when unused
    lse_strides = lse_out.stride() if store_lse else (0, 0)
    if num_splits > 1:
        partial_acc = torch.empty(
            (num_splits, num_tokens, num_query_heads, head_dim_pad),
            dtype=torch.float32, device=query.device,
        )
        partial_max = torch.empty(
            (num_splits, num_tokens, num_query_heads), dtype=torch.float32, device=query.device
        )
        partial_sum = torch.empty_like(partial_max)
    else:
        partial_acc = partial_max = partial_sum = out  # unused

    if store_scores:
        # Written only where the finishing kernel reads (scored rows, inside each row).
        score_logits = torch.empty(
            (decode_scores.mass.shape[0], num_kv_heads, group, decode_scores.width),
            dtype=torch.float32, device=query.device,
        )
        score_args = (decode_scores.slots, decode_scores.begin, score_logits,
                      decode_scores.width, *decode_scores.begin.stride())
    else:
        score_args = (kv_lens, kv_lens, out, 0, 0, 0)  # dummies, never read

    softmax_args, softmax_flags = triton_softmax_args(soft_cap, sinks, query)
    kernels = load_kernel_module("_paged_attention_triton")
    kernels.paged_attention_kernel[(grid_q_blocks, num_kv_heads, num_splits)](
        query, pool, page_tables, kv_lens, query_start_loc,
        out, lse_arg, partial_acc, partial_max, partial_sum, *softmax_args,
        float(scale) * math.log2(math.e),
        max(window_left, 0),
        num_requests, num_tokens, num_query_heads,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        pool.stride(0), pool.stride(1), pool.stride(2),
        page_tables.stride(0), page_tables.stride(1),
        kv_lens.stride(0), kv_lens.stride(1),
        lse_strides[0], lse_strides[1],
        GROUP=group,
        HEAD_DIM=head_size,
        HEAD_DIM_PAD=head_dim_pad,
        PAGE_SIZE=pool.shape[2],
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        STORE_LSE=store_lse and num_splits == 1,
        **softmax_flags,
        HAS_WINDOW=window_left >= 0,
        DOT_FP32=dot_in_fp32(query.dtype),
        DOT_PRECISION=dot_precision(query.dtype),
        v_scale=float(v_scale),
        KV_FP8=kind,
        score_slots_ptr=score_args[0],
        score_begin_ptr=score_args[1],
        score_logits_ptr=score_args[2],
        score_width=score_args[3],
        stride_begin_slot=score_args[4],
        stride_begin_head=score_args[5],
        STORE_SCORES=store_scores,
        num_warps=num_warps or (4 if block_m <= 64 else 8),
        num_stages=num_stages or 2,
    )
    if num_splits > 1:
        kernels.combine_splits_kernel[(num_tokens, num_query_heads)](
            partial_acc, partial_max, partial_sum, out, lse_arg,
            num_tokens, num_query_heads,
            out.stride(0), out.stride(1),
            lse_strides[0], lse_strides[1],
            HEAD_DIM=head_size,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_splits,
            STORE_LSE=store_lse,
            num_warps=4,
        )
    if store_scores:
        decode_mass_triton(score_logits, lse_out, query_start_loc, kv_lens, decode_scores)
    return out
