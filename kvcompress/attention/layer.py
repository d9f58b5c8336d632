"""One attention layer of one step over the page pool: what the vLLM backend runs for every
layer, kept free of vLLM so the worker pipeline runs (and is tested) with torch + Triton alone.
"""

from __future__ import annotations

import time

import torch

from kvcompress.step import PagedAttentionMetadata


def attend_layer(metadata: PagedAttentionMetadata, layer_index: int, query: torch.Tensor,
                 key: torch.Tensor, value: torch.Tensor, pool: torch.Tensor,
                 output: torch.Tensor, scale: float) -> torch.Tensor:
    """Stages 3-4 of a step (``kvcompress.step``) for one layer: write the step's K/V
    ``[T, H, D]`` into every head's row, attend (``query [T, Hq, D]`` into ``output``), and
    add the observation-window probabilities of requests finishing their prompt. Tensors
    may be padded beyond ``metadata.num_actual_tokens``; returns ``output``."""
    step, kernel = metadata.step, metadata.kernel
    num_tokens = metadata.num_actual_tokens
    query, output = query[:num_tokens], output[:num_tokens]
    key, value = key[:num_tokens], value[:num_tokens]
    kernel.write(pool, key, value, step.slot_mapping[:, step.layer_rows(layer_index)])
    kernel.attend(metadata.kernel_args, layer_index, query, pool, output, scale)
    if step.window_queries:
        started = time.perf_counter()
        kernel.accumulate_window_scores(metadata.kernel_args, layer_index, query, key, pool,
                                        step, scale, metadata.group_reduce)
        step.score_seconds += time.perf_counter() - started
    return output
