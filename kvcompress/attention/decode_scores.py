"""Decode-time scores for h2o / snapkv decode eviction, collected where attention runs
(pure torch: the CPU path, and the reference of the fused GPU path, where the Triton attention
writes them itself, ``kvcompress.kernels.decode_mass``).

For a request decoding one token, its query's fp32 softmax probabilities over every key of
each (layer, KV head) row (rows have their own lengths; the new token, already written, is at
``lengths_before[row]``), reduced over the query heads of each KV head as the window scores
are; the part over the generated positions ``[prompt_kept[row], length_after[row])`` is this
layer's share of the request's scores at generated offsets ``0 ..``. Exact: the same
probabilities the model's softmax gives (tests compare with a dense loop).

This is a second pass over the scored requests' keys (K only) per layer, on top of the
platform kernel's attention. It is ragged: each row's own pages, read from the step's page
tables (``kvcompress.step.DecodeScoring``, ``engine.worker.decode_plan``), are gathered flat, the
softmax of each row runs over its own pages (a segmented max and sum), and nothing is padded
to the longest row. What it costs per layer is a fixed handful of batched torch operations
per page-table class of the scored requests (chunked when their keys are many); the layer's
scores go into the step's ``mass`` buffer, added into the accumulators once per step
(``commit``).
"""

from __future__ import annotations

import numpy as np
import torch

from kvcompress.kernels.logits import soft_cap_logits
from kvcompress.paging.page_format import PageFormat
from kvcompress.step import GQA_REDUCE_CODES, DecodeClassGroup, DecodeScoring

# Keys gathered at once (pages x page_size x head_size elements); larger batches are scored in
# chunks of requests.
MAX_GATHERED_ELEMENTS = 1 << 24


def score_decode_layer(query: torch.Tensor, pool: torch.Tensor, page_format: PageFormat,
                       plan: DecodeScoring, layer: int, scale: float, *,
                       requests: slice = slice(None), soft_cap: float | None = None,
                       sinks: torch.Tensor | None = None) -> None:
    """Write ``layer``'s scores of the plan's ``requests`` into ``plan.mass[requests,
    layer]``: ``query [T, Hq, D]`` is the step's, the pool already holds this step's keys.
    ``soft_cap`` / ``sinks [Hq]``: the layer's softmax. Overwrites (never adds), so scoring a
    layer again after a failure is harmless."""
    first, stop, _ = requests.indices(plan.mass.shape[0])
    most_pages = max(1, MAX_GATHERED_ELEMENTS // (pool.shape[2] * query.shape[-1]))
    for group in plan.groups:
        picked = np.flatnonzero((group.host_numbers >= first) & (group.host_numbers < stop))
        if not len(picked):
            continue
        # numbers ascend within a group, so the picked members are consecutive
        for start, end in _chunks(group.host_pages[layer], int(picked[0]),
                                  int(picked[-1]) + 1, most_pages):
            _score_members(query, pool, page_format, plan, layer, scale, group,
                           slice(start, end), int(group.host_pages[layer, start:end].sum()),
                           soft_cap, sinks)


def _chunks(pages: np.ndarray, first: int, stop: int, most_pages: int) -> list[tuple[int, int]]:
    """Consecutive runs of members ``[first, stop)`` holding at most ``most_pages`` pages
    together (a member alone may hold more)."""
    chunks, start, held = [], first, 0
    for member in range(first, stop):
        if member > start and held + pages[member] > most_pages:
            chunks.append((start, member))
            start, held = member, 0
        held += int(pages[member])
    chunks.append((start, stop))
    return chunks


def _score_members(query: torch.Tensor, pool: torch.Tensor, page_format: PageFormat,
                   plan: DecodeScoring, layer: int, scale: float, group: DecodeClassGroup,
                   part: slice, total: int, soft_cap: float | None,
                   sinks: torch.Tensor | None) -> None:
    """The scores of ``group``'s members ``part``, holding ``total`` pages in ``layer``."""
    device = query.device
    numbers, positions = group.numbers[part], group.positions[part]
    count, num_heads, page_size = numbers.shape[0], plan.lengths.shape[2], pool.shape[2]
    rows = count * num_heads  # member-major, then head
    lengths = plan.lengths[layer].index_select(0, numbers).flatten().long()  # [rows]
    counts = (lengths + (page_size - 1)) // page_size
    row_of = torch.repeat_interleave(torch.arange(rows, device=device), counts,
                                     output_size=total)  # [total]: each page's row
    starts = counts.cumsum(0) - counts  # each row's first page among the total
    page_in_row = torch.arange(total, device=device) - starts[row_of]
    # the page ids from the class's table [layer rows, requests, width]
    table = plan.tables.classes[group.table].tables
    _, width_requests, width = table.shape
    flat = ((layer * num_heads + row_of % num_heads) * width_requests
            + positions[row_of // num_heads]) * width + page_in_row
    page_ids = table.reshape(-1).index_select(0, flat)
    keys = page_format.gather_key_pages(pool, page_ids).float()  # [total, D, page]
    grouped = query.index_select(0, plan.tokens.index_select(0, numbers)).float() * scale
    grouped = grouped.view(rows, -1, query.shape[-1])  # [rows, G, D]
    logits = soft_cap_logits(torch.bmm(grouped.index_select(0, row_of), keys), soft_cap)
    key_positions = page_in_row[:, None] * page_size + torch.arange(page_size, device=device)
    beyond = key_positions >= lengths.index_select(0, row_of)[:, None]  # [total, page]
    # an added bias, not masked_fill_: a broadcast mask there is ~10x slower on CPU
    logits += torch.where(beyond, float("-inf"), 0.0)[:, None, :]
    probs = _segment_softmax(logits, row_of, rows, num_heads, sinks)  # [total, G, page]
    per_key = _combine_query_heads(probs, plan, numbers.index_select(0, row_of // num_heads))
    # the generated keys [prompt_kept, length) at offsets 0 ..; zero past the row
    kept = plan.prompt_kept[layer].index_select(0, numbers).flatten().long()
    wanted = kept[:, None] + torch.arange(plan.mass.shape[-1], device=device)  # [rows, W]
    held = wanted < lengths[:, None]
    flat_keys = (starts[:, None] + wanted // page_size) * page_size + wanted % page_size
    mass = per_key.flatten()[flat_keys.clamp_(max=total * page_size - 1)]
    plan.mass.select(1, layer).index_copy_(
        0, numbers, torch.where(held, mass, 0.0).view(count, num_heads, -1))


def _segment_softmax(logits: torch.Tensor, row_of: torch.Tensor, rows: int, num_heads: int,
                     sinks: torch.Tensor | None) -> torch.Tensor:
    """``logits [pages, G, page]`` (capped, -inf past each row) -> each row's softmax over
    all of its pages (``row_of [pages]``), a sink per query head in the denominator, as
    ``kernels.logits.attention_probs`` over the row's keys alone. A row always holds a key
    (this step's), so every row's max is finite."""
    group = logits.shape[1]
    by_row = row_of[:, None].expand(-1, group)
    top = torch.full((rows, group), float("-inf"), device=logits.device)
    top.scatter_reduce_(0, by_row, logits.amax(dim=-1), "amax")
    sink = None
    if sinks is not None:
        sink = sinks.float().view(1, num_heads, group).expand(rows // num_heads, -1, -1)
        sink = sink.reshape(rows, group)
        top = torch.maximum(top, sink)
    weights = torch.exp(logits - top.index_select(0, row_of)[..., None])
    denominator = torch.zeros((rows, group), device=logits.device)
    denominator.index_add_(0, row_of, weights.sum(dim=-1))
    if sink is not None:
        denominator += torch.exp(sink - top)
    return weights.div_(denominator.index_select(0, row_of)[..., None])


def _combine_query_heads(probs: torch.Tensor, plan: DecodeScoring,
                         numbers: torch.Tensor) -> torch.Tensor:
    """``probs [pages, G, page]`` -> ``[pages, page]``, each request's query heads combined
    as its --kv-gqa-reduce says (``GQA_REDUCE_CODES``; picked by ``torch.where`` when they
    differ; ``numbers [pages]``: each page's request). Sums, not ``mean``: a reduction over
    the middle dimension is several times slower."""
    group = probs.shape[1]
    if plan.group_reduce == "max":
        return probs.amax(dim=1)
    summed = probs.sum(dim=1)
    if plan.group_reduce == "sum":
        return summed
    if plan.group_reduce == "mean":
        return summed.mul_(1.0 / group)
    codes = plan.reduce_codes.index_select(0, numbers)[:, None]
    chosen = torch.where(codes == GQA_REDUCE_CODES.index("mean"), summed * (1.0 / group),
                         summed)
    return torch.where(codes == GQA_REDUCE_CODES.index("max"), probs.amax(dim=1), chosen)
