"""fp8 KV pages with compression on (``--kv-cache-dtype fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``):
with nothing evicted the tokens are vanilla vLLM's at the same ``--kv-cache-dtype`` (its fp8
CPU attention over its own blocks against the same kernel over our per-head fp8 pages, with
the same per-layer scales), through chunked prefill and preemption; with eviction every
(layer, KV head) keeps exactly its budget; every page comes back. Skipped where vLLM's fp8 CPU
attention cannot run (no AVX-512 or AMX)."""

from typing import Any

import pytest
import torch

from kvcompress.attention.cpu_kernel import cpu_supports_fp8_pages
from kvcompress.engine.scoring_memory import reserved_bytes, scored_token_reserve
from kvcompress.policies.decode import rkv

from .harness import EngineHarness, assert_default_scoring, greedy, random_prompts
from .test_compression import (
    BYTES_PER_TOKEN,
    MIXED_REQUESTS,
    TINY,
    assert_heads_grow_by_their_new_tokens,
    assert_holds_policy_budget,
    held_under_decode_budget,
    run_checking_generated_parts,
    step_until_first_token,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not cpu_supports_fp8_pages(),
                       reason="vLLM's fp8 CPU attention needs x86 with AVX-512 or AMX"),
]

NO_EVICTION = {"kv_compression": "pyramidkv", "kv_budget": 100_000}


def fp8_page_setup(worker: Any) -> tuple[str, str]:
    """The worker's pool dtype and the fp8 format its pages decode as."""
    runtime = worker.model_runner.paged_runtime
    return str(runtime.pool.dtype), str(runtime.kernel.page_format.fp8_dtype)


def run_engine(model: str, compression: dict | None, prompts: dict, params: Any,
               default_scoring: bool = False, **engine_kwargs: Any) -> tuple[dict, int]:
    """Outputs and preemptions of one engine; with compression, every page is free again
    afterwards and the page invariants hold (they are also checked after every step)."""
    harness = EngineHarness(model, compression, **engine_kwargs)
    try:
        if compression:
            fp8 = {"fp8": "e4m3fn", "fp8_e4m3": "e4m3fn", "fp8_e5m2": "e5m2"}
            want = f"torch.float8_{fp8[engine_kwargs['kv_cache_dtype']]}"
            assert harness.on_workers(fp8_page_setup) == [("torch.uint8", want)]
            if default_scoring:
                assert_default_scoring(harness)
        outputs = harness.generate(prompts, params)
        if compression:
            manager = harness.page_manager
            assert not manager.request_ids()
            assert manager.num_available == manager.total_pages
            manager.check_invariants()
        return outputs, harness.stats.preemptions
    finally:
        harness.shutdown()


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_tiny_llama_fp8_identical_with_chunked_prefill_and_preemption(surrogate_tiny_llama,
                                                                     cache_dtype):
    # Pools of one byte per element, vanilla's holding ~2100 tokens, ours ~1600 (as in
    # test_identity's fp32 case; the default scoring's reserve, its fp32 score accumulators
    # whatever the pages, comes on top): six 250-token prompts fit but not once they grow by
    # 60, so both engines preempt and recompute.
    prompts = random_prompts([250] * 6 + [700, 37, 5], seed=1)
    common = dict(dtype="float32", kv_cache_dtype=cache_dtype, max_model_len=1536,
                  max_num_batched_tokens=256, max_num_seqs=8)
    vanilla_bytes = 17 * 128 * (4 * 2 * 2 * 32 * 1)  # 17 vLLM blocks of 128 tokens
    reserve = reserved_bytes(scored_token_reserve(1536, 256), 4, 2, 1536, accumulators=1)
    vanilla, vanilla_preemptions = run_engine(surrogate_tiny_llama, None, prompts, greedy(60),
                                              kv_cache_memory_bytes=vanilla_bytes, **common)
    ours, our_preemptions = run_engine(
        surrogate_tiny_llama, {**NO_EVICTION, "kv_admission_lookahead": 0}, prompts,
        greedy(60), default_scoring=True,
        kv_cache_memory_bytes=vanilla_bytes * 3 // 4 + reserve, **common)
    assert vanilla_preemptions > 0 and our_preemptions > 0, "the pool was meant to be too small"
    assert ours == vanilla


def test_embedded_model_fp8_identical_on_mixed_lengths(embedded_model):
    """The real SmolLM2-135M (head size 64) on fp8 pages of 32 tokens against vanilla's fp8
    blocks: chunked prefill of the 1500-token prompt, nothing evicted."""
    prompts = random_prompts([3, 90, 400, 1500, 30], seed=2)
    common = dict(dtype="float32", kv_cache_dtype="fp8", max_model_len=2048,
                  max_num_batched_tokens=512, max_num_seqs=8, kv_cache_memory_bytes=128 << 20)
    vanilla, _ = run_engine(embedded_model, None, prompts, greedy(24), **common)
    ours, _ = run_engine(embedded_model, NO_EVICTION, prompts, greedy(24), **common)
    assert ours == vanilla


@pytest.mark.parametrize("scoring", ["window", "hybrid", "expected"])
def test_fp8_pages_hold_exactly_each_policy_budget(tiny_llama, scoring, request):
    """Every method of test_compression's mix, scored from fp8 keys (by the window, by the
    window and a reconstruction pass, or by the query profile with each layer's K scale),
    keeps exactly its budget per (layer, KV head) in whole 32-token pages; two decode steps
    grow every head by one token each; all pages return."""
    window, page, layers, heads = 8, 32, 4, 2
    if scoring == "expected":
        request.getfixturevalue("profiled_tiny_llama")  # its profile beside it
    engine = {"kv_compression": "pyramidkv", "kv_budget": 48, "kv_window": window,
              "kv_scoring": scoring}
    harness = EngineHarness(
        tiny_llama, engine,
        kv_cache_dtype="fp8", kv_cache_memory_bytes=8192 * BYTES_PER_TOKEN, **TINY,
    )
    try:
        assert harness.on_workers(fp8_page_setup) == [("torch.uint8", "torch.float8_e4m3fn")]
        if scoring == "expected":  # the layers' K scales (vLLM's default 1.0 here)
            assert harness.on_workers(lambda worker: worker.model_runner.paged_runtime
                                      .expected_scorer.key_scales) == [(1.0,) * layers]
        prompts = {}
        for offset, (name, (overrides, length)) in enumerate(MIXED_REQUESTS.items()):
            prompts[name] = random_prompts([length], seed=30 + offset)["p0"]
            harness.add(name, prompts[name], greedy(40, extra_args=dict(overrides)))
        step_until_first_token(harness, prompts)
        manager = harness.rank_pages()
        for name, (overrides, length) in MIXED_REQUESTS.items():
            since = len(harness.outputs[name]) - 1
            assert_holds_policy_budget(manager, harness.internal_id(name), name, overrides,
                                       length, since, window, page, layers, heads, engine)
        assert_heads_grow_by_their_new_tokens(harness, manager, prompts)
        harness.run_until_done()
        assert manager.num_available == manager.total_pages
    finally:
        harness.shutdown()


@pytest.mark.parametrize("policy", ["window", "h2o", "snapkv", "rkv", "anchors"])
def test_fp8_decode_budget_bounds_the_cache(tiny_llama, policy, monkeypatch):
    """Every decode policy over e5m2 pages (decode scores from fp8 keys; rkv's key
    similarities from the keys its pages decode to, not their byte codes): every head holds
    exactly the generated tokens test_compression's unquantized case holds, at every step."""
    budget, interval, window, tokens = 24, 8, 8, 120
    ranked_key_dtypes = set()  # what rkv's redundancy term is computed on
    original_ranking = rkv.importance_minus_redundancy

    def recording_ranking(scores, keys, recent):
        ranked_key_dtypes.add(keys.dtype)
        return original_ranking(scores, keys, recent)

    monkeypatch.setattr(rkv, "importance_minus_redundancy", recording_ranking)
    harness = EngineHarness(
        tiny_llama,
        {"kv_compression": "snapkv", "kv_budget": 48, "kv_window": window,
         "kv_decode_policy": policy, "kv_decode_budget": budget,
         "kv_decode_interval": interval},
        kv_cache_dtype="fp8_e5m2", kv_cache_memory_bytes=4096 * BYTES_PER_TOKEN, **TINY,
    )
    try:
        assert harness.on_workers(fp8_page_setup) == [("torch.uint8", "torch.float8_e5m2")]
        harness.add("long", random_prompts([200], seed=9)["p0"], greedy(tokens))
        harness.add("short", random_prompts([30], seed=10)["p0"], greedy(tokens))
        history = run_checking_generated_parts(harness, ["long", "short"], tokens)
        for name, steps in history.items():
            for held, in_cache, _ in steps:
                want = held_under_decode_budget(in_cache, budget, interval)
                assert held == want, (name, held, in_cache)
            assert max(held for held, _, _ in steps) == budget + interval - 1
    finally:
        harness.shutdown()
    if policy == "rkv":
        assert ranked_key_dtypes == {torch.float32}, ranked_key_dtypes
