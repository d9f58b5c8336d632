"""The index tensors of one step's decode scoring (``kvcompress.step.DecodeScoring``), built
on the host from what the worker already holds there (row lengths, prompt parts, the step's
page-table classes) and copied to the device once per step. Every layer then reads slices
of them: no host->device copy, Python list or boolean-mask indexing per layer.

Nothing here is sized by the longest row: per scored request only its per-row lengths and
prompt parts (int32 ``[L, n, H]``) and its class and column in the step's page tables,
which the attention already holds on the device and keeps between steps (the torch pass
reads each row's own pages from them, ``attention.decode_scores``; the fused GPU pass reads
none of it). The step's scores go into the worker's ``mass`` buffer, kept between steps.
No vLLM imports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvcompress.paging import PageLayout
from kvcompress.step import (
    GQA_REDUCE_CODES,
    DecodeClassGroup,
    DecodeQueries,
    DecodeScoring,
    StepBatch,
)


def plan_decode_scoring(layout: PageLayout, step: StepBatch, decodes: Sequence[DecodeQueries],
                        prompt_kept: np.ndarray, mass: torch.Tensor,
                        to_device: Callable[[torch.Tensor], torch.Tensor]) -> DecodeScoring:
    """``decodes[i]``'s request holds per row ``prompt_kept[i]`` prompt tokens before its
    generated ones (``prompt_kept [n, rows]``); ``step.host_lengths_after`` counts this
    step's token. ``mass [n, L, H, W]``: zeroed, on the device, ``W`` the most generated
    offsets any of them scores."""
    num_layers, num_heads, page_size = layout.num_layers, layout.num_kv_heads, layout.page_size
    count = len(decodes)
    batch = np.array([decode.batch_index for decode in decodes], dtype=np.int64)
    lengths = step.host_lengths_after[batch]  # [n, rows]

    def by_layer(array: np.ndarray) -> torch.Tensor:
        """[n, rows] -> int32 [L, n, H] on the device."""
        shaped = array.reshape(count, num_layers, num_heads).swapaxes(0, 1).astype(np.int32)
        return to_device(torch.from_numpy(np.ascontiguousarray(shaped)))

    # pages each request holds over its H rows, per layer: what the torch pass gathers
    pages = (-(-lengths // page_size)).reshape(count, num_layers, num_heads).sum(axis=2)
    tables = step.tables
    groups = []
    for table in np.unique(tables.class_of[batch]):
        members = np.flatnonzero(tables.class_of[batch] == table)  # ascending
        groups.append(DecodeClassGroup(
            int(table), to_device(torch.from_numpy(members)),
            to_device(torch.from_numpy(tables.position[batch[members]])),
            members, np.ascontiguousarray(pages[members].T)))
    reduces = [decode.group_reduce for decode in decodes]
    mixed = len(set(reduces)) > 1
    codes = torch.tensor([GQA_REDUCE_CODES.index(reduce) for reduce in reduces])
    tokens = [step.query_start_loc[decode.batch_index] for decode in decodes]
    return DecodeScoring(
        tokens=to_device(torch.tensor(tokens, dtype=torch.int64)),
        lengths=by_layer(lengths),
        prompt_kept=by_layer(prompt_kept),
        group_reduce="mixed" if mixed else reduces[0],
        reduce_codes=to_device(codes) if mixed else None,
        mass=mass,
        tables=tables,
        groups=groups,
    )
