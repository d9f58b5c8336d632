"""One attention layer of one step over the page pool: what the vLLM backend runs for every
layer, kept free of vLLM so the worker pipeline runs (and is tested) with torch + Triton alone.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from kvcompress.attention.decode_scores import score_decode_layer
from kvcompress.attention.reconstruction_scores import accumulate_reconstruction_scores
from kvcompress.attention.surrogate_scores import accumulate_surrogate_scores
from kvcompress.attention.window_scores import accumulate_window_scores
from kvcompress.device_faults import raise_if_fatal
from kvcompress.faults import InjectedFault, maybe_fail
from kvcompress.log import get_logger
from kvcompress.step import UNSCALED, KVScales, PagedAttentionMetadata

logger = get_logger(__name__)


def _scoring_blocks(elements: int) -> dict[str, int]:
    """A small pool's smaller scoring blocks (``PageLayout.scoring_elements``; 0: default)."""
    return {"max_elements": elements} if elements else {}


def attend_layer(metadata: PagedAttentionMetadata, layer_index: int, query: torch.Tensor,
                 key: torch.Tensor, value: torch.Tensor, pool: torch.Tensor,
                 output: torch.Tensor, scale: float, *, soft_cap: float | None = None,
                 sinks: torch.Tensor | None = None,
                 sliding_window: int | None = None,
                 kv_scales: KVScales = UNSCALED) -> torch.Tensor:
    """Stages 3-4 of a step (``kvcompress.step``) for one layer: write the step's K/V
    ``[T, H, D]`` into every head's row, attend (``query [T, Hq, D]`` into ``output``), add
    the observation-window probabilities of requests finishing their prompt and the decode
    scores of decoding requests whose decode policy scores this step (if that fails, those
    requests are marked failed and the layer goes on). Where the kernel fuses decode scores
    (``fuses_decode_scores``: Triton) attention writes them itself, with no second pass.
    Tensors may be padded beyond ``metadata.num_actual_tokens``; returns ``output``.
    ``soft_cap`` / ``sinks [Hq]``: the layer's softmax, used by attention and every score
    alike. ``sliding_window``: the layer's window W (None: full attention); such a layer is
    never compressed by a policy, so it is not scored. ``kv_scales``: the layer's fp8
    scales. On fp8 pages every score reads the stored keys (what attention sees), decoded
    unscaled, with the K scale folded into the logit scale once."""
    step, kernel = metadata.step, metadata.kernel
    num_tokens = metadata.num_actual_tokens
    query, output = query[:num_tokens], output[:num_tokens]
    key, value = key[:num_tokens], value[:num_tokens]
    kernel.write(pool, key, value, step.slot_mapping[:, step.layer_rows(layer_index)],
                 kv_scales=kv_scales)
    softmax = {"soft_cap": soft_cap, "sinks": sinks}
    fused = _fuses_decode_scores(metadata, sliding_window)
    kernel.attend(metadata.kernel_args, layer_index, query, pool, output, scale,
                  sliding_window=sliding_window, kv_scales=kv_scales,
                  decode_scoring=step.decode_scoring if fused else None, **softmax)
    if sliding_window:
        return output
    if step.surrogate_plan is not None:
        _score_surrogate(metadata, layer_index, key, value)
    if kernel.page_format.fp8_dtype is not None:
        scale, key = scale * kv_scales.key, None
    if step.reconstruction:
        _score_reconstruction(metadata, layer_index, query, pool, scale, softmax)
        return output
    if step.window_queries:
        with step.score_timer.measure():
            try:
                maybe_fail("score", [window.prompt_len for window in step.window_queries])
                kernel.accumulate_window_scores(metadata.kernel_args, layer_index, query, key,
                                                pool, step, scale, **softmax)
            except Exception as error:
                raise_if_fatal(error, pool.device, "scoring the observation windows")
                logger.exception("kvcompress: scoring the observation windows failed; "
                                 "scoring them one by one")
                _score_one_by_one(metadata, layer_index, query, key, pool, scale, softmax)
    if step.decode_scoring is not None and not fused:
        with step.score_timer.measure():
            _score_decode_queries(metadata, layer_index, query, pool, scale, softmax)
    return output


def _score_surrogate(metadata: PagedAttentionMetadata, layer_index: int, key: torch.Tensor,
                     value: torch.Tensor) -> None:
    """The surrogate's scores of the step's prompt tokens (unquantized K/V: what the layer
    computed). A failure fails the requests scored, not the forward, and the later layers
    of the step skip them."""
    step = metadata.step
    with step.score_timer.measure():
        try:
            maybe_fail("score", [entry.prompt_len for entry in step.surrogate_plan.entries])
            accumulate_surrogate_scores(key, value, step, layer_index)
        except Exception as error:
            raise_if_fatal(error, key.device, "surrogate scoring")
            logger.exception("kvcompress: surrogate scoring failed")
            step.fail([step.req_ids[entry.batch_index] for entry in step.surrogate_plan.entries],
                      f"surrogate scoring failed: {error!r}")
            step.surrogate_plan = None


def _fuses_decode_scores(metadata: PagedAttentionMetadata, sliding_window: int | None) -> bool:
    """Whether this layer's attention also writes its decode scores (the Triton kernel does,
    from its own softmax). Sliding-window layers are never scored, and a reconstruction pass
    scores no decodes. An injected scoring fault takes the torch pass, whose fallback fails
    only the requests it names."""
    step = metadata.step
    plan = step.decode_scoring
    if plan is None or sliding_window or step.reconstruction:
        return False
    if not metadata.kernel.fuses_decode_scores(metadata.kernel_args, plan):
        return False
    try:
        maybe_fail("score", [decode.prompt_len for decode in step.decode_queries])
    except InjectedFault:
        return False
    return True


def _score_reconstruction(metadata: PagedAttentionMetadata, layer_index: int,
                          query: torch.Tensor, pool: torch.Tensor, scale: float,
                          softmax: dict[str, Any]) -> None:
    """A reconstruction pass's scores, request by request. A failure fails its request, not
    the forward: every tensor-parallel rank runs the pass's layers to the end, so their
    collectives match."""
    step = metadata.step
    with step.score_timer.measure():
        for window in step.window_queries:
            request_id = step.req_ids[window.batch_index]
            if request_id in step.failures:
                continue  # failed in an earlier layer: its scores are not used
            try:
                maybe_fail("reconstruct", [window.prompt_len])
                accumulate_reconstruction_scores(
                    query, pool, metadata.kernel.page_format, step, window, layer_index, scale,
                    **softmax, **_scoring_blocks(step.layout.scoring_elements))
            except Exception as error:
                raise_if_fatal(error, pool.device, "reconstruction scoring")
                logger.exception("kvcompress: reconstruction scoring failed for request %s",
                                 request_id)
                step.fail([request_id], f"reconstruction scoring failed: {error!r}")


def _score_decode_queries(metadata: PagedAttentionMetadata, layer_index: int,
                          query: torch.Tensor, pool: torch.Tensor, scale: float,
                          softmax: dict[str, Any]) -> None:
    """All decoding requests at once; if that fails, each alone: one that fails loses only
    itself, and stops being scored in the later layers of this step."""
    step = metadata.step
    plan = step.decode_scoring
    page_format = metadata.kernel.page_format
    try:
        maybe_fail("score", [decode.prompt_len for decode in step.decode_queries])
        score_decode_layer(query, pool, page_format, plan, layer_index, scale, **softmax)
        return
    except Exception as error:
        raise_if_fatal(error, pool.device, "decode scoring")
        logger.exception("kvcompress: decode scoring failed; scoring requests one by one")
    healthy = []
    for number, decode in enumerate(step.decode_queries):
        try:
            maybe_fail("score", [decode.prompt_len])
            score_decode_layer(query, pool, page_format, plan, layer_index, scale,
                               requests=slice(number, number + 1), **softmax)
            healthy.append(number)
        except Exception as error:
            raise_if_fatal(error, pool.device, "decode scoring")
            request_id = step.req_ids[decode.batch_index]
            logger.exception("kvcompress: decode scoring failed for request %s", request_id)
            step.fail([request_id], f"decode scoring failed: {error!r}")
    step.decode_queries = [step.decode_queries[number] for number in healthy]
    step.decode_scoring = plan.subset(healthy) if healthy else None


def _score_one_by_one(metadata: PagedAttentionMetadata, layer_index: int, query: torch.Tensor,
                      key: torch.Tensor | None, pool: torch.Tensor, scale: float,
                      softmax: dict[str, Any]) -> None:
    """After a batched scoring failure: each window alone, on the torch path, so that only
    the windows that fail lose their request. This layer's share of a window's scores is
    recomputed from zero, which is exact only when the whole window is in this step; a
    window that began in an earlier chunk fails with the batch."""
    step = metadata.step
    healthy = []
    for window in step.window_queries:
        request_id = step.req_ids[window.batch_index]
        try:
            if not window.starts_in_step:
                raise RuntimeError("its scores from earlier chunks cannot be restored")
            window.scores[layer_index].zero_()
            maybe_fail("score", [window.prompt_len])
            accumulate_window_scores(query, pool, metadata.kernel.page_format,
                                     replace(step, window_queries=[window]), layer_index,
                                     scale, key=key, **softmax)
            healthy.append(window)
        except Exception as error:
            raise_if_fatal(error, pool.device, "scoring an observation window")
            step.fail([request_id], f"window scoring failed: {error!r}")
    step.window_queries = healthy
