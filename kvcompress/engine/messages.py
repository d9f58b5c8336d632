"""What the scheduler and the workers tell each other beyond vLLM's own messages.

Both travel as extra attributes on vLLM's step messages (pickled whole across the
process boundary): page-table deltas on the SchedulerOutput, compaction reports and the
requests whose compression failed on the ModelRunnerOutput.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcompress.paging import PageTableDelta

PAGE_DELTAS_ATTR = "kvcompress_page_deltas"
COMPACTIONS_ATTR = "kvcompress_compactions"
FAILURES_ATTR = "kvcompress_failures"


@dataclass
class Compaction:
    """After this step, ``logical_len`` logical tokens of the request occupy
    ``physical_lengths[row]`` slots in each (layer, KV head) row."""

    logical_len: int
    physical_lengths: np.ndarray


def attach_page_deltas(scheduler_output: Any, deltas: dict[str, PageTableDelta]) -> None:
    setattr(scheduler_output, PAGE_DELTAS_ATTR, deltas)


def page_deltas(scheduler_output: Any) -> dict[str, PageTableDelta]:
    return getattr(scheduler_output, PAGE_DELTAS_ATTR, None) or {}


def compactions(model_runner_output: Any) -> dict[str, Compaction]:
    return getattr(model_runner_output, COMPACTIONS_ATTR, None) or {}


def failures(model_runner_output: Any) -> dict[str, str]:
    """Requests whose compression failed on the worker, with the reason: the scheduler ends
    each with an error (its pages are freed), every other request goes on."""
    return getattr(model_runner_output, FAILURES_ATTR, None) or {}
