"""Observation-window scores (SnapKV / PyramidKV selection input, H2O-style accumulation).

``window_scores(query, pool, page_tables, kv_lens, query_start_loc, window_start, scale,
scores_out)`` with the same batch arguments as :func:`paged_attention` (call it on the layer's
K/V *after* the new tokens were written, typically on the last prefill chunk) and:

* ``window_start: int32[R]`` index, within each request's ``query_len`` rows of this batch, of the
  first window row. Rows ``window_start[r] .. query_len - 1`` are the window; ``window_start[r] ==
  query_len`` means the request has no window rows in this call (it is skipped). For a prompt of
  length S and window W whose last chunk has ``query_len`` rows: ``max(0, query_len - W)`` (the
  window's earlier rows, if they fell into a previous chunk, are not covered: make the last chunk
  at least W long, or call once per chunk that holds window rows).
* ``scores_out: float32[R, H_kv, S_max]`` (unit last stride), S_max >= every kv_lens[r, h] of a
  request with window rows. The kernel ADDS, for each kv head h and physical position j, the sum
  over window rows i and over the GROUP query heads of h of softmax(scale * q . k)[j] (fp32, same
  causal rule as attention: j <= kv_lens[r, h] - query_len + i). Positions a row cannot see
  receive 0 from it; positions >= kv_lens[r, h] are left untouched. The group reduction is a SUM
  (divide by GROUP for the mean).
* ``softmax_lse: float32[T, H_q]`` optional natural-log log-sum-exp of the scaled scores of every
  row, e.g. ``lse_out`` of :func:`paged_attention` on the same batch; saves the statistics pass.
* ``soft_cap`` / ``sinks [H_q]``: the model's softmax, as in :func:`paged_attention`
  (:mod:`kvcompress.kernels.logits`): probabilities of soft-capped scores, and with sinks each
  row's probabilities over real keys sum to less than 1 (the sink takes the rest). A given
  ``softmax_lse`` must come from the same softmax.
* fp8 pages (``kv_fp8``, ``pool`` uint8, as in :func:`paged_attention`): keys are the decoded
  codes times ``k_scale``, folded into the logit scale once (V is not read).

H2O-style decode accumulation: call it on a decode batch with ``window_start = 0`` (the window is
the decode token itself), ideally with the attention's ``lse_out``.
"""

from __future__ import annotations

import math

import torch

from ._common import check_paged_inputs, check_sinks, gather_head_tokens, sinks_per_row
from ._triton_support import (
    FP8_DECODE_FACTOR,
    can_run_triton,
    check_triton_device,
    dot_in_fp32,
    dot_precision,
    fp8_kind,
    load_kernel_module,
    next_power_of_2,
    triton_softmax_args,
)
from .logits import attention_probs

_REF_BLOCK_ELEMENTS = 1 << 25


def window_scores(
    query: torch.Tensor,
    pool: torch.Tensor,
    page_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    window_start: torch.Tensor,
    scale: float,
    scores_out: torch.Tensor,
    *,
    softmax_lse: torch.Tensor | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    max_window_len: int | None = None,
    max_kv_len: int | None = None,
    kv_fp8: torch.dtype | None = None,
    k_scale: float = 1.0,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Dispatch: Triton on GPU tensors (or under ``TRITON_INTERPRET=1``), torch otherwise."""
    if use_triton is None:
        use_triton = query.is_cuda and can_run_triton(query)
    if use_triton:
        return window_scores_triton(
            query, pool, page_tables, kv_lens, query_start_loc, window_start, scale, scores_out,
            softmax_lse=softmax_lse, soft_cap=soft_cap, sinks=sinks,
            max_window_len=max_window_len, max_kv_len=max_kv_len, kv_fp8=kv_fp8,
            k_scale=k_scale,
        )
    return window_scores_ref(
        query, pool, page_tables, kv_lens, query_start_loc, window_start, scale, scores_out,
        soft_cap=soft_cap, sinks=sinks, kv_fp8=kv_fp8, k_scale=k_scale,
    )


def _check(
    query: torch.Tensor,
    pool: torch.Tensor,
    page_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    window_start: torch.Tensor,
    scores_out: torch.Tensor,
) -> tuple[int, int, int]:
    num_requests, num_kv_heads, group = check_paged_inputs(
        query, pool, page_tables, kv_lens, query_start_loc
    )
    if window_start.shape != (num_requests,) or window_start.dtype != torch.int32:
        raise ValueError(f"window_start must be int32 [{num_requests}]")
    if (
        scores_out.dim() != 3
        or tuple(scores_out.shape[:2]) != (num_requests, num_kv_heads)
        or scores_out.dtype != torch.float32
        or scores_out.stride(-1) != 1
    ):
        raise ValueError(
            f"scores_out must be float32 [{num_requests}, {num_kv_heads}, S_max] with a unit last "
            f"stride, got {scores_out.dtype} {tuple(scores_out.shape)}"
        )
    return num_requests, num_kv_heads, group


def window_scores_ref(
    query: torch.Tensor,
    pool: torch.Tensor,
    page_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    window_start: torch.Tensor,
    scale: float,
    scores_out: torch.Tensor,
    *,
    softmax_lse: torch.Tensor | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    max_window_len: int | None = None,
    max_kv_len: int | None = None,
    kv_fp8: torch.dtype | None = None,
    k_scale: float = 1.0,
) -> torch.Tensor:
    """Torch reference (any device, GPU page format), one request at a time.

    Hints and ``softmax_lse`` are accepted for signature parity and ignored.
    """
    del softmax_lse, max_window_len, max_kv_len
    num_requests, num_kv_heads, group = _check(
        query, pool, page_tables, kv_lens, query_start_loc, window_start, scores_out
    )
    check_sinks(sinks, query.shape[1])
    if fp8_kind(kv_fp8, pool):
        scale = scale * k_scale  # K's scale folded into the logit scale
    starts = query_start_loc.tolist()
    windows = window_start.tolist()
    lens_cpu = kv_lens.to("cpu", torch.long)
    head_size = pool.shape[3]
    for r in range(num_requests):
        query_len = starts[r + 1] - starts[r]
        if windows[r] >= query_len:
            continue
        lens = lens_cpu[r]
        max_len = int(lens.max())
        if max_len > scores_out.shape[2]:
            raise ValueError(f"scores_out holds {scores_out.shape[2]} positions, need {max_len}")
        keys, _, _ = gather_head_tokens(pool, page_tables[r], lens, max_len)
        if kv_fp8 is not None:
            keys = keys.view(kv_fp8)
        keys = keys.float()  # [H_kv, L, D]
        rows_per_chunk = max(1, _REF_BLOCK_ELEMENTS // (query.shape[1] * max(1, max_len)))
        for first in range(windows[r], query_len, rows_per_chunk):
            positions = torch.arange(first, min(first + rows_per_chunk, query_len))
            n = positions.numel()
            q = query[starts[r] + positions.to(query.device)].float()  # [n, H_q, D]
            q = q.view(n, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
            q = q.reshape(num_kv_heads, group * n, head_size)
            scores = torch.matmul(q, keys.transpose(1, 2)) * scale  # [H_kv, G * n, L]
            limits = lens[:, None] - query_len + positions[None, :]  # [H_kv, n]
            limits = limits[:, None, :].expand(-1, group, -1).reshape(num_kv_heads, group * n)
            visible = torch.arange(max_len)[None, None, :] <= limits[:, :, None]
            scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
            row_sinks = sinks_per_row(sinks, num_kv_heads, n)
            probs = attention_probs(scores, soft_cap, row_sinks).nan_to_num_(0.0)  # nothing seen
            scores_out[r, :, :max_len] += probs.sum(dim=1)
    return scores_out


def window_scores_triton(
    query: torch.Tensor,
    pool: torch.Tensor,
    page_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    window_start: torch.Tensor,
    scale: float,
    scores_out: torch.Tensor,
    *,
    softmax_lse: torch.Tensor | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    max_window_len: int | None = None,
    max_kv_len: int | None = None,
    block_n: int | None = None,
    kv_fp8: torch.dtype | None = None,
    k_scale: float = 1.0,
) -> torch.Tensor:
    """Triton launch.

    ``max_window_len`` (most window rows of one request; synced from the inputs when None) and
    ``max_kv_len`` (largest kv_lens entry; only shrinks the grid, defaults to S_max) are host hints.
    """
    num_requests, num_kv_heads, group = _check(
        query, pool, page_tables, kv_lens, query_start_loc, window_start, scores_out
    )
    check_triton_device(query, pool, page_tables, kv_lens, query_start_loc, window_start)
    check_sinks(sinks, query.shape[1])
    kind = fp8_kind(kv_fp8, pool)
    if not kind and query.dtype != pool.dtype:
        raise TypeError(f"query dtype {query.dtype} != pool dtype {pool.dtype}")
    if kind:  # host floats (no device read), with what the kernel's decode leaves out
        scale = float(scale) * float(k_scale) * FP8_DECODE_FACTOR[kind]
    num_tokens, num_query_heads, head_size = query.shape
    if num_requests == 0 or num_tokens == 0:
        return scores_out
    if max_window_len is None:
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        max_window_len = int((query_lens - window_start).clamp_min(0).max())
    if max_window_len <= 0:
        return scores_out

    block_m = max(16 if max_window_len == 1 else 64, next_power_of_2(group))
    block_q = block_m // group
    block_n = block_n or 64
    head_dim_pad = next_power_of_2(head_size)
    scale_log2 = float(scale) * math.log2(math.e)
    (sinks_arg, soft_cap_log2), softmax_flags = triton_softmax_args(soft_cap, sinks, query)
    common = dict(
        GROUP=group,
        HEAD_DIM=head_size,
        HEAD_DIM_PAD=head_dim_pad,
        PAGE_SIZE=pool.shape[2],
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        DOT_FP32=dot_in_fp32(query.dtype),
        DOT_PRECISION=dot_precision(query.dtype),
        HAS_SOFT_CAP=softmax_flags["HAS_SOFT_CAP"],
        KV_FP8=kind,
        num_warps=4,
    )
    kernels = load_kernel_module("_window_scores_triton")
    if softmax_lse is None:
        softmax_lse = torch.empty(
            (num_tokens, num_query_heads), dtype=torch.float32, device=query.device
        )
        window_blocks = -(-max_window_len // block_q)
        kernels.window_lse_kernel[(num_requests, num_kv_heads, window_blocks)](
            query, pool, page_tables, kv_lens, query_start_loc, window_start, softmax_lse,
            sinks_arg, soft_cap_log2, scale_log2,
            query.stride(0), query.stride(1),
            pool.stride(0), pool.stride(1), pool.stride(2),
            page_tables.stride(0), page_tables.stride(1),
            kv_lens.stride(0), kv_lens.stride(1),
            softmax_lse.stride(0), softmax_lse.stride(1),
            HAS_SINKS=softmax_flags["HAS_SINKS"],
            **common,
        )
    elif softmax_lse.shape != (num_tokens, num_query_heads) or softmax_lse.dtype != torch.float32:
        raise ValueError("softmax_lse must be float32 [T, H_q]")

    max_positions = scores_out.shape[2]
    grid_positions = min(max_positions, max_kv_len) if max_kv_len is not None else max_positions
    kernels.window_scores_kernel[(num_requests, num_kv_heads, -(-grid_positions // block_n))](
        query, pool, page_tables, kv_lens, query_start_loc, window_start, softmax_lse, scores_out,
        soft_cap_log2, scale_log2, max_positions,
        query.stride(0), query.stride(1),
        pool.stride(0), pool.stride(1), pool.stride(2),
        page_tables.stride(0), page_tables.stride(1),
        kv_lens.stride(0), kv_lens.stride(1),
        softmax_lse.stride(0), softmax_lse.stride(1),
        scores_out.stride(0), scores_out.stride(1),
        **common,
    )
    return scores_out
