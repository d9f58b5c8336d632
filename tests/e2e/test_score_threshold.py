"""Threshold eviction end to end (--kv-score-threshold, per request): a request keeps what
its scores pass, a data-dependent number of tokens per head, beside requests on budgets,
and every page stays accounted for at every step."""

import numpy as np
import pytest

from benchmarks.engine import prompt_kept_fraction
from kvcompress.policies import layer_budgets
from kvcompress.settings.config import KVCompressionConfig

from .harness import EngineHarness, greedy, random_prompts
from .test_compression import BYTES_PER_TOKEN, TINY

pytestmark = pytest.mark.slow

LAYERS, HEADS, PAGE, WINDOW, SINKS = 4, 2, 16, 8, 4
# ln of reconstruction scores (the largest probability a reconstruction query pays a key),
# max-pooled: on tiny_llama's 600-token random prompts between 40 and 180 keys of each head
# pass e**-2 (0.14), about 1000 of the 4800 rows' tokens; e**-1 almost none, e**-4 all.
THRESHOLD = -2.0
# The engine's budget is the default (a request's threshold replaces it), the scores a
# reconstruction's: what a threshold is defined on.
ENGINE = {"kv_compression": "pyramidkv", "kv_window": WINDOW, "kv_sink_tokens": SINKS,
          "kv_scoring": "reconstruct", "kv_page_size": PAGE}
REQUESTS = {  # name: (extra_args, prompt length)
    "threshold": ({"kv_score_threshold": THRESHOLD}, 600),
    "threshold_capped": ({"kv_score_threshold": THRESHOLD, "kv_budget": 40}, 560),
    "budget": ({"kv_budget": 48}, 520),
}


def assert_pages_accounted(harness):
    """Every page is free, held by rows (once, however many read it) or cached, and each
    row holds the pages its length needs, no more."""
    manager = harness.rank_pages()
    manager.check_invariants()
    assert manager.num_free + manager.owned_pages() + manager.num_cached == manager.total_pages
    for rid in manager.request_ids():
        lengths = manager.physical_lengths(rid)
        pages = manager._requests[rid].table.num_pages
        assert (pages == (lengths + PAGE - 1) // PAGE).all(), rid


def test_a_threshold_keeps_what_its_scores_pass_and_the_pages_follow(tiny_llama):
    harness = EngineHarness(tiny_llama, ENGINE, kv_cache_memory_bytes=4096 * BYTES_PER_TOKEN,
                            **TINY)
    try:
        prompts = {}
        for offset, (name, (extra_args, length)) in enumerate(REQUESTS.items()):
            prompts[name] = random_prompts([length], seed=60 + offset)["p0"]
            harness.add(name, prompts[name], greedy(12, extra_args=dict(extra_args)))
        kept: dict[str, np.ndarray] = {}
        for _ in range(200):
            harness.step()
            assert_pages_accounted(harness)
            for name in REQUESTS:
                # The second token: a reconstruction's prompt is compacted after its passes
                # (scheduled work), before the request decodes again.
                if name not in kept and len(harness.outputs.get(name, [])) >= 2:
                    # The newest sampled token is not in the cache yet; earlier ones are.
                    since = len(harness.outputs[name]) - 1
                    internal = harness.internal_id(name)
                    rows = harness.rank_pages().physical_lengths(internal) - since
                    kept[name] = rows.reshape(LAYERS, HEADS)
                    worker_rows = harness.on_workers(
                        lambda worker, rid=internal: worker.model_runner.paged_runtime.state
                        .requests[rid].lengths.tolist())[0]
                    assert worker_rows == (rows + since).tolist(), name
            if len(kept) == len(REQUESTS):
                break

        alone = kept["threshold"]
        length = REQUESTS["threshold"][1]
        # The floor (window + sinks) always, more where the scores pass, never the whole.
        assert (alone >= WINDOW + SINKS).all() and (alone < length).all()
        assert len(np.unique(alone)) > 2, "as many tokens per head as the scores pass"
        assert alone.sum() > HEADS * LAYERS * 48, "more than a budget 48 (as measured)"
        # Under a cap that binds (far more pass than it holds) the request keeps exactly its
        # total, shared model-wide by score: rows still differ.
        capped = kept["threshold_capped"]
        cap = layer_budgets("pyramidkv", LAYERS, REQUESTS["threshold_capped"][1], budget=40,
                            window=WINDOW)
        assert capped.sum() == HEADS * sum(cap) and (capped >= WINDOW).all()
        assert len(np.unique(capped)) > 1
        # Beside them a budget keeps its exact total (shared model-wide by reconstruction).
        assert kept["budget"].sum() == HEADS * LAYERS * 48
        config = KVCompressionConfig.from_mapping(ENGINE).with_request_overrides(
            REQUESTS["threshold"][0])
        assert not config.policy.capped  # the default budget did not cap it

        harness.run_until_done()
        assert_pages_accounted(harness)
        # The benchmarks' measured kept fraction: the token-rows these prompts kept.
        planned = sum(LAYERS * HEADS * length for _, length in REQUESTS.values())
        assert prompt_kept_fraction(harness.engine) == pytest.approx(
            sum(int(rows.sum()) for rows in kept.values()) / planned)
        manager = harness.rank_pages()
        assert not manager.request_ids()
        assert harness.page_manager.num_available == harness.page_manager.total_pages
    finally:
        harness.shutdown()
