"""Shared torch helpers for the reference kernels: page-table gathers and argument checks."""

from __future__ import annotations

import torch

K_INDEX = 0  # pool[:, 0] holds keys
V_INDEX = 1  # pool[:, 1] holds values


def check_pool(pool: torch.Tensor) -> tuple[int, int]:
    """Validate ``pool: [num_pages, 2, page_size, head_size]``; returns (page_size, head_size)."""
    if pool.dim() != 4 or pool.shape[1] != 2:
        raise ValueError(
            f"pool must be [num_pages, 2, page_size, head_size], got {tuple(pool.shape)}"
        )
    page_size = pool.shape[2]
    if page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    if pool.stride(-1) != 1:
        raise ValueError("pool must be contiguous in its last (head_size) dimension")
    return page_size, pool.shape[3]


def check_paged_inputs(
    query: torch.Tensor,
    pool: torch.Tensor,
    page_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> tuple[int, int, int]:
    """Validate the shared paged-attention arguments; returns (num_requests, kv_heads, group)."""
    _, head_size = check_pool(pool)
    if query.dim() != 3 or query.shape[2] != head_size:
        raise ValueError(f"query must be [T, H_q, {head_size}], got {tuple(query.shape)}")
    num_requests = query_start_loc.numel() - 1
    if page_tables.dim() != 3 or page_tables.shape[0] != num_requests:
        raise ValueError(
            f"page_tables must be [R={num_requests}, H_kv, max_pages], "
            f"got {tuple(page_tables.shape)}"
        )
    num_kv_heads = page_tables.shape[1]
    if tuple(kv_lens.shape) != (num_requests, num_kv_heads):
        raise ValueError(
            f"kv_lens must be [{num_requests}, {num_kv_heads}], got {tuple(kv_lens.shape)}"
        )
    if query.shape[1] % num_kv_heads:
        raise ValueError(
            f"{query.shape[1]} query heads are not a multiple of {num_kv_heads} KV heads"
        )
    for name, tensor in (
        ("page_tables", page_tables),
        ("kv_lens", kv_lens),
        ("query_start_loc", query_start_loc),
    ):
        if tensor.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {tensor.dtype}")
    return num_requests, num_kv_heads, query.shape[1] // num_kv_heads


def gather_head_tokens(
    pool: torch.Tensor, page_rows: torch.Tensor, lengths: torch.Tensor, max_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather K and V of the first ``max_len`` physical positions of several heads.

    page_rows: int [N, max_pages] page tables; lengths: int [N]. Returns K, V as [N, max_len, D]
    (positions >= the head's length read page 0 and must be masked by the caller) and the
    validity mask [N, max_len].
    """
    page_size = pool.shape[2]
    positions = torch.arange(max_len, device=pool.device)
    valid = positions[None, :] < lengths[:, None].to(positions.device)
    page_index = (positions // page_size).clamp_max(max(page_rows.shape[1] - 1, 0))
    pages = page_rows.to(pool.device).long()[:, page_index]
    pages = torch.where(valid, pages, torch.zeros_like(pages))  # padding may hold garbage (-1)
    offsets = (positions % page_size).expand_as(pages)
    kv = pool[pages, :, offsets]  # [N, max_len, 2, D]
    # Zero what lies beyond each head's length: stale slots may hold anything (even NaN).
    kv = kv.masked_fill(~valid[:, :, None, None], 0)
    return kv[:, :, K_INDEX], kv[:, :, V_INDEX], valid


def slots_to_page_offset(slots: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split flat slots (page * page_size + offset) into (page, offset)."""
    return torch.div(slots, page_size, rounding_mode="floor"), slots % page_size


def check_sinks(sinks: torch.Tensor | None, num_query_heads: int) -> None:
    """Attention sinks are one logit per query head: ``[H_q]``, floating point."""
    if sinks is None:
        return
    if tuple(sinks.shape) != (num_query_heads,) or not sinks.is_floating_point():
        raise ValueError(
            f"sinks must be a float tensor [{num_query_heads}], got {sinks.dtype} "
            f"{tuple(sinks.shape)}"
        )


def sinks_per_row(sinks: torch.Tensor | None, num_kv_heads: int, rows_per_query_head: int
                  ) -> torch.Tensor | None:
    """``sinks [H_q]`` laid out like score rows ``[H_kv, GROUP * n]`` (group-major, as the
    references order them: row ``g * n + i`` is query head ``h * GROUP + g``, token i)."""
    if sinks is None:
        return None
    grouped = sinks.view(num_kv_heads, -1, 1)
    return grouped.expand(-1, -1, rows_per_query_head).reshape(num_kv_heads, -1)
