"""The embedded SmolLM2 with a decode budget of 128, `--max-model-len 1024` and 38 MB of KV
memory (vLLM makes 1536 bf16 tokens of it), ~50-token prompts that are never compressed.

Every decode policy was refused at start: 630 pages of reconstruction scratch under the old
default scoring, and decode-score accumulators reserved for max_num_seqs requests though the
pool runs ~60 at most. Then the default (the surrogate) reserved no scratch and decode scores
were reserved only for requests the pool can run, but those still left fewer pages than one
request of max_model_len needs (5760): the start was refused, naming the --max-num-seqs that
fits. Now the reserve shrinks to the requests that leave room for that one request, and the
scheduler runs no more at once: every decode policy starts as it was configured."""

import pytest

from .harness import EngineHarness, assert_default_scoring, greedy, random_prompts

pytestmark = pytest.mark.slow

SMALL_POOL = dict(max_model_len=1024, kv_cache_memory_bytes=38_000_000)
# h2o: a scoring decode policy reserves decode scores (window reserves none).
COMPRESSION = {"kv_compression": "pyramidkv", "kv_decode_budget": 128,
               "kv_decode_policy": "h2o"}
# The running requests a 38 MB pool reserves decode scores for, beside one max_model_len
# request (h2o; explicit hybrid also reserves reconstruction scratch). The start was refused
# above these (an --max-num-seqs this large was named as the fix).
# By page size: 16 tokens (vec pages), 32 (AMX pages: bf16 on a CPU with AMX tiles), where
# rounding each row up to whole pages leaves fewer requests room (measured on each).
FITS_DEFAULT, FITS_HYBRID = {16: 50, 32: 34}, 18
# Long enough for one decode eviction (budget 128 + the default interval of 64).
NEW_TOKENS = 200


def page_size(harness: EngineHarness) -> int:
    return harness.page_manager.shards[0].layout.page_size


def running_cap(harness: EngineHarness) -> int:
    """The decode scores reserved, and the running requests the scheduler allows: equal."""
    layout = harness.page_manager.shards[0].layout
    assert harness.scheduler.max_num_running_reqs == layout.decode_score_requests
    assert harness.scheduler.max_num_active_reqs <= layout.decode_score_requests
    layout.check_holds_one_request(SMALL_POOL["max_model_len"])
    return layout.decode_score_requests


def run_two_short_prompts(harness: EngineHarness) -> None:
    outputs = harness.generate(random_prompts([50, 54], seed=38), greedy(NEW_TOKENS))
    assert all(len(tokens) == NEW_TOKENS for tokens in outputs.values())
    assert set(harness.finish_reasons.values()) == {"length"}
    manager = harness.page_manager
    assert not manager.request_ids() and manager.num_available == manager.total_pages


# Every policy runs (each ~10 s here once the model is cached: no need to trim the list).
@pytest.mark.parametrize("policy", ["window", "h2o", "snapkv", "rkv", "anchors"])
def test_every_decode_policy_starts_on_a_small_pool(embedded_model, policy):
    """window reserves no decode scores and runs max_num_seqs; the scored policies run as
    many requests as their reserve holds (anchors keeps a second accumulator: fewer)."""
    harness = EngineHarness(embedded_model, {**COMPRESSION, "kv_decode_policy": policy},
                            **SMALL_POOL)
    try:
        assert_default_scoring(harness)
        if policy == "window":
            assert harness.page_manager.shards[0].layout.decode_score_requests == 0
            scheduler = harness.scheduler
            assert scheduler.max_num_running_reqs == scheduler.scheduler_config.max_num_seqs
        elif policy == "anchors":
            assert 0 < running_cap(harness) < FITS_DEFAULT[page_size(harness)]
        else:
            assert running_cap(harness) == FITS_DEFAULT[page_size(harness)]
        run_two_short_prompts(harness)
    finally:
        harness.shutdown()


def test_explicit_hybrid_scoring_starts_on_a_small_pool(embedded_model):
    harness = EngineHarness(embedded_model, {**COMPRESSION, "kv_scoring": "hybrid"},
                            **SMALL_POOL)
    try:
        assert harness.page_manager.shards[0].layout.scratch_pages > 0
        assert running_cap(harness) == FITS_HYBRID
        run_two_short_prompts(harness)
    finally:
        harness.shutdown()


def test_the_running_cap_holds_when_more_requests_arrive(embedded_model):
    """More requests than the cap arrive at once, short enough that the pool's pages would
    run them all (a page per row each): no step runs more than the reserve covers, and all
    finish with every page back."""
    harness = EngineHarness(embedded_model, COMPRESSION, **SMALL_POOL)
    try:
        cap = running_cap(harness)
        manager = harness.page_manager
        # Up to four more than the cap, each a page per row (AMX pages leave room for one).
        extra = min(4, manager.total_pages // manager.shards[0].layout.num_rows - cap)
        assert extra >= 1
        for request_id, tokens in random_prompts([4] * (cap + extra), seed=7).items():
            harness.add(request_id, tokens, greedy(8))
        most_running = 0
        while harness.engine.has_unfinished_requests():
            harness.step()
            most_running = max(most_running, len(harness.scheduler.running))
        assert most_running == cap
        assert not manager.request_ids() and manager.num_available == manager.total_pages
    finally:
        harness.shutdown()
