"""Every model the tests run gets its score surrogate from the command, and the default
scoring uses it (issue 52, item 4): Qwen2 (q/k/v biases), Qwen3 (q/k norms), Gemma 3 with
sliding-window layers (tiny, and the real 270M), each profiled into the user's cache and
started with the defaults (``--kv-scoring auto``, reuse on), which resolve to that surrogate.
The embedded SmolLM2 (set-up makes its surrogate) and tiny Llama (conftest's
``surrogate_tiny_llama``) run with theirs in the other engine tests."""

from __future__ import annotations

import pytest

from .harness import EngineHarness, assert_default_scoring, greedy, random_prompts

pytestmark = pytest.mark.slow

ENGINE = dict(dtype="float32", max_model_len=2048, max_num_batched_tokens=256, max_num_seqs=4,
              kv_cache_memory_bytes=64 << 20)


@pytest.mark.parametrize("model_name", ["tiny_qwen2", "tiny_qwen3", "tiny_gemma3",
                                        "gemma3_270m"])
def test_each_model_gets_a_surrogate_that_auto_scores_with(model_name, request, tmp_path,
                                                            monkeypatch):
    from kvcompress.profile_model import store
    from kvcompress.profile_model.command import main as profile_main
    from kvcompress.profile_model.surrogates import load_surrogate

    monkeypatch.setenv(store.CACHE_ENV, str(tmp_path))  # this test's cache alone
    model = request.getfixturevalue(model_name)
    folder = store.model_folder(model)
    assert folder is not None
    surrogate_path = store.cached_path("surrogate", folder)
    assert profile_main([model, "--out", str(store.cached_path("profile", folder)),
                         "--surrogate-out", str(surrogate_path), "--documents", "1",
                         "--surrogate-prompts", "1", "--held-out", "1", "--min-overlap", "0",
                         "--device", "cpu"]) == 0
    surrogate = load_surrogate(surrogate_path, folder)
    assert {"synthetic.overlap_4x", "prose.overlap_4x", "code.overlap_4x",
            "chat.overlap_4x"} <= set(surrogate.quality)

    harness = EngineHarness(model, {"kv_compression": "pyramidkv", "kv_compression_ratio": 0.5},
                            **ENGINE)
    try:
        assert_default_scoring(harness)
        assert harness.scheduler.compression_config.surrogate == str(surrogate_path)
        manager = harness.rank_pages()
        rows = manager.layout.compressed_rows
        prompt_len = 600
        harness.add("r", random_prompts([prompt_len], seed=52)["p0"], greedy(8))
        internal, kept = harness.internal_id("r"), None
        while harness.engine.has_unfinished_requests():
            harness.step()
            if internal in manager and manager._requests[internal].logical_len > prompt_len:
                kept = manager.physical_lengths(internal)[rows]
        # Half of each compressed row's prompt went (the decode tokens stay).
        assert kept is not None and kept.sum() <= len(kept) * (prompt_len // 2 + 16), kept
        assert len(harness.outputs["r"]) == 8
        assert manager.num_available == manager.total_pages
        manager.check_invariants()
    finally:
        harness.shutdown()
