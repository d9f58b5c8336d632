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
``lse`` each query's log-normalizer over all it sees (sink included). The prompt's keys are
read in page-aligned chunks, twice: a first walk builds every query's ``lse`` (the pass's own
keys, then each chunk's log-sum-exp added in), a second shifts each chunk's logits by it and
max-reduces them. A 128k-token prompt never has its keys gathered whole nor its logit matrix
built: a layer's workspace is at most ``SCORING_WORKSPACE_BYTES`` whatever the prompt and
pass lengths, and the engine reserves it (``engine.scoring_memory``).
"""

from __future__ import annotations

import torch

from kvcompress.kernels.logits import NEG_INF, soft_cap_logits_
from kvcompress.paging.page_format import PageFormat
from kvcompress.step import StepBatch, WindowQueries

# Largest fp32 logits block [kv_heads, group, queries, keys] scored at once, in elements
# (16 MB); a chunk of keys [kv_heads, head_dim, keys] holds at most half as many. Large
# enough for a pass's products to run at speed.
MAX_LOGITS_ELEMENTS = 1 << 22
# Peak temporary bytes of one layer's scoring, per logits element: the block, its mask and
# log-sum-exp temporaries; two key chunks (the next is read while the last is let go), each
# gathered, reordered and widened to fp32. 13.5 measured (tests/engine/test_workspace_bounds.py).
WORKSPACE_BYTES_PER_ELEMENT = 16
SCORING_WORKSPACE_BYTES = WORKSPACE_BYTES_PER_ELEMENT * MAX_LOGITS_ELEMENTS
# A small pool's smallest blocks (slower scoring, 1 MiB of workspace).
MIN_LOGITS_ELEMENTS = 1 << 16
MIN_SCORING_WORKSPACE_BYTES = WORKSPACE_BYTES_PER_ELEMENT * MIN_LOGITS_ELEMENTS


def scoring_elements(workspace_bytes: int) -> int:
    """The largest logits block that scoring within ``workspace_bytes`` builds (at least
    MIN_LOGITS_ELEMENTS: reserve ``MIN_SCORING_WORKSPACE_BYTES`` at least)."""
    return max(MIN_LOGITS_ELEMENTS,
               min(MAX_LOGITS_ELEMENTS, workspace_bytes // WORKSPACE_BYTES_PER_ELEMENT))


def scoring_workspace_bytes(query_heads: int, kv_heads: int, head_dim: int,
                            pass_tokens: int, longest_prompt: int, page_size: int = 64) -> int:
    """``SCORING_WORKSPACE_BYTES``, or less where a pass's whole logits and keys are smaller
    than one block: a small model's passes never build a full one."""
    keys = longest_prompt + pass_tokens + page_size  # page-aligned chunks round up
    extent = max(query_heads * pass_tokens, kv_heads * head_dim) * keys
    return SCORING_WORKSPACE_BYTES * min(MAX_LOGITS_ELEMENTS, extent) // MAX_LOGITS_ELEMENTS


def key_chunk(num_kv_heads: int, head_dim: int, page_size: int,
              max_elements: int = MAX_LOGITS_ELEMENTS) -> int:
    """Prompt keys read at once: whole pages, at most ``max_elements / 2`` fp32 key elements
    (one page at least)."""
    return max(1, max_elements // (2 * num_kv_heads * head_dim * page_size)) * page_size


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
    max_elements: int = MAX_LOGITS_ELEMENTS,
) -> None:
    """``query [T, Hq, D]``: a pass's queries of ``layer``; ``step`` is the pass's batch
    (``StepBatch.reconstruction``), ``window`` one of its requests: its entry covers all the
    request's queries and holds its accumulator; its rows held ``host_lengths_before`` prompt
    slots before the pass. The pass's K/V are already written (attention ran first).
    ``max_elements``: the block size (tests shrink it to walk many chunks)."""
    start = step.query_start_loc[window.batch_index]
    queries = query[start : start + window.num_queries]
    index = window.batch_index
    rows = step.layer_rows(layer)
    num_kv_heads = step.layout.num_kv_heads
    page_size = pool.shape[2]
    # Every slot the rows held before the pass is a key of the softmax; the accumulator
    # stores the first ``stored`` (a resumed request's rows also hold generated tokens).
    host_context = step.host_lengths_before[index, rows]
    width = int(host_context.max())
    stored = min(window.scores.shape[-1], width)
    num_keys = int(step.host_lengths_after[index, rows].max())
    num_pages = -(-num_keys // page_size)
    tables = step.tables.gather([index], rows, num_pages)[0]  # [H, P]
    context = step.lengths_before[index, rows]  # [H] on the device
    num_queries = queries.shape[0]
    group = queries.shape[1] // num_kv_heads
    grouped = queries.float().view(num_queries, num_kv_heads, group, -1).permute(1, 2, 0, 3)
    offsets = torch.arange(num_queries, device=queries.device)
    own_keys = _own_keys(pool, page_format, tables, context, offsets, num_keys)  # [H, D, T]
    # The pass is causal among itself; a shorter row's slots past its prompt hold its own
    # pass's keys, already in the own part, so they are not prompt keys.
    own_mask = torch.zeros(num_queries, num_queries, device=queries.device).masked_fill_(
        offsets[None, :] > offsets[:, None], NEG_INF)
    ragged = bool((host_context < width).any())
    chunk = key_chunk(num_kv_heads, grouped.shape[-1], page_size, max_elements)
    block = max(1, max_elements // (num_kv_heads * group * max(chunk, num_queries)))

    def chunk_logits(part: torch.Tensor, keys: torch.Tensor, first: int) -> torch.Tensor:
        """Scaled, capped logits of queries ``part`` for prompt keys ``[first, first + n)``,
        -inf past each row's prompt."""
        logits = soft_cap_logits_(_products(part, keys).mul_(scale), soft_cap)
        if ragged:
            positions = torch.arange(first, first + keys.shape[-1], device=keys.device)
            past = (positions[None, :] >= context[:, None])[:, None, None, :]
            logits.masked_fill_(past, NEG_INF)
        return logits

    # Walk 1: each query's log-normalizer over its own pass's keys, the prompt's, the sink.
    lse = torch.empty(num_kv_heads, group, num_queries, device=queries.device)
    for first in range(0, num_queries, block):
        part = grouped[:, :, first : first + block]  # [H, G, b, D]
        own = soft_cap_logits_(_products(part, own_keys).mul_(scale), soft_cap)
        own += own_mask[first : first + part.shape[2]]
        lse[:, :, first : first + part.shape[2]] = torch.logsumexp(own, dim=-1)
    for first, keys in _key_chunks(pool, page_format, tables, width, chunk):
        for q in range(0, num_queries, block):
            part = grouped[:, :, q : q + block]
            seen = lse[:, :, q : q + part.shape[2]]
            torch.logaddexp(seen, torch.logsumexp(chunk_logits(part, keys, first), dim=-1),
                            out=seen)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.float().view(num_kv_heads, group, 1))
    # Walk 2: each prompt key's largest log-probability over the queries and the group.
    scores = window.scores[layer, :, :stored]
    for first, keys in _key_chunks(pool, page_format, tables, stored, chunk):
        best = torch.full((num_kv_heads, keys.shape[-1]), NEG_INF, device=keys.device)
        for q in range(0, num_queries, block):
            part = grouped[:, :, q : q + block]
            shifted = chunk_logits(part, keys, first).sub_(lse[:, :, q : q + part.shape[2],
                                                               None])
            torch.maximum(best, shifted.amax(dim=(1, 2)), out=best)
        target = scores[:, first : first + keys.shape[-1]]
        torch.maximum(target, best.exp_(), out=target)


def _products(part: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``part [H, G, b, D] @ keys [H, D, n]`` -> ``[H, G, b, n]``, as one batched product
    per KV head (broadcasting the keys over the group would copy them ``G`` times)."""
    heads, group, queries, dim = part.shape
    return torch.bmm(part.reshape(heads, group * queries, dim), keys).view(
        heads, group, queries, -1)


def _key_chunks(pool: torch.Tensor, page_format: PageFormat, tables: torch.Tensor,
                num_keys: int, chunk: int):
    """``(first, keys [H, D, n])`` fp32 for the first ``num_keys`` slots of every row, in
    chunks of ``chunk`` (a multiple of the page size)."""
    page_size = pool.shape[2]
    for first in range(0, num_keys, chunk):
        count = min(chunk, num_keys - first)
        pages = tables[:, first // page_size : -(-(first + count) // page_size)]
        yield first, page_format.gather_keys(pool, pages, count).float()


def _own_keys(pool: torch.Tensor, page_format: PageFormat, tables: torch.Tensor,
              context: torch.Tensor, offsets: torch.Tensor, num_keys: int) -> torch.Tensor:
    """fp32 ``[H, D, T]``: the pass's own keys, right after each row's prompt (slot
    ``context[h] + i``; a shorter row's are clamped into what the longest row wrote)."""
    page_size = pool.shape[2]
    positions = (context[:, None] + offsets).clamp(max=num_keys - 1)  # [H, T]
    pages = tables.long().gather(1, positions // page_size)
    keys, _values = page_format.read_tokens(pool, (pages * page_size
                                                   + positions % page_size).reshape(-1))
    keys = page_format.decode(keys).float()
    return keys.view(*positions.shape, -1).transpose(1, 2)
