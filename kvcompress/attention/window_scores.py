"""Observation-window scores collected where attention already runs (pure torch).

On a request's last prefill chunk(s) the queries of its observation window (the last W
prompt positions) score every earlier prompt key: fp32 softmax probabilities, reduced
over the query heads of each KV head, summed over the window queries, added into the
request's ``[layers, kv_heads, width]`` accumulator, indexed by the key's physical slot in its
row. Only those W queries are scored, never the whole chunk. Rows may differ in length (a
request that adopted a cached context keeps each head's own share of it): each row's keys
are exactly its own, slots past its length get nothing. The probabilities are the model's own
(``kvcompress.kernels.logits.attention_probs``): soft-capped logits, and with attention
sinks the sink's share is missing, so a query's probabilities over real keys sum to < 1.
"""

from __future__ import annotations

import torch

from kvcompress.kernels.logits import attention_probs
from kvcompress.paging.page_format import PageFormat
from kvcompress.policies.scores import aggregate_window_probs
from kvcompress.step import StepBatch


def accumulate_window_scores(
    query: torch.Tensor,
    pool: torch.Tensor,
    page_format: PageFormat,
    step: StepBatch,
    layer: int,
    scale: float,
    key: torch.Tensor | None = None,
    *,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """``query [T, Hq, D]`` (and optionally ``key [T, H, D]``) are this step's, for
    ``layer``; given ``key``, a prompt entirely in this step is scored without reading
    the pool. ``soft_cap`` and ``sinks [Hq]``: the layer's softmax, as the model has it.
    Each window combines its query heads as it says (``group_reduce``)."""
    rows = step.layer_rows(layer)
    num_kv_heads = step.layout.num_kv_heads
    # [H, G, 1]: one sink per query head, against logits [H, G, w, S].
    sink_logits = None if sinks is None else sinks.view(num_kv_heads, -1, 1)
    for window in step.window_queries:
        index = window.batch_index
        start = step.query_start_loc[index]
        first = start + window.first_query
        queries = query[first : first + window.num_queries].float()  # [w, Hq, D]
        lengths_before = step.lengths_before[index, rows]
        # Host copies for the shapes: no device->host copy in a step. Up to the longest row
        # (capped by the accumulator: a resumed request's rows also hold generated tokens);
        # a shorter row's slots past its own keys are masked below like future keys.
        num_keys = min(window.scores.shape[-1], int(step.host_lengths_after[index, rows].max()))
        if key is not None and int(step.host_lengths_before[index, rows].max()) == 0:
            # The whole prompt is in this step (no earlier chunk): its keys are at hand.
            keys = key[start : start + num_keys].permute(1, 2, 0)  # [H, D, S]
        else:
            num_pages = -(-num_keys // pool.shape[2])
            tables = step.tables.gather([index], rows, num_pages)[0]
            keys = page_format.gather_keys(pool, tables, num_keys)
        group = queries.shape[1] // num_kv_heads
        grouped = queries.view(window.num_queries, num_kv_heads, group, -1).permute(1, 2, 0, 3)
        logits = torch.matmul(grouped, keys.float()[:, None]) * scale
        # [H, G, w, S]: query i of head h sees physical positions <= before[h] + offset + i,
        # always below the row's length: what a shorter row's gather read past it is masked.
        query_pos = lengths_before[:, None] + window.first_query
        query_pos = query_pos + torch.arange(window.num_queries, device=query_pos.device)
        key_pos = torch.arange(num_keys, device=query_pos.device)
        future = key_pos[None, None, :] > query_pos[:, :, None]  # [H, w, S]
        logits.masked_fill_(future[:, None], float("-inf"))
        probs = attention_probs(logits, soft_cap, sink_logits)
        window.scores[layer, :, :num_keys] += aggregate_window_probs(probs,
                                                                    window.group_reduce)
