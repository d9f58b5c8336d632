"""Random per-head paged KV layouts and a dense naive attention for the kernel tests."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

# Tolerances of a kernel vs the fp32-exact torch reference, by dtype.
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@dataclass
class PagedCase:
    query: torch.Tensor  # [T, H_q, D]
    pool: torch.Tensor  # [num_pages, 2, P, D]
    page_tables: torch.Tensor  # int32 [R, H_kv, max_pages]
    kv_lens: torch.Tensor  # int32 [R, H_kv]
    query_start_loc: torch.Tensor  # int32 [R + 1]
    scale: float

    def to(self, device: torch.device | str) -> PagedCase:
        return PagedCase(
            query=self.query.to(device),
            pool=self.pool.to(device),
            page_tables=self.page_tables.to(device),
            kv_lens=self.kv_lens.to(device),
            query_start_loc=self.query_start_loc.to(device),
            scale=self.scale,
        )

    @property
    def query_lens(self) -> list[int]:
        starts = self.query_start_loc.tolist()
        return [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]


def make_case(
    query_lens: list[int],
    context_lens: list[list[int]],
    *,
    group: int,
    head_size: int,
    page_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_pages: int = 3,
    poison: bool = True,
) -> PagedCase:
    """Build a random layout: context_lens[r][h] tokens already cached before the new ones.

    Pages of all (request, head) pairs are a random permutation of the pool; unused slots (free
    pages, tails of last pages) and the page-table padding are poisoned (NaN / -1), so a kernel
    that reads outside a head's length produces NaN or crashes instead of passing by luck.
    """
    generator = torch.Generator().manual_seed(seed)
    num_requests = len(query_lens)
    num_kv_heads = len(context_lens[0])
    pairs = zip(query_lens, context_lens, strict=True)
    kv_lens = torch.tensor([[c + q for c in ctx] for q, ctx in pairs], dtype=torch.int32)
    pages_needed = [[math.ceil(n / page_size) for n in row] for row in kv_lens.tolist()]
    total_pages = sum(map(sum, pages_needed)) + spare_pages
    max_pages = max(max(row) for row in pages_needed) + 1
    order = torch.randperm(total_pages, generator=generator).tolist()
    page_tables = torch.full((num_requests, num_kv_heads, max_pages), -1, dtype=torch.int32)
    cursor = 0
    for r in range(num_requests):
        for h in range(num_kv_heads):
            n = pages_needed[r][h]
            page_tables[r, h, :n] = torch.tensor(order[cursor : cursor + n], dtype=torch.int32)
            cursor += n

    pool = torch.randn(total_pages, 2, page_size, head_size, generator=generator).to(dtype)
    if poison:
        used = torch.zeros(total_pages, page_size, dtype=torch.bool)
        for r in range(num_requests):
            for h in range(num_kv_heads):
                for j in range(int(kv_lens[r, h])):
                    used[int(page_tables[r, h, j // page_size]), j % page_size] = True
        pool.masked_fill_(~used[:, None, :, None], float("nan"))

    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    query = torch.randn(starts[-1], num_kv_heads * group, head_size, generator=generator)
    return PagedCase(
        query=query.to(dtype),
        pool=pool,
        page_tables=page_tables,
        kv_lens=kv_lens,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        scale=1.0 / math.sqrt(head_size),
    )


def head_keys_values(case: PagedCase, r: int, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of head (r, h) in physical order, float64, read slot by slot."""
    pool = case.pool.cpu()
    page_size = pool.shape[2]
    n = int(case.kv_lens[r, h])
    pages = [int(case.page_tables[r, h, j // page_size]) for j in range(n)]
    kv = torch.stack([pool[p, :, j % page_size] for j, p in enumerate(pages)]).double()
    return kv[:, 0], kv[:, 1]


def model_logits(scores: torch.Tensor, hq: int, soft_cap: float | None,
                 sinks: torch.Tensor | None) -> torch.Tensor:
    """Scaled float64 scores of query head ``hq`` as the model softmaxes them: soft-capped, and
    the sink logit appended last (``-inf`` without sinks, so it weighs nothing)."""
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    sink = float("-inf") if sinks is None else float(sinks[hq])
    return torch.cat([scores, torch.tensor([sink], dtype=scores.dtype)])


def dense_attention(case: PagedCase, soft_cap: float | None = None,
                    sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive per-request, per-query-head attention in float64: (out [T, H_q, D], lse [T, H_q]).
    ``soft_cap`` / ``sinks [H_q]``: the model's softmax (the LSE includes the sink)."""
    num_tokens, num_query_heads, head_size = case.query.shape
    num_kv_heads = case.page_tables.shape[1]
    group = num_query_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_query_heads, head_size, dtype=torch.float64)
    lse = torch.zeros(num_tokens, num_query_heads, dtype=torch.float64)
    starts = case.query_start_loc.tolist()
    query = case.query.cpu()
    for r, query_len in enumerate(case.query_lens):
        for h in range(num_kv_heads):
            keys, values = head_keys_values(case, r, h)
            for hq, i in itertools.product(range(h * group, (h + 1) * group), range(query_len)):
                t = starts[r] + i
                limit = int(case.kv_lens[r, h]) - query_len + i
                q = query[t, hq].double()
                scores = (keys[: limit + 1] @ q) * case.scale
                with_sink = model_logits(scores, hq, soft_cap, sinks)
                probs = torch.softmax(with_sink, dim=0)[:-1]
                out[t, hq] = probs @ values[: limit + 1]
                lse[t, hq] = torch.logsumexp(with_sink, dim=0)
    return out, lse


def dense_window_scores(case: PagedCase, window_start: list[int], max_len: int,
                        soft_cap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Naive observation-window scores: float64 [R, H_kv, max_len], summed over rows and group,
    with the model's softmax (``soft_cap``, ``sinks [H_q]``)."""
    num_query_heads = case.query.shape[1]
    num_kv_heads = case.page_tables.shape[1]
    group = num_query_heads // num_kv_heads
    scores = torch.zeros(len(case.query_lens), num_kv_heads, max_len, dtype=torch.float64)
    starts = case.query_start_loc.tolist()
    query = case.query.cpu()
    for r, query_len in enumerate(case.query_lens):
        for h in range(num_kv_heads):
            keys, _ = head_keys_values(case, r, h)
            for hq, i in itertools.product(
                range(h * group, (h + 1) * group), range(window_start[r], query_len)
            ):
                limit = int(case.kv_lens[r, h]) - query_len + i
                q = query[starts[r] + i, hq].double()
                logits = (keys[: limit + 1] @ q) * case.scale
                with_sink = model_logits(logits, hq, soft_cap, sinks)
                scores[r, h, : limit + 1] += torch.softmax(with_sink, dim=0)[:-1]
    return scores


def model_softmax(kind: str, num_query_heads: int,
                  device: torch.device | str = "cpu") -> dict:
    """Kernel keywords for the model softmaxes under test: Gemma-2-style soft-capping, gpt-oss-
    style sinks, or both. A cap of 1 on scaled scores of spread ~1 and sinks of spread 2 change
    every row, so a kernel that ignores either fails its comparison. The sinks on ``device``,
    the case's (drawn on the CPU: the same values everywhere)."""
    sinks = 2 * torch.randn(num_query_heads, generator=torch.Generator().manual_seed(7))
    sinks = sinks.to(device)
    return {
        "soft_cap": dict(soft_cap=1.0),
        "sinks": dict(sinks=sinks),
        "both": dict(soft_cap=1.0, sinks=sinks),
    }[kind]


MODEL_SOFTMAXES = ["soft_cap", "sinks", "both"]


def run_attention(case: PagedCase, kernel, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernel`` (reference or Triton) over the case: (out, lse), both NaN where unwritten."""
    out = torch.full_like(case.query, float("nan"))
    lse = torch.full(case.query.shape[:2], float("nan"), device=case.query.device)
    kernel(
        case.query, case.pool, case.page_tables, case.kv_lens, case.query_start_loc, case.scale,
        out, lse_out=lse, **kwargs,
    )
    return out, lse


# fp8 pages under test: both formats, K and V at different scales that are not powers of two
# (a kernel that swaps or skips a scale is off by far more than the tolerances).
FP8_FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_SCALES = dict(k_scale=0.37, v_scale=1.9)


def fp8_case(case: PagedCase, kv_fp8: torch.dtype, k_scale: float, v_scale: float
             ) -> tuple[PagedCase, PagedCase]:
    """``case`` with fp8 pages: (the case over a uint8 pool of K / V codes at these scales,
    the same case over those codes decoded and scaled in fp32). NaN poison stays NaN."""
    from kvcompress.kernels.write_kv import fp8_codes

    pool = case.pool.cpu().float()
    codes = torch.stack([fp8_codes(pool[:, 0], kv_fp8, k_scale),
                         fp8_codes(pool[:, 1], kv_fp8, v_scale)], dim=1)
    decoded = codes.view(kv_fp8).float() * torch.tensor([k_scale, v_scale]).view(1, 2, 1, 1)
    device = case.query.device
    return (PagedCase(case.query, codes.to(device), case.page_tables, case.kv_lens,
                      case.query_start_loc, case.scale),
            PagedCase(case.query.float(), decoded.to(device), case.page_tables, case.kv_lens,
                      case.query_start_loc, case.scale))
