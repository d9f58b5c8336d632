"""What the scheduler and the workers tell each other beyond vLLM's own messages.

Both travel as extra attributes on vLLM's step messages (pickled whole across the
process boundary): page-table deltas on the SchedulerOutput, the worker's report
(compactions, failed requests, timings) on the ModelRunnerOutput.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcompress.paging import PageTableDelta

PAGE_DELTAS_ATTR = "kvcompress_page_deltas"
REPORT_ATTR = "kvcompress_report"


@dataclass
class Compaction:
    """After this step, ``logical_len`` logical tokens of the request occupy
    ``physical_lengths[row]`` slots in each (layer, KV head) row. ``kind``: "prompt" (the
    policy compressed the prompt) or "decode" (the decode window trimmed generated tokens)."""

    logical_len: int
    physical_lengths: np.ndarray
    kind: str = "prompt"


@dataclass
class WorkerReport:
    """What a worker's compression did since it last reported (one or more steps)."""

    compactions: dict[str, Compaction] = field(default_factory=dict)
    # Requests whose compression failed (id -> reason): the scheduler ends each with an
    # error (its pages are freed); every other request goes on.
    failures: dict[str, str] = field(default_factory=dict)
    score_seconds: float = 0.0  # observation-window scoring inside attention
    compaction_seconds: float = 0.0  # planning + moves after the forward

    def __bool__(self) -> bool:
        return bool(self.compactions or self.failures or self.score_seconds
                    or self.compaction_seconds)

    def merge(self, later: WorkerReport) -> None:
        # A later compaction of the same request holds its final lengths.
        self.compactions.update(later.compactions)
        self.failures.update(later.failures)
        self.score_seconds += later.score_seconds
        self.compaction_seconds += later.compaction_seconds


def attach_page_deltas(scheduler_output: Any, deltas: dict[str, PageTableDelta]) -> None:
    setattr(scheduler_output, PAGE_DELTAS_ATTR, deltas)


def page_deltas(scheduler_output: Any) -> dict[str, PageTableDelta]:
    return getattr(scheduler_output, PAGE_DELTAS_ATTR, None) or {}


def worker_report(model_runner_output: Any) -> WorkerReport:
    return getattr(model_runner_output, REPORT_ATTR, None) or WorkerReport()
