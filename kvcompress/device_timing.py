"""Timing stages of a step that launch device work, without waiting for the device.

On CPU the work is done when the call returns: ``time.perf_counter`` around it is its time.
On CUDA a launch returns at once, so the same clock measures launches, not work. There the
timer records a CUDA event before and after the stage on the current stream, and reads their
elapsed time only once the end event has completed (``Event.query``, which does not wait):
a stage's seconds are reported by the first ``take`` after the device finished it (usually
the next step's), and ``take(wait=True)`` (when statistics are collected) waits for the rest.
The CUDA path has not run on a GPU yet: its tests emulate the events.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Measurement:
    """One measured stage; ``discard()`` leaves it out of the total (a stage that turned
    out to have had nothing to do)."""

    kept: bool = True

    def discard(self) -> None:
        self.kept = False


class StageTimer:
    """Seconds spent in the stages measured on ``device``, summed until taken."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._events = torch.device(device).type == "cuda"
        self._seconds = 0.0
        self._pending: list[tuple[Any, Any, Measurement]] = []  # CUDA: start, end events

    @contextmanager
    def measure(self) -> Iterator[Measurement]:
        measurement = Measurement()
        if not self._events:
            started = time.perf_counter()
            try:
                yield measurement
            finally:
                if measurement.kept:
                    self._seconds += time.perf_counter() - started
            return
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        try:
            yield measurement
        finally:
            end.record()
            self._pending.append((start, end, measurement))

    def take(self, wait: bool = False) -> float:
        """The seconds measured since the last ``take``: on CUDA of the stages the device
        has finished (all of them with ``wait``, which waits for them)."""
        # Events on one stream complete in order: waiting for the last waits for all, and
        # the first one still pending ends the reading.
        if wait and self._pending:
            self._pending[-1][1].synchronize()
        while self._pending and self._pending[0][1].query():
            start, end, measurement = self._pending.pop(0)
            if measurement.kept:
                self._seconds += start.elapsed_time(end) / 1000.0  # milliseconds
        seconds, self._seconds = self._seconds, 0.0
        return seconds
