"""With a budget larger than every prompt, outputs are token-identical to vanilla vLLM,
through chunked prefill and preemption, and every page comes back."""

import pytest
import torch

from .harness import (
    EngineHarness,
    assert_default_scoring,
    greedy,
    random_prompts,
    run_vanilla_and_kvcompress,
)

pytestmark = pytest.mark.slow

NO_EVICTION = {"kv_compression": "pyramidkv", "kv_budget": 100_000}


def run_both(model, prompts, params, settings=NO_EVICTION, check_started=None,
             **engine_kwargs):
    return run_vanilla_and_kvcompress(model, prompts, params, settings, check_started,
                                      **engine_kwargs)


def test_tiny_llama_identical_with_chunked_prefill_and_preemption(surrogate_tiny_llama):
    # The 700-token prompt exceeds max_num_batched_tokens (chunked prefill). The KV memory
    # holds ~2100 tokens (kvcompress: ~1600, the rest is its score reserve): six
    # 250-token prompts fit, but not once each grows by 60 tokens besides the longer ones,
    # so decoding forces preemptions (and recomputation) in both engines: kvcompress admits
    # like vLLM here (no lookahead), which would otherwise hold prompts back instead. The
    # default scoring (the surrogate: the model has one) with its score accumulators
    # reserved; nothing is evicted, so nothing it scores may change a token.
    prompts = random_prompts([250] * 6 + [700, 37, 5], seed=1)
    results = run_both(
        surrogate_tiny_llama, prompts, greedy(60),
        {**NO_EVICTION, "kv_admission_lookahead": 0}, assert_default_scoring,
        dtype="float32", max_model_len=1536, max_num_batched_tokens=256, max_num_seqs=8,
        kv_cache_memory_bytes=17 * 128 * (4 * 2 * 2 * 32 * 4),  # 17 vLLM blocks of 128
    )
    vanilla, vanilla_preemptions = results["vanilla"]
    ours, our_preemptions = results["kvcompress"]
    assert vanilla_preemptions > 0 and our_preemptions > 0, "the pool was meant to be too small"
    assert ours == vanilla


def test_embedded_model_identical_on_mixed_lengths(embedded_model):
    prompts = random_prompts([3, 90, 400, 1500, 30], seed=2)
    results = run_both(
        embedded_model, prompts, greedy(24),
        dtype="float32", max_model_len=2048, max_num_batched_tokens=512, max_num_seqs=8,
        kv_cache_memory_bytes=256 << 20,
    )
    assert results["kvcompress"][0] == results["vanilla"][0]


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                    reason="this CPU has no AMX tiles (vLLM's amx attention ISA)")
def test_embedded_model_identical_in_bf16_on_amx_pages(embedded_model):
    """bf16 on a CPU with AMX: vanilla runs vLLM's amx attention over its 128-token blocks, we
    run it over 32-token per-head pages in its tile layout (the default page size there)."""
    prompts = random_prompts([3, 90, 400, 1500, 30], seed=2)
    engine_kwargs = dict(dtype="bfloat16", max_model_len=2048, max_num_batched_tokens=512,
                         max_num_seqs=8, kv_cache_memory_bytes=256 << 20)
    results = run_both(embedded_model, prompts, greedy(24), **engine_kwargs)
    assert results["kvcompress"][0] == results["vanilla"][0]
    harness = EngineHarness(embedded_model, NO_EVICTION, **engine_kwargs)
    try:
        assert harness.page_manager.layout.page_size == 32
        isas = harness.on_workers(lambda worker: worker.model_runner.paged_runtime.kernel.isa)
        assert isas == ["amx"]
    finally:
        harness.shutdown()


@pytest.mark.parametrize("model_fixture",
                         ["tiny_qwen2", "tiny_qwen3", "tiny_gemma2", "tiny_gpt_oss"])
def test_tiny_model_identical_with_chunked_prefill(model_fixture, request):
    """Attention that differs from Llama's: Qwen2's q/k/v biases, Qwen3's per-head q/k norms,
    Gemma 2's soft-capped logits, gpt-oss's attention sinks (every layer full attention). The
    300-token prompt is prefilled in chunks; nothing is evicted, so the tokens must be
    vanilla's exactly."""
    prompts = random_prompts([300, 64, 7], seed=3)
    results = run_both(
        request.getfixturevalue(model_fixture), prompts, greedy(16),
        dtype="float32", max_model_len=512, max_num_batched_tokens=128, max_num_seqs=4,
        kv_cache_memory_bytes=16 << 20,
    )
    assert results["kvcompress"][0] == results["vanilla"][0]
