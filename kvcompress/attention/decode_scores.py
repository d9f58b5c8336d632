"""Decode-time scores for h2o / snapkv decode eviction, collected where attention runs
(pure torch, on every platform: there is no Triton kernel for it yet).

For a request decoding one token, its query's fp32 softmax probabilities over every key of
each (layer, KV head) row (rows have their own lengths; the new token, already written, is at
``lengths_before[row]``), reduced over the query heads of each KV head as the window scores
are, and the part over the generated positions ``[prompt_kept[row], length_after[row])`` is
added into the request's accumulator at generated offsets ``0 ..``. The accumulator's width is
the decode budget plus interval, so its memory is bounded whatever the generation length.

This is a second pass over each scored request's keys per layer (gathered from the pool), on
top of the platform kernel's attention: the price of not having a fused kernel.
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
    group_reduce: str = "mean",
    *,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Add ``layer``'s share for one decoding request: ``query [T, Hq, D]`` is the step's (the
    request's token at row ``query_start_loc[batch_index]``); the pool already holds this
    step's keys. ``soft_cap`` / ``sinks [Hq]``: the layer's softmax. The accumulator is
    written once, at the end, so a failure leaves it as it was."""
    index = decode.batch_index
    rows = step.layer_rows(layer)
    num_kv_heads = step.layout.num_kv_heads
    token = step.query_start_loc[index]
    # Host copy for the shape: no device->host copy in a step.
    num_keys = int(step.host_lengths_after[index, rows].max())
    keys, _ = page_format.gather_rows(pool, step.page_tables[index, rows], num_keys)  # [H, S, D]
    grouped = query[token].float().view(num_kv_heads, -1, query.shape[-1])  # [H, G, D]
    logits = torch.matmul(grouped, keys.float().transpose(-1, -2)) * scale  # [H, G, S]
    lengths_after = step.lengths_before[index, rows] + 1  # [H]
    key_pos = torch.arange(num_keys, device=logits.device)
    beyond = key_pos[None, :] >= lengths_after[:, None]  # [H, S]: past the row's own length
    logits.masked_fill_(beyond[:, None, :], float("-inf"))
    # The model's softmax: soft-capped logits, sink logits [Hq] -> [H, G] in the denominator.
    probs = attention_probs(logits, soft_cap,
                            None if sinks is None else sinks.view(num_kv_heads, -1))
    per_key = aggregate_window_probs(probs[:, :, None, :], group_reduce)  # [H, S]
    width = decode.num_generated
    positions = decode.prompt_kept[rows, None] + torch.arange(width, device=logits.device)
    generated = positions < lengths_after[:, None]  # [H, width]
    mass = per_key.gather(-1, positions.clamp(max=num_keys - 1))
    decode.scores[layer, :, :width] += torch.where(generated, mass, 0.0)
