"""Memory pressure with every scoring: a pool too small for the requests' growth, prompts
longer than the budget, admission as vLLM does it (no growth reserved) so that running
requests are preempted and recomputed. Whatever scores the prompts (and whatever it reserves:
a second accumulator, reconstruction scratch), the page invariants hold after every step,
every request finishes and every page comes back."""

import pytest

from .harness import EngineHarness, greedy, random_prompts

pytestmark = pytest.mark.slow

BYTES_PER_TOKEN = 4 * 2 * 2 * 32 * 4  # tiny_llama, fp32: 4 layers x 2 KV heads x K/V x 32
ENGINE = dict(dtype="float32", max_model_len=1024, max_num_batched_tokens=256,
              max_num_seqs=8, kv_cache_memory_bytes=14 * 128 * BYTES_PER_TOKEN)
NEW_TOKENS = 150
# The fixture whose model each scoring needs: a surrogate beside it, or a query profile.
MODEL_FIXTURE = {"window": "tiny_llama", "surrogate": "surrogate_tiny_llama",
                 "hybrid-surrogate": "surrogate_tiny_llama", "reconstruct": "tiny_llama",
                 "hybrid": "tiny_llama", "expected": "profiled_tiny_llama"}


def scorers(worker) -> tuple[bool, bool, bool]:
    """Which scorers a worker's runtime holds: surrogate, reconstructor, query profile."""
    runtime = worker.model_runner.paged_runtime
    return (runtime.surrogate is not None, runtime.reconstructor is not None,
            runtime.expected_scorer is not None)


@pytest.mark.parametrize("scoring", list(MODEL_FIXTURE))
def test_every_scoring_under_memory_pressure_finishes_and_frees_every_page(scoring, request):
    model = request.getfixturevalue(MODEL_FIXTURE[scoring])
    harness = EngineHarness(model, {"kv_compression": "snapkv", "kv_budget": 64,
                                    "kv_admission_lookahead": 0, "kv_scoring": scoring},
                            **ENGINE)
    try:
        # The scoring asked for is the one that runs (not a window fallback).
        (held,) = harness.on_workers(scorers)
        assert held == ("surrogate" in scoring, scoring in ("reconstruct", "hybrid"),
                        scoring == "expected"), held
        manager = harness.page_manager
        # 10 prompts of 300-660 tokens, compressed to 64 per row, then 150 new tokens each:
        # about 2100 tokens once grown, in a pool of about 1200.
        prompts = random_prompts([300 + 40 * number for number in range(10)], seed=12)
        for request_id, token_ids in prompts.items():
            harness.add(request_id, token_ids, greedy(NEW_TOKENS))
        for _ in range(20_000):
            if not harness.engine.has_unfinished_requests():
                break
            harness.step()
            harness.scheduler.check_pages()  # also after every step (KVCOMPRESS_CHECK_PAGES)
        assert not harness.engine.has_unfinished_requests()
        assert all(len(harness.outputs[name]) == NEW_TOKENS for name in prompts)
        assert set(harness.finish_reasons.values()) == {"length"}
        assert harness.stats.preemptions > 0, "the pool was meant to force preemptions"
        assert harness.scheduler.num_pages_freed_by_compression > 0
        assert not manager.request_ids() and manager.num_available == manager.total_pages
        manager.check_invariants()
    finally:
        harness.shutdown()
