"""What the scheduler and the workers tell each other beyond vLLM's own messages.

Both travel as extra attributes on vLLM's step messages (pickled whole across the
process boundary): page-table deltas on the SchedulerOutput (one set per tensor-parallel
rank), the worker's report (compactions, failed requests, timings) on the
ModelRunnerOutput. vLLM returns one rank's output only, so under tensor parallelism the
ranks' reports are gathered first and merged (``merge_rank_reports``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvcompress.paging import PageTableDelta

# An extra argument of a shared prefix's own request (``engine/sched/prefix_segments.py``): how
# many tokens of their own its readers have after it (the median reader's), so that its
# tokens are scored at their distance from the readers' questions, as the score surrogate
# learned them, not from the segment's own end.
SEGMENT_READERS_AFTER_ARG = "kvcompress_segment_readers_after"

PAGE_DELTAS_ATTR = "kvcompress_page_deltas"
PASS_GRANTS_ATTR = "kvcompress_pass_grants"
SEGMENT_ORDERS_ATTR = "kvcompress_segment_orders"
DEFERRED_ATTR = "kvcompress_deferred_compactions"
TIER_ORDERS_ATTR = "kvcompress_tier_orders"
REPORT_ATTR = "kvcompress_report"
# The reason a rank gives for a request it failed because another rank did (ranks agree
# on failures before the steps' collectives); merged reports keep the other rank's.
FAILED_ON_ANOTHER_RANK = "failed on another tensor-parallel rank"


@dataclass
class Compaction:
    """After this step, ``logical_len`` logical tokens of the request occupy
    ``physical_lengths[row]`` slots in each (layer, KV head) row (every rank's rows,
    rank-major, once the ranks' reports are merged). ``kind``: "prompt" (the
    policy compressed the prompt), "decode" (the decode window trimmed generated tokens) or
    "deferred" (a shared prefix's segment request: its prompt was planned, not compacted;
    the lengths are its rows' once the scheduler orders the plan run, when its first
    readers have prefilled over the whole prefix)."""

    logical_len: int
    physical_lengths: np.ndarray
    kind: str = "prompt"
    # A "decode" eviction that follows a prompt compaction in the same report (a resumed
    # request recomputes its prompt and outputs in one step, or two steps' reports merged):
    # per row, the prompt tokens that compaction evicted. Without it the scheduler would
    # take the prompt for uncompacted and file its cache as exact.
    prompt_evicted: np.ndarray | None = None

    def then(self, later: Compaction) -> Compaction:
        """This compaction of a request followed by ``later`` of the same request, as one:
        the later lengths, and the prompt's eviction if either holds it."""
        if later.kind == "prompt":
            return later  # a prompt compacted again: the request was readmitted since
        prompt_evicted = (self.logical_len - self.physical_lengths if self.kind == "prompt"
                          else self.prompt_evicted)
        return replace(later, prompt_evicted=prompt_evicted)


@dataclass(frozen=True)
class Fork:
    """A shared prefix made of a deferred request's first ``tokens`` prompt tokens: the
    worker copies them onto the pages of the pseudo-request ``segment_id`` (allocated by the
    scheduler) and plans them as a segment request's prompt, from the request's own scores
    (``engine/sched/prefix_segments.py``, "forks")."""

    segment_id: str
    tokens: int


@dataclass
class DeferredCompactions:
    """One step's orders about prompts compacted a step late: ``defer``, the requests whose
    prompt completes in this step and is not compacted yet (their scores are kept); ``run``,
    those deferred in the step before, compacted in this one (parked: not in its batch),
    each with the fork made of its first tokens, or None."""

    defer: frozenset[str] = frozenset()
    run: dict[str, Fork | None] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.defer or self.run)


@dataclass
class WorkerReport:
    """What a worker's compression did since it last reported (one or more steps)."""

    compactions: dict[str, Compaction] = field(default_factory=dict)
    # Requests whose compression failed (id -> reason): the scheduler ends each with an
    # error (its pages are freed); every other request goes on.
    failures: dict[str, str] = field(default_factory=dict)
    score_seconds: float = 0.0  # observation-window scoring inside attention
    compaction_seconds: float = 0.0  # planning + moves after the forward
    # Requests whose prompt completed and waits for reconstruction passes (id -> tokens of
    # each pass chunk, in order): the scheduler grants them step by step
    # (``engine.pass_schedule``) and the prompt is compacted after the last.
    passes_pending: dict[str, list[int]] = field(default_factory=dict)
    # The offload tier (``engine.worker.offload``): restored entries whose load failed (the
    # scheduler drops them; their readers of this step failed with them), and (rank,
    # chunk) whose save failed (the scheduler drops the offloaded entries using them).
    lost_entries: list[int] = field(default_factory=list)
    lost_chunks: list[tuple[int, int]] = field(default_factory=list)
    # Requests whose adopted cache failed to load from the tier (they ran this step with an
    # empty context): the scheduler drops the step's output and preempts them, so that they
    # prefill again.
    reload: list[str] = field(default_factory=list)
    # Prefill/decode hand-off (``engine.handoff``): bytes of kept rows written for a decode
    # instance and read from a prefill instance's.
    handoff_bytes: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.compactions or self.failures or self.score_seconds
                    or self.compaction_seconds or self.passes_pending or self.lost_entries
                    or self.lost_chunks or self.reload or self.handoff_bytes)

    def merge(self, later: WorkerReport) -> None:
        merge_compactions(self.compactions, later.compactions)
        self.failures.update(later.failures)
        self.lost_entries += later.lost_entries
        self.lost_chunks += later.lost_chunks
        self.reload += later.reload
        self.passes_pending.update(later.passes_pending)
        self.score_seconds += later.score_seconds
        self.compaction_seconds += later.compaction_seconds
        self.handoff_bytes = _summed([self.handoff_bytes, later.handoff_bytes])


def merge_compactions(compactions: dict[str, Compaction],
                      later: dict[str, Compaction]) -> None:
    """Add ``later`` compactions to ``compactions`` (in place), request by request."""
    for request_id, compaction in later.items():
        earlier = compactions.get(request_id)
        compactions[request_id] = compaction if earlier is None else earlier.then(compaction)


def _merged_failures(reports: list[WorkerReport]) -> dict[str, str]:
    """Every rank's failures, each with the reason of a rank where it failed first-hand."""
    failures: dict[str, str] = {}
    for report in reports:
        for request_id, reason in report.failures.items():
            if failures.get(request_id, FAILED_ON_ANOTHER_RANK) == FAILED_ON_ANOTHER_RANK:
                failures[request_id] = reason
    return failures


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    summed: dict[str, int] = {}
    for count in counts:
        for name, value in count.items():
            summed[name] = summed.get(name, 0) + value
    return summed


def merge_rank_reports(reports: list[WorkerReport]) -> WorkerReport:
    """One report of every tensor-parallel rank's, in rank order: compactions join their
    rows rank-major; a request that failed on any rank failed. Times are the slowest
    rank's (the ranks work in parallel)."""
    if len(reports) == 1:
        return reports[0]
    merged = WorkerReport(
        failures=_merged_failures(reports),
        score_seconds=max(report.score_seconds for report in reports),
        compaction_seconds=max(report.compaction_seconds for report in reports),
        # Every rank chunks the same prompt alike; rank 0's chunks are the ones granted.
        passes_pending=dict(reports[0].passes_pending),
        lost_entries=sorted({entry_id for report in reports for entry_id in report.lost_entries}),
        lost_chunks=sorted({lost for report in reports for lost in report.lost_chunks}),
        reload=sorted({request_id for report in reports for request_id in report.reload}),
        handoff_bytes=_summed([report.handoff_bytes for report in reports]),
    )
    for request_id in merged.reload:  # (a rank whose load worked went on: moot, it reloads)
        merged.failures.pop(request_id, None)
    for request_id, first in reports[0].compactions.items():
        if request_id in merged.failures or request_id in merged.reload:
            continue
        parts = [report.compactions.get(request_id) for report in reports]
        if any(part is None or (part.logical_len, part.kind) != (first.logical_len, first.kind)
               for part in parts):
            merged.failures[request_id] = ("tensor-parallel ranks disagree on a compaction "
                                           f"of {request_id}")
            continue
        prompt_evicted = [part.prompt_evicted for part in parts]  # type: ignore[union-attr]
        merged.compactions[request_id] = Compaction(
            first.logical_len,
            np.concatenate([part.physical_lengths for part in parts]),  # type: ignore[union-attr]
            first.kind,
            None if any(rows is None for rows in prompt_evicted)
            else np.concatenate(prompt_evicted),  # type: ignore[arg-type]
        )
    for report in reports[1:]:
        for request_id in (report.compactions.keys() - reports[0].compactions.keys()
                           - set(merged.reload)):
            merged.failures.setdefault(request_id, "tensor-parallel ranks disagree on a "
                                                   f"compaction of {request_id}")
    return merged


def attach_page_deltas(scheduler_output: Any,
                       deltas_by_rank: list[dict[str, PageTableDelta]]) -> None:
    setattr(scheduler_output, PAGE_DELTAS_ATTR, deltas_by_rank)


def page_deltas(scheduler_output: Any, rank: int = 0) -> dict[str, PageTableDelta]:
    """The page-table changes for tensor-parallel ``rank``'s pool."""
    deltas_by_rank = getattr(scheduler_output, PAGE_DELTAS_ATTR, None)
    return deltas_by_rank[rank] if deltas_by_rank else {}


def attach_pass_grants(scheduler_output: Any, grants: dict[str, int]) -> None:
    """This step's reconstruction pass chunks (request id -> how many of its next ones)."""
    setattr(scheduler_output, PASS_GRANTS_ATTR, grants)


def attach_segment_orders(scheduler_output: Any,
                          orders_by_rank: list[dict[str, np.ndarray | None]]) -> None:
    """Per rank: segment plans to run now (segment request id -> whole pages each row
    drops) or to forget (None)."""
    if any(orders_by_rank):
        setattr(scheduler_output, SEGMENT_ORDERS_ATTR, orders_by_rank)


def segment_orders(scheduler_output: Any, rank: int = 0) -> dict[str, np.ndarray | None]:
    orders_by_rank = getattr(scheduler_output, SEGMENT_ORDERS_ATTR, None)
    return orders_by_rank[rank] if orders_by_rank else {}


def attach_deferred_compactions(scheduler_output: Any, orders: DeferredCompactions) -> None:
    if orders:
        setattr(scheduler_output, DEFERRED_ATTR, orders)


def deferred_compactions(scheduler_output: Any) -> DeferredCompactions:
    return getattr(scheduler_output, DEFERRED_ATTR, None) or DeferredCompactions()


def attach_tier_orders(scheduler_output: Any, orders_by_rank: list[list[Any]]) -> None:
    """Per rank: the offload tier's saves, loads and drops (``paging.TierOrder``), in order."""
    if any(orders_by_rank):
        setattr(scheduler_output, TIER_ORDERS_ATTR, orders_by_rank)


def tier_orders(scheduler_output: Any, rank: int = 0) -> list[Any]:
    orders_by_rank = getattr(scheduler_output, TIER_ORDERS_ATTR, None)
    return orders_by_rank[rank] if orders_by_rank else []


def pass_grants(scheduler_output: Any) -> dict[str, int]:
    return getattr(scheduler_output, PASS_GRANTS_ATTR, None) or {}


def worker_report(model_runner_output: Any) -> WorkerReport:
    return getattr(model_runner_output, REPORT_ATTR, None) or WorkerReport()
