"""The worker side: one configuration's engine, warmed up, driven through every
conversation (``python -m benchmarks.multi_turn --worker``)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.jobs import Reporter
from benchmarks.multi_turn.configs import RunConfig
from benchmarks.multi_turn.driver import drive
from benchmarks.multi_turn.workload import Conversation, PromptBuilder
from benchmarks.specs import EngineSettings

RECALL_ANSWER_TOKENS = 10  # the last turn's answer: the pass key and a little more


def prefix_cache_logger(sink: dict[str, int]) -> Callable[..., Any]:
    """A vLLM stat logger factory summing the scheduler's prefix-cache queries and hits."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class PrefixCacheRecorder(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            stats = getattr(scheduler_stats, "prefix_cache_stats", None)
            if stats is not None:
                sink["requests"] += stats.requests
                sink["queries"] += stats.queries
                sink["hits"] += stats.hits

        def log_engine_initialized(self) -> None:
            pass

    return PrefixCacheRecorder


def sampling_params(conversation: Conversation, turn: int, answer_tokens: int,
                    special_ids: Sequence[int]) -> Any:
    """Greedy. Every answer but a recall question's: exactly ``answer_tokens`` tokens, the
    special tokens masked (min_tokens masks stop tokens until it is reached)."""
    from vllm import SamplingParams

    if conversation.answer_prefix and turn == len(conversation.user) - 1:
        return SamplingParams(max_tokens=RECALL_ANSWER_TOKENS, temperature=0.0)
    return SamplingParams(max_tokens=answer_tokens, min_tokens=answer_tokens, temperature=0.0,
                          stop_token_ids=list(special_ids))


def special_token_ids(tokenizer: Any) -> list[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
               if getattr(token, "special", False))
    return sorted(ids)


def warm_up(engine: Any) -> None:
    """One short request whose tokens share no prefix with a chat-templated prompt (a cached
    copy of it must not serve the conversations' system prompt)."""
    from vllm import SamplingParams

    engine.add_request("warmup", {"prompt_token_ids": list(range(1000, 1064))},
                       SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()


def run_job(job: dict[str, Any], reporter: Reporter) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from benchmarks.engine import build_engine
    from kvcompress.engine.stats import EngineStats, StepStatsRecorder

    settings = EngineSettings(**job["settings"])
    config = RunConfig.from_json(job["config"])
    workload = json.loads(Path(job["workload_path"]).read_text())
    conversations = [Conversation(**c) for c in workload["conversations"]]
    tokenizer = AutoTokenizer.from_pretrained(settings.model)
    builder = PromptBuilder(tokenizer, workload["prompt_build"])
    special = special_token_ids(tokenizer)
    sink = EngineStats()
    prefix = {"requests": 0, "queries": 0, "hits": 0}
    # vanilla-noprefix is the one configuration with vLLM's prefix caching off
    engine = build_engine(dataclasses.replace(settings,
                                              enable_prefix_caching=config.prefix_caching,
                                              kv_offloading_gib=config.offload_gib),
                          config.spec,
                          stat_loggers=[StepStatsRecorder.factory(sink),
                                        prefix_cache_logger(prefix)])
    try:
        if job["warmup"]:  # one-time costs (kernel selection, allocations) out of the figures
            warm_up(engine)
        sink.samples.clear()
        sink.preemptions = sink.generated_tokens = sink.prompt_tokens = 0
        sink.preempted_tokens = None
        sink.offload.clear()
        prefix.update(requests=0, queries=0, hits=0)
        last = [0.0]

        def on_step(generated: int) -> None:
            now = time.monotonic()
            if now - last[0] > 1.0:
                last[0] = now
                reporter.progress(generated)

        records, elapsed = drive(
            engine, conversations, builder,
            lambda c, t: sampling_params(c, t, workload["answer_tokens"], special),
            workload["arrivals"], on_step,
        )
    finally:
        from benchmarks.engine import shutdown_engine

        shutdown_engine(engine)
    busy = [s for s in sink.samples if s.running > 0]
    return {
        "records": [asdict(r) for r in records],
        "elapsed_s": elapsed,
        "preemptions": sink.preemptions,
        "preempted_tokens": sink.preempted_tokens,
        "prefix_cache": prefix,
        "peak_running": max((s.running for s in sink.samples), default=0),
        "mean_running": sum(s.running for s in busy) / len(busy) if busy else 0.0,
        "peak_kv_usage": max((s.kv_cache_usage for s in sink.samples), default=0.0),
        "offload": dict(sink.offload) or None,
    }

