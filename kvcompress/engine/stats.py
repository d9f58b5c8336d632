"""Per-step engine figures read from vLLM's own scheduler stats (no timing, no guessing).

``StepStatsRecorder`` is a vLLM stat logger: pass ``StepStatsRecorder.factory(stats)``
(``stats``: the ``EngineStats`` to fill) to ``LLMEngine.from_engine_args(...,
stat_loggers=[...])`` (with log stats enabled) and it records, for every engine step, how
many requests ran, how many waited, and the KV-cache usage the scheduler reported (pages
in use for kvcompress, blocks for vanilla vLLM).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from kvcompress.engine.metrics import STATS_FIELD


@dataclass
class StepSample:
    running: int
    waiting: int
    kv_cache_usage: float


@dataclass
class EngineStats:
    samples: list[StepSample] = field(default_factory=list)
    preemptions: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    # Computed tokens preemptions dropped (kvcompress's scheduler counts them; None for an
    # engine without compression, whose scheduler does not report them).
    preempted_tokens: int | None = None
    window_freed_pages: int = 0  # sliding-window pages freed (kvcompress only)
    # Seconds the workers report spending on scores (window, decode, reconstruction) and on
    # compaction (kvcompress only; rank 0's, as its scheduler stats carry them).
    score_seconds: float = 0.0
    compaction_seconds: float = 0.0
    # The offload tier (kvcompress with --kv-offloading-size): bytes saved and loaded,
    # entries saved, loaded and dropped, summed over steps; bytes held at the last step.
    offload: dict[str, int] = field(default_factory=dict)


class StepStatsRecorder(StatLoggerBase):
    def __init__(self, vllm_config: Any, engine_index: int = 0,
                 sink: EngineStats | None = None) -> None:
        self.stats = sink if sink is not None else EngineStats()

    @classmethod
    def factory(cls, sink: EngineStats) -> Callable[[Any, int], StepStatsRecorder]:
        def make(vllm_config: Any, engine_index: int = 0) -> StepStatsRecorder:
            return cls(vllm_config, engine_index, sink)

        return make

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self.stats.samples.append(
                StepSample(
                    running=scheduler_stats.num_running_reqs,
                    waiting=scheduler_stats.num_waiting_reqs,
                    kv_cache_usage=scheduler_stats.kv_cache_usage,
                )
            )
            figures = getattr(scheduler_stats, STATS_FIELD, None)
            if figures:
                self.stats.preempted_tokens = ((self.stats.preempted_tokens or 0)
                                               + figures["preempted_tokens"])
                self.stats.window_freed_pages += figures.get("window_freed_pages", 0)
                self.stats.score_seconds += sum(figures.get("score_seconds", ()))
                self.stats.compaction_seconds += sum(figures.get("compaction_seconds", ()))
                for name, value in (figures.get("offload") or {}).items():
                    held = name == "held_bytes"
                    self.stats.offload[name] = value + (0 if held else
                                                        self.stats.offload.get(name, 0))
        if iteration_stats is not None:
            self.stats.preemptions += iteration_stats.num_preempted_reqs
            self.stats.generated_tokens += iteration_stats.num_generation_tokens
            self.stats.prompt_tokens += iteration_stats.prompt_token_stats.computed

    def log_engine_initialized(self) -> None:
        pass
