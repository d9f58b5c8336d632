"""The vLLM engine of one configuration: build it from the shared settings, run token-id
prompts to completion, shut it down.

vLLM is imported inside the functions: only worker processes (and compression_cost.py) pay
for it, so the parents' ``--help`` and argument checks stay fast.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.specs import CompressionSpec, EngineSettings


def build_engine(settings: EngineSettings, spec: CompressionSpec,
                 stat_loggers: list[Any] | None = None, *,
                 logits_processors: Sequence[str] = (),
                 iteration_details: bool = False) -> Any:
    """An LLMEngine for ``spec`` with the shared settings (stats on when loggers are given);
    ``engine_args`` says what it is given."""
    from vllm.v1.engine.llm_engine import LLMEngine

    args = engine_args(settings, spec, stat_loggers=bool(stat_loggers),
                       logits_processors=logits_processors,
                       iteration_details=iteration_details)
    return LLMEngine.from_engine_args(args, stat_loggers=stat_loggers)


def engine_args(settings: EngineSettings, spec: CompressionSpec, *, stat_loggers: bool = False,
                logits_processors: Sequence[str] = (), iteration_details: bool = False) -> Any:
    """vLLM's EngineArgs for ``spec`` with the shared settings. Prefix caching follows
    ``settings.enable_prefix_caching``: on, as vLLM's default, unless a run turns it off.
    ``logits_processors``: extra vLLM V1 logits processors, as "module:Class" paths.
    ``iteration_details``: the scheduler stats of every step carry vLLM's
    ``SchedulerIterationDetails`` (tokens scheduled in prefill and in decode)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=settings.model,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
        kv_cache_dtype=spec.cache_dtype,
        enforce_eager=settings.enforce_eager,
        seed=settings.seed,
        # The same for every configuration of a run. Off also switches kvcompress's
        # --kv-reuse off (and with it the reconstruction pass of --kv-scoring auto).
        enable_prefix_caching=settings.enable_prefix_caching,
        tensor_parallel_size=settings.tensor_parallel_size,
        distributed_executor_backend=_executor(settings),
        disable_log_stats=not stat_loggers,
        logits_processors=list(logits_processors) or None,
        enable_logging_iteration_details=iteration_details,
        kv_offloading_size=settings.kv_offloading_gib,
        additional_config=spec.additional_config(settings.compression_options),
    )


def _executor(settings: EngineSettings) -> str | None:
    if settings.tensor_parallel_size > 1:
        return "mp"  # a worker process per rank
    return None if settings.multiprocess else "uni"


def prompt_kept_fraction(engine: Any) -> float | None:
    """Share of the compacted prompts' token-rows kept, over every rank (rows weighted by
    length), measured by the workers; None when nothing was compacted."""
    ranks = engine.collective_rpc(
        lambda worker: asdict(worker.model_runner.paged_runtime.collect_stats()))
    planned = sum(stats["prompt_rows_planned"] for stats in ranks)
    kept = sum(stats["prompt_rows_kept"] for stats in ranks)
    return kept / planned if planned else None


def shutdown_engine(engine: Any) -> None:
    """Stop the engine core (and its processes in multiprocess mode); never raises."""
    core = getattr(engine, "engine_core", None)
    with contextlib.suppress(Exception):
        if core is not None:
            core.shutdown()
    import gc

    gc.collect()


def clear_prefix_cache(engine: Any) -> None:
    """Forget every cached prefix (vLLM's blocks, kvcompress's kept entries), so that a pass
    over prompts the engine has already seen computes them again."""
    if not engine.reset_prefix_cache():
        raise RuntimeError("the prefix cache was not reset: requests are still running")


@dataclass(frozen=True)
class Wave:
    """Requests submitted together, (request id, prompt token ids) each, with one
    SamplingParams. ``after``: when the wave is submitted: ``start`` (at once),
    ``first_token`` (every request of the earlier waves has its first token: their prefills
    are done) or ``finished`` (every earlier request has ended)."""

    requests: Sequence[tuple[str, Sequence[int]]]
    params: Any
    after: str = "start"


WAVE_STARTS = ("start", "first_token", "finished")


@dataclass
class WaveRun:
    outputs: dict[str, Any]  # the final RequestOutput of every request, by id
    ttft_s: dict[str, float]  # its submission -> the step that returned its first token
    elapsed_s: float  # first submission -> last request finished


def run_waves(engine: Any, waves: Sequence[Wave],
              on_step: Callable[[], None] | None = None) -> WaveRun:
    """Submit the waves of token-id prompts, each when its ``after`` holds, and step until
    every request has ended."""
    from vllm.inputs import TokensPrompt

    for wave in waves:
        if wave.after not in WAVE_STARTS:
            raise ValueError(f"wave start {wave.after!r}; allowed: {', '.join(WAVE_STARTS)}")
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, Any] = {}
    pending = list(waves)
    started = time.perf_counter()

    def ready(wave: Wave) -> bool:
        if wave.after == "start":
            return True
        return all(request_id in done or (wave.after == "first_token" and request_id in first)
                   for request_id in submitted)

    while pending or engine.has_unfinished_requests():
        while pending and ready(pending[0]):
            wave = pending.pop(0)
            for request_id, ids in wave.requests:
                submitted[request_id] = time.perf_counter()
                engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(ids)),
                                   wave.params)
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            if output.outputs[0].token_ids and output.request_id not in first:
                first[output.request_id] = now - submitted[output.request_id]
            if output.finished:
                done[output.request_id] = output
        if on_step is not None:
            on_step()
    return WaveRun(done, first, time.perf_counter() - started)


# kvcompress's per-step figures (kvcompress/engine/metrics.py, scheduler stats) that
# compression_figures_logger sums: compressed prompts, failures, adoptions of cached entries.
SUMMED_FIGURES = ("compressed_requests", "failed_requests", "evicted_prompt_tokens",
                  "adopted_tokens", "shares", "handovers", "evicted_entries")


def compression_figures_logger(sink: dict[str, int]) -> Callable[..., Any]:
    """A vLLM stat logger factory (``build_engine(stat_loggers=[...])``) adding kvcompress's
    figures of every step to ``sink`` (``SUMMED_FIGURES``; nothing for vanilla vLLM): what
    the plugin itself says it compressed and adopted, beside vLLM's ``num_cached_tokens``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    from kvcompress.engine.metrics import STATS_FIELD

    class CompressionFigures(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            figures = getattr(scheduler_stats, STATS_FIELD, None) or {}
            for key in SUMMED_FIGURES:
                sink[key] = sink.get(key, 0) + int(figures.get(key, 0))

        def log_engine_initialized(self) -> None:
            pass

    return CompressionFigures


@dataclass
class Finished:
    """One finished request: output token ids and text, and how many prompt tokens the
    prefix cache served (vLLM's ``num_cached_tokens``; 0 without prefix caching)."""

    prompt_len: int
    token_ids: list[int]
    text: str
    cached_tokens: int = 0


def generate(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    params: Sequence[Any],
    on_step: Callable[[int, int], None] | None = None,
    on_outputs: Callable[[Sequence[Any]], None] | None = None,
) -> tuple[list[Finished], float]:
    """Run token-id prompts to completion; returns outputs in prompt order and seconds spent.

    ``on_step(finished_requests, generated_tokens)`` is called after every engine step, and
    before it ``on_outputs(request_outputs)`` with the step's RequestOutputs.
    """
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    for index, (ids, sampling) in enumerate(zip(prompts, params)):
        engine.add_request(str(index), TokensPrompt(prompt_token_ids=list(ids)), sampling)
    done: dict[int, Finished] = {}
    generated = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if on_outputs is not None:
            on_outputs(outputs)
        for output in outputs:
            if output.finished:
                completion = output.outputs[0]
                done[int(output.request_id)] = Finished(
                    len(output.prompt_token_ids or ()), list(completion.token_ids),
                    completion.text, int(output.num_cached_tokens or 0),
                )
                generated += len(completion.token_ids)
        if on_step is not None:
            on_step(len(done), generated)
    elapsed = time.perf_counter() - start
    missing = [i for i in range(len(prompts)) if i not in done]
    if missing:
        raise RuntimeError(f"requests {missing[:5]} never finished")
    return [done[i] for i in range(len(prompts))], elapsed
