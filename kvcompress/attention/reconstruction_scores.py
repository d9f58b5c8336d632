"""Reconstruction scores (KVzip-style), collected where a reconstruction pass attends.

A reconstruction pass feeds the model "repeat the previous context" plus a chunk of the
context itself, after the request's prompt, and its K/V goes to scratch slots past each
row's prompt. Every query of that pass attends to the prompt and to the pass's own earlier
tokens; the probability it pays a prompt key is that key's evidence of being needed to
reproduce the context. A key's score is the largest such probability over the pass's
queries and the query heads of its KV head, combined by max into the request's
``[layers, kv_heads, width]`` accumulator (chunks and passes commute). The softmax runs over
every key the query sees, the pass's own included (a head that copies locally spends its
attention there and scores the prompt low), but only prompt slots are stored.

Every prompt key precedes every query of the pass, so the prompt's logits need no causal
mask; the largest probability of a key is ``exp(max over queries of (logit - lse))``, with
``lse`` each query's log-normalizer over all it sees (sink included): past the normalizer,
the big ``[heads, group, queries, prompt]`` block is only shifted and max-reduced.
"""

from __future__ import annotations

import torch

from kvcompress.kernels.logits import NEG_INF, soft_cap_logits
from kvcompress.paging.page_format import PageFormat
from kvcompress.step import StepBatch, WindowQueries

# Largest [kv_heads, group, queries, keys] logits block scored at once (fp32): bounds the
# temporary memory of one layer's scoring whatever the chunk and prompt lengths.
MAX_LOGITS_ELEMENTS = 1 << 24


def accumulate_reconstruction_scores(
    query: torch.Tensor,
    pool: torch.Tensor,
    page_format: PageFormat,
    step: StepBatch,
    window: WindowQueries,
    layer: int,
    scale: float,
    *,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """``query [T, Hq, D]``: a pass's queries of ``layer``; ``step`` is the pass's batch
    (``StepBatch.reconstruction``), ``window`` one of its requests: its entry covers all the
    request's queries and holds its accumulator; its rows held ``host_lengths_before`` prompt
    slots before the pass. The pass's K/V are already written (attention ran first)."""
    start = step.query_start_loc[window.batch_index]
    queries = query[start : start + window.num_queries]
    index = window.batch_index
    rows = step.layer_rows(layer)
    num_kv_heads = step.layout.num_kv_heads
    # Every slot the rows held before the pass is a key of the softmax; the accumulator
    # stores the first ``stored`` (a resumed request's rows also hold generated tokens).
    host_context = step.host_lengths_before[index, rows]
    width = int(host_context.max())
    stored = min(window.scores.shape[-1], width)
    num_keys = int(step.host_lengths_after[index, rows].max())
    num_pages = -(-num_keys // pool.shape[2])
    tables = step.tables.gather([index], rows, num_pages)[0]
    keys = page_format.gather_keys(pool, tables, num_keys).float()  # [H, D, S]
    context = step.lengths_before[index, rows]  # [H] on the device
    num_queries = queries.shape[0]
    group = queries.shape[1] // num_kv_heads
    grouped = queries.float().view(num_queries, num_kv_heads, group, -1).permute(1, 2, 0, 3)
    # Keys in one block: the prompt's slots, then the pass's own (gathered from right after
    # each row's prompt), so one product and one log-normalizer cover both.
    offsets = torch.arange(num_queries, device=keys.device)
    own_slots = (context[:, None] + offsets).clamp(max=num_keys - 1)
    own_keys = keys.gather(2, own_slots[:, None, :].expand(-1, keys.shape[1], -1))
    block_keys = torch.cat([keys[:, :, :width], own_keys], dim=-1)[:, None]  # [H, 1, D, W+T]
    # The pass is causal among itself; a shorter row's slots past its prompt hold its own
    # pass's keys, already in the own part, so they are not prompt keys.
    own_mask = torch.zeros(num_queries, num_queries, device=keys.device).masked_fill_(
        offsets[None, :] > offsets[:, None], NEG_INF)
    past_prompt = None
    if (host_context < width).any():
        past_prompt = (torch.arange(width, device=keys.device)[None, :]
                       >= context[:, None])[:, None, None, :]  # [H, 1, 1, W]
    sink_logits = None if sinks is None else sinks.float().view(num_kv_heads, group, 1)
    best = torch.full((num_kv_heads, width), NEG_INF, device=keys.device)
    block = max(1, MAX_LOGITS_ELEMENTS // (num_kv_heads * group * (width + num_queries)))
    for first in range(0, num_queries, block):
        part = grouped[:, :, first : first + block]  # [H, G, b, D]
        logits = soft_cap_logits(torch.matmul(part, block_keys) * scale, soft_cap)
        logits[..., width:] += own_mask[first : first + part.shape[2]]
        if past_prompt is not None:
            logits[..., :width].masked_fill_(past_prompt, NEG_INF)
        lse = torch.logsumexp(logits, dim=-1)  # [H, G, b]
        if sink_logits is not None:
            lse = torch.logaddexp(lse, sink_logits)
        shifted = logits[..., :width].sub_(lse[..., None])
        best = torch.maximum(best, shifted.amax(dim=(1, 2)))
    scores = window.scores[layer, :, :stored]
    torch.maximum(scores, best[:, :stored].exp(), out=scores)
