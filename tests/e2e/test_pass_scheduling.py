"""Reconstruction passes as scheduled work (``engine.pass_schedule``) on a real engine:
while a long prompt's passes run, every decoding request still gets its token each step,
and no step runs more than the token budget (beyond one chunk run alone)."""

from __future__ import annotations

import pytest

from .harness import EngineHarness, greedy, random_prompts

pytestmark = pytest.mark.slow

BUDGET = 256  # --max-num-batched-tokens
CHUNK = 96  # --kv-reconstruct-chunk: a pass is this plus the instruction's tokens


def test_decodes_keep_their_pace_while_a_long_prompt_is_reconstructed(tiny_llama):
    harness = EngineHarness(
        tiny_llama,
        {"kv_compression": "pyramidkv", "kv_budget": 64, "kv_scoring": "reconstruct",
         "kv_reconstruct_chunk": CHUNK},
        dtype="float32", max_model_len=2048, max_num_batched_tokens=BUDGET,
        enable_prefix_caching=True, kv_cache_memory_bytes=1 << 26)
    scheduler = harness.scheduler
    steps = []  # per step: (scheduled tokens, pass tokens, chunks, parked, scheduled ids)
    grant = scheduler.passes.grant

    def recording_grant(budget):
        parked = scheduler.passes.parked()  # (those whose last chunk is granted rest too)
        passes = grant(budget)
        steps[-1][1:4] = [passes.tokens, sum(passes.grants.values()), parked]
        return passes

    scheduler.passes.grant = recording_grant
    schedule = scheduler.schedule

    def recording_schedule(*args, **kwargs):
        steps.append([0, 0, 0, frozenset(), set()])
        output = schedule(*args, **kwargs)
        steps[-1][0] = output.total_num_scheduled_tokens
        steps[-1][4] = set(output.num_scheduled_tokens)
        return output

    scheduler.schedule = recording_schedule
    try:
        short = random_prompts([40] * 4, seed=1)  # under --kv-min-prompt: no passes
        for request_id, prompt in short.items():
            harness.add(request_id, prompt, greedy(60))
        for _ in range(3):
            harness.step()
        long_prompt = random_prompts([1500], seed=2)["p0"]
        harness.add("long", long_prompt, greedy(8))
        harness.run_until_done()
        pass_steps = [step for step in steps if step[2]]
        # 1500 tokens in chunks of at most 96 (fewer where a pass would count more than the
        # budget), spread over steps.
        assert sum(step[2] for step in pass_steps) >= -(-1500 // CHUNK)
        assert len(pass_steps) >= 4, [step[:3] for step in steps]
        for scheduled, pass_tokens, chunks, parked, ids in pass_steps:
            assert scheduled + pass_tokens <= BUDGET or chunks == 1, (scheduled, pass_tokens)
            # The long request waits (parked, not scheduled); all four short ones decode
            # (they need 60 steps; the passes end long before).
            assert len(parked) == 1 and not parked & ids
            assert sum(1 for request_id in ids if request_id.startswith("p")) == 4, ids
        assert all(len(harness.outputs[request_id]) == 60 for request_id in short)
        assert len(harness.outputs["long"]) == 8
        assert scheduler.num_pages_freed_by_compression > 0  # compacted after its passes
        manager = harness.page_manager
        assert not manager.request_ids()
        manager.check_invariants()
    finally:
        harness.shutdown()
