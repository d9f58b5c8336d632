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
platform kernel's attention. What it costs per layer is a fixed handful of batched torch
operations over all scored requests at once, padded to the longest row: every index it reads
(query tokens, page ids, masks, generated positions) was built once for the step
(``kvcompress.step.DecodeScoring``, ``engine.decode_plan``), and the layer's scores go into
the step's ``mass`` buffer, added into the accumulators once per step (``commit``).
"""

from __future__ import annotations

import torch

from kvcompress.kernels.logits import attention_probs
from kvcompress.paging.page_format import PageFormat
from kvcompress.step import GQA_REDUCE_CODES, DecodeScoring

# Keys gathered at once ([requests, kv_heads, keys, head_size] elements); larger batches are
# scored in chunks of requests.
MAX_GATHERED_ELEMENTS = 1 << 24


def score_decode_layer(query: torch.Tensor, pool: torch.Tensor, page_format: PageFormat,
                       plan: DecodeScoring, layer: int, scale: float, *,
                       requests: slice = slice(None), soft_cap: float | None = None,
                       sinks: torch.Tensor | None = None) -> None:
    """Write ``layer``'s scores of the plan's ``requests`` into ``plan.mass[requests,
    layer]``: ``query [T, Hq, D]`` is the step's, the pool already holds this step's keys.
    ``soft_cap`` / ``sinks [Hq]``: the layer's softmax. Overwrites (never adds), so scoring a
    layer again after a failure is harmless."""
    _, count, num_heads, num_pages = plan.page_ids.shape
    first, stop, _ = requests.indices(count)
    keys_per_request = num_heads * num_pages * pool.shape[2] * query.shape[-1]
    chunk = max(1, MAX_GATHERED_ELEMENTS // keys_per_request)
    for start in range(first, stop, chunk):
        part = slice(start, min(stop, start + chunk))
        plan.mass[part, layer] = _layer_mass(query, pool, page_format, plan, layer, part,
                                             scale, soft_cap, sinks)


def _layer_mass(query: torch.Tensor, pool: torch.Tensor, page_format: PageFormat,
                plan: DecodeScoring, layer: int, part: slice, scale: float,
                soft_cap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """``[n, H, W]`` scores of requests ``part`` in ``layer``."""
    pages = plan.page_ids[layer, part]  # [n, H, P], contiguous
    count, num_heads, _ = pages.shape
    head_size = query.shape[-1]
    keys = page_format.gather_key_pages(pool, pages).float()  # [n, H, P, D, page]
    grouped = query.index_select(0, plan.tokens[part]).float() * scale
    grouped = grouped.view(count, num_heads, 1, -1, head_size)  # [n, H, 1, G, D]
    # page by page, so keys are never transposed: [n, H, P, G, page] -> [n, H, G, S]
    logits = torch.matmul(grouped, keys).transpose(2, 3).flatten(3)
    beyond = plan.key_positions >= plan.lengths[layer, part, :, None, None]  # [n, H, 1, S]
    # an added bias, not masked_fill_: a broadcast mask there is ~10x slower on CPU
    logits += torch.where(beyond, float("-inf"), 0.0)
    sink_logits = None if sinks is None else sinks.view(num_heads, -1)
    probs = attention_probs(logits, soft_cap, sink_logits)  # [n, H, G, S]
    per_key = _combine_query_heads(probs, plan, part)  # [n, H, S]
    # the generated keys [prompt_kept, length) at offsets 0 ..; zero past the row
    positions = plan.prompt_kept[layer, part, :, None] + plan.offsets  # [n, H, W]
    held = positions < plan.lengths[layer, part, :, None]
    mass = per_key.gather(-1, positions.clamp_(max=per_key.shape[-1] - 1))
    return torch.where(held, mass, 0.0)


def _combine_query_heads(probs: torch.Tensor, plan: DecodeScoring, part: slice) -> torch.Tensor:
    """``probs [n, H, G, S]`` -> ``[n, H, S]``, each request's query heads combined as its
    --kv-gqa-reduce says (``GQA_REDUCE_CODES``; picked by ``torch.where`` when they differ).
    Sums, not ``mean``: a reduction over the middle dimension is several times slower."""
    group = probs.shape[2]
    if plan.group_reduce == "max":
        return probs.amax(dim=2)
    summed = probs.sum(dim=2)
    if plan.group_reduce == "sum":
        return summed
    if plan.group_reduce == "mean":
        return summed.mul_(1.0 / group)
    codes = plan.reduce_codes[part, None, None]
    chosen = torch.where(codes == GQA_REDUCE_CODES.index("mean"), summed * (1.0 / group),
                         summed)
    return torch.where(codes == GQA_REDUCE_CODES.index("max"), probs.amax(dim=2), chosen)
