"""A vLLM LLMEngine driven step by step, with the scheduler and workers reachable."""

from __future__ import annotations

import gc
import random
from collections.abc import Callable, Iterable
from typing import Any

from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.engine.llm_engine import LLMEngine

from kvcompress.engine.stats import EngineStats, StepStatsRecorder


class EngineHarness:
    def __init__(self, model: str, compression: dict | None = None, **engine_kwargs: Any):
        self.stats = EngineStats()
        kwargs = dict(enforce_eager=True, disable_log_stats=False, seed=0)
        kwargs.update(engine_kwargs)
        if compression:
            kwargs["additional_config"] = dict(compression)
        self.engine = LLMEngine.from_engine_args(
            EngineArgs(model=model, **kwargs),
            stat_loggers=[StepStatsRecorder.factory(self.stats)],
        )
        self.outputs: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.finish_reasons: dict[str, str | None] = {}
        self.cached_tokens: dict[str, int] = {}  # RequestOutput.num_cached_tokens

    # ---------------------------------------------------------------- access
    @property
    def scheduler(self) -> Any:
        return self.engine.engine_core.engine_core.scheduler

    @property
    def page_manager(self) -> Any:
        """The scheduler's pages over every tensor-parallel rank (``ShardedPageManager``)."""
        return self.scheduler.page_manager

    def rank_pages(self, rank: int = 0) -> Any:
        """One rank's ``PageManager``."""
        return self.scheduler.page_manager.shards[rank]

    def internal_id(self, request_id: str) -> str:
        matches = [rid for rid in self.scheduler.requests if rid.startswith(request_id + "-")]
        assert len(matches) == 1, (request_id, matches)
        return matches[0]

    def on_workers(self, function: Callable[[Any], Any]) -> list[Any]:
        return self.engine.collective_rpc(function)

    # --------------------------------------------------------------- running
    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.add_request(request_id, {"prompt_token_ids": prompt_token_ids}, params)

    def step(self) -> list[Any]:
        outputs = self.engine.step()
        for output in outputs:
            self.outputs[output.request_id] = list(output.outputs[0].token_ids)
            if output.num_cached_tokens is not None:
                self.cached_tokens[output.request_id] = output.num_cached_tokens
            if output.finished:
                self.finished.add(output.request_id)
                self.finish_reasons[output.request_id] = output.outputs[0].finish_reason
        return outputs

    def run_until_done(self, max_steps: int = 100_000) -> dict[str, list[int]]:
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                return self.outputs
            self.step()
        raise AssertionError("engine did not finish")

    def generate(
        self, prompts: dict[str, list[int]], params: SamplingParams
    ) -> dict[str, list[int]]:
        for request_id, token_ids in prompts.items():
            self.add(request_id, token_ids, params)
        self.run_until_done()
        return {request_id: self.outputs[request_id] for request_id in prompts}

    def abort(self, request_ids: Iterable[str]) -> None:
        self.engine.abort_request(list(request_ids))

    def shutdown(self) -> None:
        self.engine.engine_core.shutdown()
        del self.engine
        gc.collect()


def random_prompts(lengths: Iterable[int], seed: int = 0) -> dict[str, list[int]]:
    """Token-id prompts away from special tokens, keyed p0, p1, ..."""
    rng = random.Random(seed)
    return {
        f"p{index}": [rng.randrange(100, 49000) for _ in range(length)]
        for index, length in enumerate(lengths)
    }


def greedy(max_tokens: int, **extra: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def run_vanilla_and_kvcompress(model: str, prompts: dict[str, list[int]], params: SamplingParams,
                               settings: dict,
                               check_started: Callable[[EngineHarness], None] | None = None,
                               **engine_kwargs: Any) -> dict[str, tuple]:
    """The same prompts through a vanilla engine and one with ``settings``: per engine
    (``"vanilla"``, ``"kvcompress"``) the outputs and the preemption count. Afterwards every
    page of the kvcompress engine is free again and its invariants hold. ``check_started``
    runs on the kvcompress engine before any request (e.g. ``assert_default_scoring``)."""
    results = {}
    for name, compression in (("vanilla", None), ("kvcompress", settings)):
        harness = EngineHarness(model, compression, **engine_kwargs)
        try:
            if compression and check_started:
                check_started(harness)
            results[name] = (harness.generate(prompts, params), harness.stats.preemptions)
            if compression:
                manager = harness.page_manager
                # Nothing owned: every page free, or cached for a continuation.
                assert not manager.request_ids()
                assert manager.num_available == manager.total_pages
                manager.check_invariants()
                assert harness.scheduler.kv_cache_manager.usage == 0.0
        finally:
            harness.shutdown()
    return results


def assert_default_scoring(harness: EngineHarness) -> None:
    """``--kv-scoring auto`` resolved as it does by default (reuse on, a surrogate beside the
    model): the surrogate, scored inside the prefill on every rank, no reconstruction pass
    and so no scratch pages. Stress tests call it so that they stress the default."""
    assert harness.scheduler.compression_config.scoring == "surrogate"
    assert harness.page_manager.shards[0].layout.scratch_pages == 0
    runtimes = harness.on_workers(lambda worker: (
        worker.model_runner.paged_runtime.surrogate is not None,
        worker.model_runner.paged_runtime.reconstructor is None))
    assert all(runtime == (True, True) for runtime in runtimes), runtimes
