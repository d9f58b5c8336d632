"""Compression in vLLM's /metrics: figures gathered by the scheduler each step, carried to the
API server on vLLM's SchedulerStats (a field ``vllm_hooks`` adds), and exported by a stat
logger plugin (entry point ``vllm.stat_logger_plugins``) as Prometheus metrics named
``kvcompress:*`` beside vLLM's own. A user sees that compression ran and what it saved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client import Counter, Gauge, Histogram
from vllm.v1.metrics.loggers import StatLoggerBase

from kvcompress.engine.engine_args import REQUESTED_SCORING_KEY
from kvcompress.engine.messages import Compaction, WorkerReport
from kvcompress.profile_model.surrogates import SurrogateError, load_surrogate
from kvcompress.settings.flags import SURROGATE_SCORINGS

STATS_FIELD = "kvcompress_stats"  # the SchedulerStats field (vllm_hooks.extend_scheduler_stats)
KEPT_FRACTION_BUCKETS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class StepFigures:
    """What compression did since the last SchedulerStats, in the scheduler process."""

    evicted_prompt_tokens: int = 0
    evicted_decode_tokens: int = 0
    compressed_requests: int = 0
    failed_requests: int = 0
    preempted_tokens: int = 0  # computed tokens of preempted requests (to be redone)
    window_freed_pages: int = 0  # sliding-window pages whose tokens no query can see
    kept_fractions: list[float] = field(default_factory=list)
    score_seconds: list[float] = field(default_factory=list)
    compaction_seconds: list[float] = field(default_factory=list)
    handoff_bytes: dict[str, int] = field(default_factory=dict)  # exported / imported

    def add_report(self, report: WorkerReport) -> None:
        for direction, count in report.handoff_bytes.items():
            self.handoff_bytes[direction] = self.handoff_bytes.get(direction, 0) + count
        if report.score_seconds:
            self.score_seconds.append(report.score_seconds)
        if report.compaction_seconds:
            self.compaction_seconds.append(report.compaction_seconds)

    def add_compaction(self, compaction: Compaction, physical_before: np.ndarray) -> None:
        """``physical_before``: the request's per-row physical lengths before the report."""
        kept = int(compaction.physical_lengths.sum())
        evicted = int(physical_before.sum()) - kept
        if compaction.kind == "decode":
            self.evicted_decode_tokens += evicted
            return
        self.evicted_prompt_tokens += evicted
        self.compressed_requests += 1
        self.kept_fractions.append(kept / (len(physical_before) * compaction.logical_len))

    def take(self, pages_free: int, pages_total: int) -> dict[str, Any]:
        """The figures as plain msgpack-able values, and a fresh start."""
        figures = {
            "evicted_prompt_tokens": self.evicted_prompt_tokens,
            "evicted_decode_tokens": self.evicted_decode_tokens,
            "compressed_requests": self.compressed_requests,
            "failed_requests": self.failed_requests,
            "preempted_tokens": self.preempted_tokens,
            "window_freed_pages": self.window_freed_pages,
            "kept_fractions": self.kept_fractions,
            "score_seconds": self.score_seconds,
            "compaction_seconds": self.compaction_seconds,
            "handoff_bytes": self.handoff_bytes,
            "pages_free": pages_free,
            "pages_total": pages_total,
        }
        self.__init__()  # type: ignore[misc]
        return figures


class TierFigures:
    """The offload tier's figures since the last take, from its totals since the start
    (``ShardedPageManager.tier_totals``); what it holds now as it is."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def take(self, totals: dict[str, int]) -> dict[str, int]:
        figures = {name: value - self._last.get(name, 0) for name, value in totals.items()}
        figures["held_bytes"] = totals.get("held_bytes", 0)
        self._last = dict(totals)
        return figures


class _Metrics:
    """The Prometheus metrics, created once per process (engines are a label)."""

    def __init__(self) -> None:
        labels = ["engine"]
        self.evicted = Counter("kvcompress:evicted_tokens",
                               "KV tokens evicted (summed over layers and KV heads)",
                               labels + ["phase"])
        self.compressed = Counter("kvcompress:compressed_requests",
                                  "Requests whose prompt cache was compressed", labels)
        self.failed = Counter("kvcompress:failed_requests",
                              "Requests ended with an error because their compression failed",
                              labels)
        self.preempted = Counter("kvcompress:preempted_tokens",
                                  "Computed tokens dropped by preemptions, to be recomputed "
                                  "(uncompressed) when their requests resume", labels)
        self.window_freed = Counter("kvcompress:window_freed_pages",
                                    "Pages of sliding-window layers freed because their "
                                    "tokens left the window (lossless)", labels)
        self.kept_fraction = Histogram("kvcompress:request_kept_fraction",
                                       "Share of a request's prompt cache kept by compression",
                                       labels, buckets=KEPT_FRACTION_BUCKETS)
        self.score_seconds = Histogram("kvcompress:scoring_seconds",
                                       "Observation-window scoring time per engine step",
                                       labels, buckets=SECONDS_BUCKETS)
        self.compaction_seconds = Histogram("kvcompress:compaction_seconds",
                                            "Planning + cache-move time per engine step",
                                            labels, buckets=SECONDS_BUCKETS)
        self.pages_free = Gauge("kvcompress:pages_free", "Free pages in the per-head page pool",
                                labels, multiprocess_mode="mostrecent")
        self.pages_total = Gauge("kvcompress:pages_total", "Pages in the per-head page pool",
                                 labels, multiprocess_mode="mostrecent")
        self.pages_cached = Gauge("kvcompress:pages_cached",
                                  "Pages held by finished requests' cached caches that no "
                                  "running request reads (evicted least-recently-used when "
                                  "pages are needed)",
                                  labels, multiprocess_mode="mostrecent")
        self.adopted_tokens = Counter("kvcompress:adopted_tokens",
                                      "Prompt tokens taken from a cached conversation instead "
                                      "of being prefilled (multi-turn reuse)", labels)
        self.adoptions = Counter("kvcompress:adoptions",
                                 "Cached caches adopted by a new request: shared (read in "
                                 "place, the entry stays cached) or handed over",
                                 labels + ["mode"])
        self.evicted_entries = Counter("kvcompress:cache_evicted_entries",
                                       "Cached caches evicted because running requests needed "
                                       "their pages", labels)
        self.segment_tokens = Counter("kvcompress:prefix_segment_tokens",
                                      "Prompt tokens of prefixes that waiting requests share, "
                                      "prefilled and compressed once by a request of their own "
                                      "(no client's request: not in vLLM's prompt tokens)",
                                      labels)
        self.fork_tokens = Counter(
            "kvcompress:prefix_fork_tokens",
            "Prompt tokens of prefixes that waiting requests share with a request that ran "
            "alone, copied off its pages (a fork: computed once, within its prompt)", labels)
        self.scoring = Gauge(
            "kvcompress:scoring_info",
            "1 for the scoring prompts are compressed by: requested (a flag, auto by default) "
            "and what it resolved to at start (auto: the score surrogate, else the window)",
            labels + ["requested", "scoring"], multiprocess_mode="mostrecent")
        self.surrogate_held_out = Gauge(
            "kvcompress:surrogate_held_out",
            "The loaded score surrogate's held-out figures, per kind of calibration text "
            "(all: every kind): rank correlation with the reconstruction pass, and the share "
            "of the pass's top quarter the surrogate's top quarter keeps",
            labels + ["kind", "figure"], multiprocess_mode="mostrecent")
        self.offload_bytes = Counter(
            "kvcompress:offload_bytes",
            "Bytes of compressed caches moved to the offload tier (saved: written, evicted "
            "from the page pool; known: offloaded but held by the tier already, not written "
            "again) and back (loaded, for a later turn), --kv-offloading-size",
            labels + ["direction"])
        self.offload_entries = Counter(
            "kvcompress:offload_entries",
            "Cached caches saved to the offload tier, loaded back, dropped from it (the least "
            "recently saved, to make room) or refused (larger than it)", labels + ["event"])
        self.offload_held = Gauge(
            "kvcompress:offload_bytes_held", "Bytes the offload tier holds now", labels,
            multiprocess_mode="mostrecent")
        self.handoff_bytes = Counter(
            "kvcompress:handoff_bytes",
            "Bytes of compressed prompts' kept rows handed to a decode instance (exported) or "
            "taken from a prefill instance (imported), --kv-transfer-config "
            "KVCompressConnector", labels + ["direction"])
        self.handoffs = Counter(
            "kvcompress:handoff_requests",
            "Requests a decode instance continued from a prefill instance's hand-off", labels)
        self.whole_segment_reads = Counter(
            "kvcompress:prefix_segment_whole_reads",
            "Requests that read a shared prefix before its compaction: they prefilled their "
            "own part over the whole prefix, which was compacted in place afterwards", labels)


_METRICS: _Metrics | None = None


def prometheus_metrics() -> _Metrics:
    global _METRICS
    if _METRICS is None:
        _METRICS = _Metrics()
    return _METRICS


class KVCompressStatLogger(StatLoggerBase):
    """vLLM stat logger plugin: exports each step's compression figures to Prometheus.
    Records nothing for an engine without compression (no figures arrive)."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.metrics = prometheus_metrics()
        self.engine = str(engine_index)
        settings = getattr(vllm_config, "additional_config", None) or {}
        if settings.get("kv_compression", "none") != "none":
            self._record_scoring(settings)

    def _record_scoring(self, settings: dict[str, Any]) -> None:
        """What ``--kv-scoring`` resolved to at start, and the surrogate's figures."""
        scoring = str(settings.get("kv_scoring", ""))
        requested = str(settings.get(REQUESTED_SCORING_KEY, scoring))
        self.metrics.scoring.labels(self.engine, requested, scoring).set(1)
        if not settings.get("kv_surrogate") or scoring not in SURROGATE_SCORINGS:
            return
        try:
            quality = load_surrogate(settings["kv_surrogate"]).quality
        except SurrogateError:
            return  # the start already checked it; nothing to show if it went since
        for key, value in quality.items():
            kind, _, figure = key.rpartition(".")
            if figure in ("rank_correlation", "overlap_4x"):
                self.metrics.surrogate_held_out.labels(self.engine, kind or "all",
                                                       figure).set(value)

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        figures = getattr(scheduler_stats, STATS_FIELD, None) if scheduler_stats else None
        if not figures:
            return
        metrics, engine = self.metrics, str(engine_idx)
        metrics.evicted.labels(engine, "prompt").inc(figures["evicted_prompt_tokens"])
        metrics.evicted.labels(engine, "decode").inc(figures["evicted_decode_tokens"])
        metrics.compressed.labels(engine).inc(figures["compressed_requests"])
        metrics.failed.labels(engine).inc(figures["failed_requests"])
        metrics.preempted.labels(engine).inc(figures["preempted_tokens"])
        metrics.window_freed.labels(engine).inc(figures.get("window_freed_pages", 0))
        for histogram, values in ((metrics.kept_fraction, figures["kept_fractions"]),
                                  (metrics.score_seconds, figures["score_seconds"]),
                                  (metrics.compaction_seconds, figures["compaction_seconds"])):
            for value in values:
                histogram.labels(engine).observe(value)
        metrics.pages_free.labels(engine).set(figures["pages_free"])
        metrics.pages_total.labels(engine).set(figures["pages_total"])
        metrics.pages_cached.labels(engine).set(figures.get("pages_cached", 0))
        metrics.adopted_tokens.labels(engine).inc(figures.get("adopted_tokens", 0))
        metrics.adoptions.labels(engine, "share").inc(figures.get("shares", 0))
        metrics.adoptions.labels(engine, "handover").inc(figures.get("handovers", 0))
        metrics.evicted_entries.labels(engine).inc(figures.get("evicted_entries", 0))
        metrics.segment_tokens.labels(engine).inc(figures.get("segment_tokens", 0))
        metrics.fork_tokens.labels(engine).inc(figures.get("fork_tokens", 0))
        metrics.whole_segment_reads.labels(engine).inc(figures.get("whole_segment_reads", 0))
        for direction, count in figures.get("handoff_bytes", {}).items():
            metrics.handoff_bytes.labels(engine, direction).inc(count)
        metrics.handoffs.labels(engine).inc(figures.get("handoffs", 0))
        tier = figures.get("offload")
        if tier:
            for direction in ("saved", "known", "loaded"):
                metrics.offload_bytes.labels(engine, direction).inc(tier[f"{direction}_bytes"])
            for event in ("saved", "loaded", "dropped", "refused"):
                metrics.offload_entries.labels(engine, event).inc(tier[f"{event}_entries"])
            metrics.offload_held.labels(engine).set(tier["held_bytes"])

    def log_engine_initialized(self) -> None:
        pass
