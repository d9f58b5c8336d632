"""Score memory end to end: reserved out of the KV memory, and never more held at once than
reserved, with several prompts at max_model_len scored together."""

import pytest

from kvcompress.attention.reconstruction_scores import (
    MIN_SCORING_WORKSPACE_BYTES,
    scoring_workspace_bytes,
)
from kvcompress.engine.scoring_memory import (
    reconstruction_tokens,
    reserved_bytes,
    scored_token_reserve,
)

from .harness import EngineHarness, assert_default_scoring, greedy, random_prompts

pytestmark = pytest.mark.slow

BYTES_PER_TOKEN = 4 * 2 * 2 * 32 * 4  # tiny_llama, fp32: 4 layers x 2 KV heads x K/V x 32
MAX_MODEL_LEN, BATCHED = 512, 64


# The default (auto: the surrogate beside the model) holds its accumulator from a prompt's
# first chunk on; window scoring from its window on (kept: the reserve's other path, that of
# models without a surrogate).
@pytest.mark.parametrize("scoring", ["default", "window"])
def test_prompts_at_max_model_len_are_scored_within_the_reserve(scoring, request):
    memory = 8 * MAX_MODEL_LEN * BYTES_PER_TOKEN
    default = scoring == "default"
    model = request.getfixturevalue("surrogate_tiny_llama" if default else "tiny_llama")
    harness = EngineHarness(
        model, {"kv_compression": "snapkv", "kv_budget": 64, "kv_window": 32,
                **({} if default else {"kv_scoring": "window"})},
        dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=BATCHED,
        # 16 tokens per request and step: four prefills advance together and reach their
        # observation windows in the same steps.
        long_prefill_token_threshold=16, max_num_seqs=8, kv_cache_memory_bytes=memory,
    )
    try:
        if default:
            assert_default_scoring(harness)
        reserve = scored_token_reserve(MAX_MODEL_LEN, BATCHED)
        manager = harness.page_manager
        page_bytes = manager.layout.page_bytes
        accumulators = 1
        reserved = reserved_bytes(reserve, 4, 2, MAX_MODEL_LEN, accumulators=accumulators)
        assert manager.total_pages == (memory - reserved) // page_bytes

        prompts = random_prompts([MAX_MODEL_LEN - 2] * 4, seed=21)
        # two tokens: a request ending in its prefill step is neither scored nor compacted
        outputs = harness.generate(prompts, greedy(2))
        assert all(len(tokens) == 2 for tokens in outputs.values())
        assert all(reason == "length" for reason in harness.finish_reasons.values())
        gate = harness.scheduler.scoring_gate
        assert gate.deferred_chunks > 0, "four prompts at once were meant to exceed the reserve"
        assert 0 < gate.peak_tokens <= reserve
        (held,) = harness.on_workers(
            lambda worker: worker.model_runner.paged_runtime.state.peak_scored_tokens
        )
        # key slots held over every accumulator (hybrid scorings hold two per prompt)
        assert 0 < held <= reserve * accumulators
        assert harness.scheduler.num_pages_freed_by_compression > 0
        assert not gate.scoring and gate.tokens_in_flight == 0
        assert manager.num_available == manager.total_pages
    finally:
        harness.shutdown()


def test_reconstruction_scratch_pages_come_out_of_the_kv_memory(tiny_llama):
    """--kv-scoring reconstruct: scratch pages for one pass per row are reserved besides the
    score reserve; prompts scored at once by passes never hold more accumulators than
    reserved, and every page comes back."""
    memory = 8 * MAX_MODEL_LEN * BYTES_PER_TOKEN
    harness = EngineHarness(
        tiny_llama, {"kv_compression": "snapkv", "kv_budget": 64, "kv_reconstruct_chunk": 48,
                     "kv_scoring": "reconstruct"},
        dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=BATCHED,
        long_prefill_token_threshold=16, max_num_seqs=8, kv_cache_memory_bytes=memory,
    )
    try:
        manager = harness.page_manager
        layout = manager.layout
        page_bytes = layout.page_bytes
        # a pass (its chunk capped so that it fits 64 batched tokens) in every row
        per_row = -(-reconstruction_tokens(48, BATCHED) // layout.page_size)
        assert layout.scratch_pages == 4 * 2 * per_row
        # two accumulators per scored prompt (hybrid scoring keeps its window's apart), and
        # a pass's scoring workspace (tiny_llama: 4 query heads, 2 KV heads of 32), at most a
        # sixteenth of the memory
        workspace = max(MIN_SCORING_WORKSPACE_BYTES, min(memory // 16, scoring_workspace_bytes(
            4, 2, 32, reconstruction_tokens(48, BATCHED), MAX_MODEL_LEN)))
        reserved = reserved_bytes(scored_token_reserve(MAX_MODEL_LEN, BATCHED), 4, 2,
                                  MAX_MODEL_LEN, accumulators=2, scoring_workspace=workspace
                                  ) + layout.scratch_pages * page_bytes
        assert manager.total_pages == (memory - reserved) // page_bytes
        outputs = harness.generate(random_prompts([MAX_MODEL_LEN - 2] * 4, seed=21), greedy(2))
        assert all(len(tokens) == 2 for tokens in outputs.values())
        (held,) = harness.on_workers(
            lambda worker: worker.model_runner.paged_runtime.state.peak_scored_tokens
        )
        assert 0 < held <= scored_token_reserve(MAX_MODEL_LEN, BATCHED)
        assert harness.scheduler.num_pages_freed_by_compression > 0
        assert manager.num_available == manager.total_pages
    finally:
        harness.shutdown()
