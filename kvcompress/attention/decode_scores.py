"""Decode-time scores for h2o / snapkv decode eviction, collected where attention runs
(pure torch, on every platform: there is no Triton kernel for it yet).

For a request decoding one token, its query's fp32 softmax probabilities over every key of
each (layer, KV head) row (rows have their own lengths; the new token, already written, is at
``lengths_before[row]``), reduced over the query heads of each KV head as the window scores
are, and the part over the generated positions ``[prompt_kept[row], length_after[row])`` is
added into the request's accumulator at generated offsets ``0 ..``. The accumulator's width is
the decode budget plus interval, so its memory is bounded whatever the generation length.

This is a second pass over the scored requests' keys per layer (gathered from the pool), on
top of the platform kernel's attention: the price of not having a fused kernel. The engine
scores a layer's requests together (``accumulate_decode_scores_batch``, padded to the longest
row); ``accumulate_decode_scores`` scores one request, to isolate a failure.
"""

from __future__ import annotations

import torch

from kvcompress.kernels.logits import attention_probs
from kvcompress.paging.page_format import PageFormat
from kvcompress.policies.scores import aggregate_window_probs
from kvcompress.step import DecodeQueries, StepBatch


def accumulate_decode_scores(
    query: torch.Tensor,
    pool: torch.Tensor,
    page_format: PageFormat,
    step: StepBatch,
    decode: DecodeQueries,
    layer: int,
    scale: float,
    *,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Add ``layer``'s share for one decoding request: ``query [T, Hq, D]`` is the step's (the
    request's token at row ``query_start_loc[batch_index]``); the pool already holds this
    step's keys. ``soft_cap`` / ``sinks [Hq]``: the layer's softmax. The accumulator is
    written once, at the end, so a failure leaves it as it was."""
    accumulate_decode_scores_batch(query, pool, page_format, step, [decode], layer, scale,
                                   soft_cap=soft_cap, sinks=sinks)


# Keys gathered at once by the batched path ([requests, kv_heads, keys, head_size] elements);
# larger batches are scored in chunks of requests.
MAX_GATHERED_ELEMENTS = 1 << 24


def accumulate_decode_scores_batch(
    query: torch.Tensor,
    pool: torch.Tensor,
    page_format: PageFormat,
    step: StepBatch,
    decodes: list[DecodeQueries],
    layer: int,
    scale: float,
    *,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """``accumulate_decode_scores`` for every request of ``decodes`` together: one gather,
    one matmul and one softmax per chunk of requests (padded to the longest row), instead of
    a Python loop of small operations per request and layer. Writes the accumulators only
    after every chunk is computed, so a failure leaves them all as they were."""
    rows = step.layer_rows(layer)
    num_kv_heads = step.layout.num_kv_heads
    head_size = query.shape[-1]
    sink_logits = None if sinks is None else sinks.view(num_kv_heads, -1)
    lengths_after = step.host_lengths_after[[decode.batch_index for decode in decodes]][:, rows]
    chunk = max(1, MAX_GATHERED_ELEMENTS // max(1, num_kv_heads * head_size
                                               * int(lengths_after.max())))
    updates = []
    for first in range(0, len(decodes), chunk):
        part = decodes[first : first + chunk]
        num_keys = int(lengths_after[first : first + chunk].max())
        batch_indices = [decode.batch_index for decode in part]
        index = torch.tensor(batch_indices, device=step.lengths_before.device)
        num_pages = -(-num_keys // pool.shape[2])
        tables = step.tables.gather(batch_indices, rows, num_pages)  # [n, H, P]
        keys = page_format.gather_key_pages(pool, tables).float()  # [n, H, P, D, page]
        tokens = torch.tensor([step.query_start_loc[decode.batch_index] for decode in part],
                              device=query.device)
        grouped = query[tokens].float().view(len(part), num_kv_heads, 1, -1, head_size)
        # page by page, so keys are never transposed: [n, H, P, G, page] -> [n, H, G, S]
        logits = torch.matmul(grouped, keys).transpose(2, 3).flatten(3)[..., :num_keys]
        logits = logits * scale
        row_lengths = step.lengths_before[index][:, rows] + 1  # [n, H]
        key_pos = torch.arange(num_keys, device=logits.device)
        beyond = key_pos >= row_lengths[..., None]  # [n, H, S]
        logits.masked_fill_(beyond[:, :, None, :], float("-inf"))
        probs = attention_probs(logits, soft_cap, sink_logits)
        per_key = _combine_query_heads(probs, [decode.group_reduce for decode in part])
        width = max(decode.num_generated for decode in part)
        prompt_kept = torch.stack([decode.prompt_kept[rows] for decode in part])  # [n, H]
        positions = prompt_kept[..., None] + torch.arange(width, device=logits.device)
        generated = positions < row_lengths[..., None]
        mass = torch.where(generated, per_key.gather(-1, positions.clamp(max=num_keys - 1)),
                           0.0)
        updates += [(decode, mass[number, :, : decode.num_generated])
                    for number, decode in enumerate(part)]
    for decode, mass in updates:
        decode.scores[layer, :, : decode.num_generated] += mass
        if decode.anchor_scores is not None:
            # Only the newest offsets: evictions keep order, so they are the youngest tokens.
            young = max(0, decode.num_generated - decode.anchor_steps)
            decode.anchor_scores[layer, :, young : decode.num_generated] += mass[:, young:]


def _combine_query_heads(probs: torch.Tensor, group_reduces: list[str]) -> torch.Tensor:
    """``probs [n, H, G, S]`` -> ``[n, H, S]``, request i's query heads combined as
    ``group_reduces[i]`` says (one reduction per distinct choice, usually one)."""
    choices = sorted(set(group_reduces))
    if len(choices) == 1:
        return aggregate_window_probs(probs[:, :, :, None, :], choices[0])
    combined = torch.empty_like(probs[:, :, 0])
    for choice in choices:
        picked = torch.tensor([reduce == choice for reduce in group_reduces],
                              device=probs.device)
        combined[picked] = aggregate_window_probs(probs[picked][:, :, :, None, :], choice)
    return combined
