"""The vLLM engine of one configuration: build it from the shared settings, run token-id
prompts to completion, shut it down.

vLLM is imported inside the functions: only worker processes (and compression_cost.py) pay
for it, so the parents' ``--help`` and argument checks stay fast.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.specs import CompressionSpec, EngineSettings


def build_engine(settings: EngineSettings, spec: CompressionSpec,
                 stat_loggers: list[Any] | None = None, *,
                 enable_prefix_caching: bool = False,
                 logits_processors: Sequence[str] = ()) -> Any:
    """An LLMEngine for ``spec`` with the shared settings (stats on when loggers are given).
    Prefix caching is off unless asked for (benchmarks.multi_turn measures reuse).
    ``logits_processors``: extra vLLM V1 logits processors, as "module:Class" paths."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    engine_args = EngineArgs(
        model=settings.model,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
        enforce_eager=settings.enforce_eager,
        seed=settings.seed,
        # The same for every configuration of a run: off, no reuse of repeated prompt
        # prefixes (this also switches kvcompress's --kv-reuse off).
        enable_prefix_caching=enable_prefix_caching,
        tensor_parallel_size=settings.tensor_parallel_size,
        distributed_executor_backend=_executor(settings),
        disable_log_stats=not stat_loggers,
        logits_processors=list(logits_processors) or None,
        additional_config=spec.additional_config(settings.compression_options),
    )
    return LLMEngine.from_engine_args(engine_args, stat_loggers=stat_loggers)


def _executor(settings: EngineSettings) -> str | None:
    if settings.tensor_parallel_size > 1:
        return "mp"  # a worker process per rank
    return None if settings.multiprocess else "uni"


def shutdown_engine(engine: Any) -> None:
    """Stop the engine core (and its processes in multiprocess mode); never raises."""
    core = getattr(engine, "engine_core", None)
    with contextlib.suppress(Exception):
        if core is not None:
            core.shutdown()
    import gc

    gc.collect()


@dataclass
class Finished:
    """One finished request: output token ids and text."""

    prompt_len: int
    token_ids: list[int]
    text: str


def generate(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    params: Sequence[Any],
    on_step: Callable[[int, int], None] | None = None,
) -> tuple[list[Finished], float]:
    """Run token-id prompts to completion; returns outputs in prompt order and seconds spent.

    ``on_step(finished_requests, generated_tokens)`` is called after every engine step.
    """
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    for index, (ids, sampling) in enumerate(zip(prompts, params)):
        engine.add_request(str(index), TokensPrompt(prompt_token_ids=list(ids)), sampling)
    done: dict[int, Finished] = {}
    generated = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                completion = output.outputs[0]
                done[int(output.request_id)] = Finished(
                    len(output.prompt_token_ids or ()), list(completion.token_ids),
                    completion.text,
                )
                generated += len(completion.token_ids)
        if on_step is not None:
            on_step(len(done), generated)
    elapsed = time.perf_counter() - start
    missing = [i for i in range(len(prompts)) if i not in done]
    if missing:
        raise RuntimeError(f"requests {missing[:5]} never finished")
    return [done[i] for i in range(len(prompts))], elapsed
