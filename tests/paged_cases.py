"""Random per-head paged KV layouts with their dense K/V, for attention tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcompress.engine.worker.state import StepBatch, WorkerKVState
from kvcompress.paging import PageLayout, PageTableDelta
from kvcompress.paging.page_format import PageFormat
from kvcompress.step import UNSCALED, KVScales


@dataclass
class PagedCase:
    layout: PageLayout
    state: WorkerKVState
    pool: torch.Tensor
    step: StepBatch
    query: torch.Tensor  # [T, Hq, D]
    new_keys: torch.Tensor  # [T, rows, D]
    new_values: torch.Tensor
    # Dense history per (request, row) before this step: [len, D]
    old_keys: dict[tuple[int, int], torch.Tensor]
    old_values: dict[tuple[int, int], torch.Tensor]


def build_case(
    page_format: PageFormat,
    lengths_before: list[list[int]],  # [R][rows]
    num_new: list[int],
    num_layers: int,
    num_kv_heads: int,
    group: int,
    head_size: int,
    page_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    prompt_lens: list[int] | None = None,
    window: int = 4,
    wants_compression: list[bool] | None = None,
    kv_scales: KVScales = UNSCALED,
) -> PagedCase:
    """``page_format.fp8_dtype`` set: an fp8 pool (uint8, one byte per element) whose K/V,
    history and new tokens alike, are exactly representable as ``fp8 * kv_scales`` (so any
    rounding of a write stores them exactly, and the dense reference is exact); ``dtype`` is
    then the model's (queries', new tokens')."""
    generator = torch.Generator().manual_seed(seed)
    fp8 = page_format.fp8_dtype
    element_bytes = 1 if fp8 is not None else torch.empty((), dtype=dtype).element_size()
    rows = num_layers * num_kv_heads
    pages_needed = [
        [-(-(lengths_before[r][row] + num_new[r]) // page_size) for row in range(rows)]
        for r in range(len(num_new))
    ]
    total_pages = sum(map(sum, pages_needed)) + 7
    layout = PageLayout(num_layers, num_kv_heads, head_size, page_size, element_bytes,
                        total_pages)
    # Loud finite garbage in unused slots: a kernel reading past a head's length shows.
    pool = torch.full((total_pages, 2, page_size, head_size), 50.0,
                      dtype=dtype if fp8 is None else fp8)
    if fp8 is not None:
        pool = pool.view(torch.uint8)
    # Every power of two of widths its own class: the kernels see split batches.
    state = WorkerKVState(layout, torch.device("cpu"), min_class_pages=1, class_spread=1)
    permutation = torch.randperm(total_pages, generator=generator).numpy().astype(np.int32)
    used = 0
    old_keys, old_values = {}, {}
    for r, needed in enumerate(pages_needed):
        counts = np.array(needed, dtype=np.int32)
        page_ids = permutation[used : used + counts.sum()]
        used += counts.sum()
        request_id = f"req{r}"
        state.apply_deltas({request_id: PageTableDelta(fresh=True, appends=[(counts, page_ids)])})
        request = state.requests[request_id]
        request.lengths = np.array(lengths_before[r], dtype=np.int64)
        for row in range(rows):
            length = lengths_before[r][row]
            keys = torch.randn(length, head_size, generator=generator).to(dtype)
            values = torch.randn(length, head_size, generator=generator).to(dtype)
            positions = torch.arange(length)
            slots = (torch.as_tensor(request.table.pages[row])[positions // page_size].long()
                     * page_size + positions % page_size)
            if fp8 is None:
                page_format.write_tokens(pool, keys, values, slots)
            else:
                keys = fp8_representable(keys, fp8, kv_scales.key)
                values = fp8_representable(values, fp8, kv_scales.value)
                page_format.write_tokens(pool, fp8_bytes(keys, fp8, kv_scales.key),
                                         fp8_bytes(values, fp8, kv_scales.value), slots)
            old_keys[r, row], old_values[r, row] = keys, values
    num_reqs = len(num_new)
    prompt_lens = prompt_lens or [lengths_before[r][0] + num_new[r] for r in range(num_reqs)]
    step = state.prepare_step(
        [f"req{r}" for r in range(num_reqs)],
        np.array(num_new),
        np.array([lengths_before[r][0] for r in range(num_reqs)]),
        np.array(prompt_lens),
        observation_windows=[window] * num_reqs,
        wants_compression=wants_compression or [False] * num_reqs,
    )
    total = sum(num_new)
    query = torch.randn(total, num_kv_heads * group, head_size, generator=generator).to(dtype)
    new_keys = torch.randn(total, rows, head_size, generator=generator).to(dtype)
    new_values = torch.randn(total, rows, head_size, generator=generator).to(dtype)
    if fp8 is not None:
        new_keys = fp8_representable(new_keys, fp8, kv_scales.key)
        new_values = fp8_representable(new_values, fp8, kv_scales.value)
    return PagedCase(layout, state, pool, step, query, new_keys, new_values, old_keys,
                     old_values)


def fp8_representable(x: torch.Tensor, fp8: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` moved to the nearest ``fp8 value * scale`` (kept in x's dtype; exact there for the
    power-of-two scales the tests use)."""
    return ((x.float() / scale).to(fp8).float() * scale).to(x.dtype)


def fp8_bytes(x: torch.Tensor, fp8: torch.dtype, scale: float) -> torch.Tensor:
    """The page bytes of ``x`` (representable) at ``scale``."""
    return (x.float() / scale).to(fp8).view(torch.uint8)


def dense_attention(case: PagedCase, layer: int, scale: float, soft_cap: float | None = None,
                    sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Loop reference: each query head against its KV head's dense history + new tokens, with
    the model's softmax: logits soft-capped, a sink logit per query head in the denominator.
    ``window``: a query at row position q sees only ``max(0, q - W + 1) .. q``."""
    heads = case.layout.num_kv_heads
    group = case.query.shape[1] // heads
    out = torch.zeros(case.query.shape, dtype=torch.float64)
    starts = case.step.query_start_loc
    for r in range(case.step.num_reqs):
        first, last = starts[r], starts[r + 1]
        for head in range(heads):
            row = layer * heads + head
            keys = torch.cat([case.old_keys[r, row], case.new_keys[first:last, row]]).double()
            values = torch.cat([case.old_values[r, row],
                                case.new_values[first:last, row]]).double()
            before = case.old_keys[r, row].shape[0]
            for i in range(last - first):
                position = before + i
                lo = 0 if window is None else max(0, position - window + 1)
                for g in range(group):
                    q = case.query[first + i, head * group + g].double()
                    logits = keys[lo : position + 1] @ q * scale
                    if soft_cap:
                        logits = soft_cap * torch.tanh(logits / soft_cap)
                    sink = -torch.inf if sinks is None else float(sinks[head * group + g])
                    probs = torch.softmax(torch.cat([logits, logits.new_tensor([sink])]), 0)
                    out[first + i, head * group + g] = probs[:-1] @ values[lo : position + 1]
    return out


# The model softmaxes the attention tests run: Gemma-2-style soft-capping, gpt-oss-style sinks
# (one logit per query head), both. A cap of 1 and sinks of spread 2 change every row.
MODEL_SOFTMAXES = ["soft_cap", "sinks", "both"]


def model_softmax(kind: str, num_query_heads: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> dict:
    """Keywords for the kernels; sinks in the model's dtype, as vLLM hands the parameter, on
    ``device`` (the case's; drawn on the CPU, so the same values everywhere)."""
    sinks = 2 * torch.randn(num_query_heads, generator=torch.Generator().manual_seed(7))
    sinks = sinks.to(device)
    return {
        "soft_cap": dict(soft_cap=1.0),
        "sinks": dict(sinks=sinks.to(dtype)),
        "both": dict(soft_cap=1.0, sinks=sinks.to(dtype)),
    }[kind]


def dense_window_probs(case: PagedCase, layer: int, scale: float, soft_cap: float | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Probabilities ``[H, G, W, prompt]`` (float64) of the one request of ``case`` (its whole
    prompt in the step, no earlier chunk) for its observation-window queries, written out:
    soft-capped logits, masked future, the sink appended to the softmax and dropped after."""
    window = case.step.window_queries[0]
    heads = case.layout.num_kv_heads
    group = case.query.shape[1] // heads
    keys = case.new_keys[:, case.step.layer_rows(layer)].double()  # [S, H, D]
    prompt = keys.shape[0]
    queries = case.query[window.first_query : window.first_query + window.num_queries].double()
    grouped = queries.view(window.num_queries, heads, group, -1)
    logits = torch.einsum("whgd,shd->hgws", grouped, keys) * scale
    if soft_cap:
        logits = soft_cap * torch.tanh(logits / soft_cap)
    positions = window.first_query + torch.arange(window.num_queries)
    logits = logits.masked_fill(torch.arange(prompt)[None, :] > positions[:, None], -torch.inf)
    sink = torch.full((heads, group, window.num_queries, 1), -torch.inf, dtype=torch.float64)
    if sinks is not None:
        sink = sinks.double().view(heads, group, 1, 1).expand_as(sink)
    return torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]


def run_kernel(kernel, case: PagedCase, window: int | None, kv_scales: KVScales = UNSCALED,
               **softmax) -> list[torch.Tensor]:
    """Every layer's outputs (scale head_size ** -0.5), the new tokens written first (as the
    engine does); ``kv_scales``: fp8 pages' scales."""
    args = kernel.prepare(case.step)
    scale = case.layout.head_size**-0.5
    outputs = []
    for layer in range(case.layout.num_layers):
        rows = case.step.layer_rows(layer)
        kernel.write(case.pool, case.new_keys[:, rows], case.new_values[:, rows],
                     case.step.slot_mapping[:, rows], kv_scales=kv_scales)
        output = torch.full_like(case.query, float("nan"))
        kernel.attend(args, layer, case.query, case.pool, output, scale,
                      sliding_window=window, kv_scales=kv_scales, **softmax)
        outputs.append(output)
    return outputs
