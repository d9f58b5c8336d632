"""Sliding-window layers (Gemma 3 style: 3 sliding + 1 full, twice): with nothing evicted the
tokens are vanilla vLLM's exactly, through chunked prefill, preemption and long decodes; the
pages of tokens that left a layer's window come back to the pool as the request runs; with
compression on, only full-attention rows are compressed, by the policy's budgets."""

import pytest
import requests

from tests.e2e.serving import client, long_question, metric, running_server

from .harness import EngineHarness, greedy, random_prompts, run_vanilla_and_kvcompress

pytestmark = pytest.mark.slow

NO_EVICTION = {"kv_compression": "pyramidkv", "kv_budget": 100_000}
PAGE = 16
WINDOW = 32  # tiny_gemma3's sliding window
ENGINE = dict(dtype="float32", max_model_len=1024, max_num_batched_tokens=64, max_num_seqs=4)


def run_both(model, prompts, params, settings=NO_EVICTION, **engine_kwargs):
    return run_vanilla_and_kvcompress(model, prompts, params, settings, **engine_kwargs)


def test_tiny_gemma3_identical_to_vanilla_with_chunked_prefill(tiny_gemma3):
    # Prompts far longer than the window, prefilled in 64-token chunks: every chunk after
    # the first drops pages mid-prefill, and 48 decode steps drop more.
    prompts = random_prompts([400, 150, 33, 5], seed=11)
    results = run_both(tiny_gemma3, prompts, greedy(48), **ENGINE,
                       kv_cache_memory_bytes=16 << 20)
    assert results["kvcompress"][0] == results["vanilla"][0]


def test_tiny_gemma3_identical_under_preemption(tiny_gemma3):
    # Eight 100-token prompts growing by 100 tokens each in a pool far too small for all of
    # them: both engines preempt and recompute; kvcompress admits like vLLM here (no
    # lookahead). A resumed request's sliding rows start again from position 0.
    prompts = random_prompts([100] * 8, seed=12)
    results = run_both(tiny_gemma3, prompts, greedy(100),
                       {**NO_EVICTION, "kv_admission_lookahead": 0},
                       **(ENGINE | dict(max_num_seqs=8, max_model_len=512)),
                       kv_cache_memory_bytes=1835008)
    assert results["vanilla"][1] > 0 and results["kvcompress"][1] > 0, "meant to preempt"
    assert results["kvcompress"][0] == results["vanilla"][0]


def test_sliding_rows_hold_only_their_window(tiny_gemma3):
    """After prefill and while decoding, a sliding row holds its W - 1 newest tokens plus
    less than a page of slack (and the step's new token); full rows hold everything."""
    harness = EngineHarness(tiny_gemma3, NO_EVICTION, **ENGINE, kv_cache_memory_bytes=16 << 20)
    try:
        layout = harness.page_manager.layout
        sliding = layout.row_windows > 0
        assert sliding.sum() == 6 * layout.num_kv_heads and layout.compressed_layers == (3, 7)
        prompt_len = 300
        harness.add("r", random_prompts([prompt_len], seed=13)["p0"], greedy(40))
        manager, internal = harness.rank_pages(), harness.internal_id("r")
        seen_decode = 0
        while harness.engine.has_unfinished_requests():
            harness.step()
            if internal not in manager:
                continue
            lengths = manager.physical_lengths(internal)
            logical = manager._requests[internal].logical_len
            assert (lengths[~sliding] == logical).all()
            assert (lengths[sliding] <= WINDOW - 1 + PAGE - 1 + ENGINE["max_num_batched_tokens"]
                    ).all()
            if logical > prompt_len:
                seen_decode += 1
                assert (lengths[sliding] <= WINDOW - 1 + PAGE).all(), lengths[sliding]
                pages = manager.owned_pages(internal)
                full_pages = -(-logical // PAGE) * (~sliding).sum()
                assert pages <= full_pages + sliding.sum() * (-(-(WINDOW + PAGE) // PAGE))
        assert seen_decode > 30
        assert harness.scheduler.kv_cache_manager.window_freed_pages > 0
        assert harness.stats.window_freed_pages > 0
        assert manager.num_available == manager.total_pages
    finally:
        harness.shutdown()


def test_compression_touches_only_full_attention_rows(tiny_gemma3):
    """Budget 64 on 300-token prompts: the two full-attention layers keep PyramidKV's
    budgets over themselves (sum 2 x 64 per head); sliding rows keep their window."""
    settings = {"kv_compression": "pyramidkv", "kv_budget": 64}
    harness = EngineHarness(tiny_gemma3, settings, **ENGINE, kv_cache_memory_bytes=16 << 20)
    try:
        layout = harness.page_manager.layout
        heads = layout.num_kv_heads
        prompts = random_prompts([300, 280], seed=14)
        for name, tokens in prompts.items():
            harness.add(name, tokens, greedy(20))
        internal_ids = {name: harness.internal_id(name) for name in prompts}
        manager = harness.rank_pages()
        checked = 0
        while harness.engine.has_unfinished_requests():
            harness.step()
            for name, tokens in prompts.items():
                internal = internal_ids[name]
                if internal not in manager:
                    continue
                state = manager._requests[internal]
                generated = state.logical_len - len(tokens)
                if generated < 2:
                    continue
                lengths = manager.physical_lengths(internal).reshape(layout.num_layers, heads)
                full = lengths[list(layout.compressed_layers)] - generated
                # The policy's budgets over the compressed layers only: 64 per layer on
                # average, PyramidKV's slope between them.
                assert full.sum() == 64 * len(layout.compressed_layers) * heads
                assert (full[0] >= full[1]).all()
                sliding_rows = [layer for layer in range(layout.num_layers)
                                if layer not in layout.compressed_layers]
                assert (lengths[sliding_rows] <= WINDOW - 1 + PAGE).all()
                checked += 1
        assert checked > 10
        assert manager.num_available == manager.total_pages
    finally:
        harness.shutdown()


@pytest.mark.parametrize("policy", ["h2o", "window"])
def test_decode_budget_with_sliding_layers(tiny_gemma3, policy):
    """A decode budget bounds the full-attention rows; sliding rows bound themselves and are
    neither scored nor evicted by the decode policy."""
    settings = {"kv_compression": "pyramidkv", "kv_budget": 64, "kv_decode_policy": policy,
                "kv_decode_budget": 24, "kv_decode_interval": 8}
    harness = EngineHarness(tiny_gemma3, settings, **ENGINE, kv_cache_memory_bytes=16 << 20)
    try:
        layout = harness.page_manager.layout
        rows = layout.compressed_rows
        sliding = layout.row_windows > 0
        prompt_len = 200
        harness.add("r", random_prompts([prompt_len], seed=15)["p0"], greedy(120))
        manager, internal = harness.rank_pages(), harness.internal_id("r")
        prompt_part, evictions = None, 0
        while harness.engine.has_unfinished_requests():
            harness.step()
            if internal not in manager:
                continue
            lengths = manager.physical_lengths(internal)
            generated = manager._requests[internal].logical_len - prompt_len
            if generated < 1:
                continue
            if prompt_part is None:  # the compressed prompt, then one generated token
                prompt_part = lengths[rows] - generated
                assert prompt_part.max() < prompt_len
            held = lengths[rows] - prompt_part
            assert (held == held[0]).all() and held[0] <= 24 + 8
            evictions += held[0] < min(generated, 24 + 8)
            assert (lengths[sliding] <= WINDOW - 1 + PAGE).all()
        assert evictions > 0
        assert manager.num_available == manager.total_pages
    finally:
        harness.shutdown()


# ------------------------------------------------------------ the real Gemma 3 270M
GEMMA3_WINDOW = 512
GEMMA3 = dict(dtype="float32", max_model_len=2048, max_num_batched_tokens=256, max_num_seqs=4,
              kv_cache_memory_bytes=256 << 20)


def test_gemma3_270m_identical_to_vanilla_beyond_its_window(gemma3_270m):
    """Prompts longer than the 512-token window, prefilled in 256-token chunks, and 32
    decode steps: nothing is evicted by the policy, the sliding layers drop what left their
    window, and the tokens are vanilla vLLM's exactly."""
    prompts = random_prompts([1000, 600, 40], seed=21)
    results = run_both(gemma3_270m, prompts, greedy(32), **GEMMA3)
    assert results["kvcompress"][0] == results["vanilla"][0]


def test_gemma3_270m_compression_saves_pages(gemma3_270m):
    """PyramidKV at budget 128 over the 3 full-attention layers; the 15 sliding layers keep
    their window. Pages held after the prompt: far fewer than the uncompressed rows need."""
    harness = EngineHarness(gemma3_270m, {"kv_compression": "pyramidkv", "kv_budget": 128},
                            **GEMMA3)
    try:
        manager = harness.rank_pages()
        layout = manager.layout
        assert layout.compressed_layers == (5, 11, 17) and layout.num_kv_heads == 1
        prompt_len = 1500
        harness.add("r", random_prompts([prompt_len], seed=22)["p0"], greedy(8))
        internal = harness.internal_id("r")
        held = None
        while harness.engine.has_unfinished_requests():
            harness.step()
            if internal in manager and manager._requests[internal].logical_len > prompt_len:
                lengths = manager.physical_lengths(internal)
                generated = manager._requests[internal].logical_len - prompt_len
                compressed = lengths[layout.compressed_rows] - generated
                assert compressed.sum() == 128 * 3
                assert (lengths[layout.row_windows > 0] <= GEMMA3_WINDOW - 1 + 16).all()
                held = manager.owned_pages(internal)
        uncompressed = layout.pages_for_tokens(prompt_len)
        assert held is not None and held * 3 < uncompressed, (held, uncompressed)
        assert manager.num_available == manager.total_pages
    finally:
        harness.shutdown()


def test_gemma3_270m_served_with_pyramidkv_over_http(gemma3_270m, tmp_path):
    flags = ("--kv-compression", "pyramidkv", "--kv-budget", "64")
    with running_server(gemma3_270m, tmp_path, *flags) as (base, _):
        reply = client(base).completions.create(
            model=gemma3_270m, prompt=long_question(), max_tokens=16, temperature=0)
        assert reply.choices[0].text.strip()
        assert reply.usage.prompt_tokens > GEMMA3_WINDOW
        text = requests.get(f"{base}/metrics", timeout=10).text
        assert metric(text, "kvcompress:compressed_requests_total") >= 1
        assert metric(text, "kvcompress:evicted_tokens_total", phase="prompt") > 0
        assert metric(text, "kvcompress:window_freed_pages_total") > 0
        assert metric(text, "kvcompress:failed_requests_total") == 0


def test_mistral_style_all_sliding_identical_and_bounded(tiny_mistral_sliding):
    """Every layer slides (Mistral-7B-v0.1 style): no layer for a policy to compress, so
    compression on means only the lossless window drops; tokens are vanilla's exactly and
    every row stays within its window."""
    prompts = random_prompts([300, 90, 12], seed=16)
    settings = {"kv_compression": "pyramidkv", "kv_budget": 16}
    results = run_both(tiny_mistral_sliding, prompts, greedy(40), settings, **ENGINE,
                       kv_cache_memory_bytes=16 << 20)
    assert results["kvcompress"][0] == results["vanilla"][0]
    harness = EngineHarness(tiny_mistral_sliding, settings, **ENGINE,
                            kv_cache_memory_bytes=16 << 20)
    try:
        layout = harness.page_manager.layout
        assert layout.compressed_layers == () and (layout.row_windows == WINDOW).all()
        harness.add("r", prompts["p0"], greedy(20))
        manager, internal = harness.rank_pages(), harness.internal_id("r")
        while harness.engine.has_unfinished_requests():
            harness.step()
            if internal in manager and manager._requests[internal].logical_len > 300:
                assert (manager.physical_lengths(internal) <= WINDOW - 1 + PAGE).all()
        assert harness.stats.window_freed_pages > 0
    finally:
        harness.shutdown()
