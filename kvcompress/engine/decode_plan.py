"""The index tensors of one step's decode scoring (``kvcompress.step.DecodeScoring``), built
on the host from what the worker already holds there (page tables, row lengths, prompt
parts) and copied to the device once per step. Every layer then reads slices of them: no
host->device copy, Python list or boolean-mask indexing per layer, and shapes fixed for the
step. No vLLM imports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvcompress.paging import PageLayout
from kvcompress.step import GQA_REDUCE_CODES, DecodeQueries, DecodeScoring, StepBatch


def plan_decode_scoring(layout: PageLayout, step: StepBatch, decodes: Sequence[DecodeQueries],
                        page_tables: Sequence[np.ndarray], prompt_kept: np.ndarray,
                        to_device: Callable[[torch.Tensor], torch.Tensor]) -> DecodeScoring:
    """``decodes[i]``'s request holds ``page_tables[i] [rows, >= its pages]`` and per row
    ``prompt_kept[i]`` prompt tokens before its generated ones (``prompt_kept [n, rows]``);
    ``step.host_lengths_after`` counts this step's token."""
    num_layers, num_heads, page_size = layout.num_layers, layout.num_kv_heads, layout.page_size
    count = len(decodes)
    lengths = step.host_lengths_after[[decode.batch_index for decode in decodes]]  # [n, rows]
    num_pages = -(-int(lengths.max()) // page_size)
    width = max(decode.num_generated for decode in decodes)
    pages = np.zeros((count, layout.num_rows, num_pages), dtype=np.int64)
    for number, table in enumerate(page_tables):
        held = min(num_pages, table.shape[1])
        pages[number, :, :held] = table[:, :held]

    def by_layer(array: np.ndarray) -> torch.Tensor:
        """[n, rows, ...] -> [L, n, H, ...] on the device."""
        shaped = array.reshape(count, num_layers, num_heads, *array.shape[2:]).swapaxes(0, 1)
        return to_device(torch.from_numpy(np.ascontiguousarray(shaped)))

    reduces = [decode.group_reduce for decode in decodes]
    mixed = len(set(reduces)) > 1
    codes = torch.tensor([GQA_REDUCE_CODES.index(reduce) for reduce in reduces])
    tokens = [step.query_start_loc[decode.batch_index] for decode in decodes]
    return DecodeScoring(
        tokens=to_device(torch.tensor(tokens, dtype=torch.int64)),
        page_ids=by_layer(pages),
        lengths=by_layer(lengths),
        key_positions=to_device(torch.arange(num_pages * page_size)),
        prompt_kept=by_layer(prompt_kept.astype(np.int64)),
        offsets=to_device(torch.arange(width)),
        group_reduce="mixed" if mixed else reduces[0],
        reduce_codes=to_device(codes) if mixed else None,
        mass=to_device(torch.zeros(count, num_layers, num_heads, width, dtype=torch.float32)),
    )
