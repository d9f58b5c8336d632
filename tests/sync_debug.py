"""The regions of a step that must not synchronise with the device, checked on CUDA.

``KVCOMPRESS_SYNC_DEBUG=error`` (or ``warn``; scripts/gpu_check.sh sets ``error``) makes
``no_sync_region(device)`` run its body under ``torch.cuda.set_sync_debug_mode``: on CUDA a
synchronising call in it (``.item()``, ``.cpu()``, a copy from pageable memory...) raises
(warns). The pipeline tests wrap each layer's write, attention and scores in it; the
compaction after the forward has its one transfer and stays outside. Off CUDA, or unset,
nothing changes, but the region is still entered (``entered`` counts), so CPU runs check
that the tests wrap what they should.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

ENV = "KVCOMPRESS_SYNC_DEBUG"
MODES = ("error", "warn")


class _Counter:
    entered = 0


counter = _Counter()


def sync_debug_mode() -> str | None:
    """The mode asked for by ``KVCOMPRESS_SYNC_DEBUG`` (None: unset)."""
    mode = os.environ.get(ENV) or None
    if mode is not None and mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: use one of {', '.join(MODES)}")
    return mode


@contextmanager
def no_sync_region(device: torch.device | str) -> Iterator[None]:
    mode = sync_debug_mode()
    counter.entered += 1
    if mode is None or torch.device(device).type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
