"""The embedded SmolLM2 with a decode budget of 128, `--max-model-len 1024` and 38 MB of KV
memory (vLLM makes 1536 bf16 tokens of it), ~50-token prompts that are never compressed.

Every decode policy was refused at start: 630 pages of reconstruction scratch under the old
default scoring, and decode-score accumulators reserved for max_num_seqs requests though the
pool runs ~60 at most. The default (the surrogate) reserves no scratch, and decode scores
are now reserved only for requests the pool can run; still, its score accumulator and
those decode scores leave fewer pages than one request of max_model_len needs (5760). So the
refusal names the --max-num-seqs that fits, and with it every decode policy starts and runs."""

import re

import pytest

from .harness import EngineHarness, assert_default_scoring, greedy, random_prompts

pytestmark = pytest.mark.slow

SMALL_POOL = dict(max_model_len=1024, kv_cache_memory_bytes=38_000_000)
# h2o: a scoring decode policy reserves decode scores (window reserves none).
COMPRESSION = {"kv_compression": "pyramidkv", "kv_decode_budget": 128,
               "kv_decode_policy": "h2o"}
# What the refusals below name (checked there): decode scores for at most this many requests.
FITS_DEFAULT, FITS_HYBRID = 50, 18
# Long enough for one decode eviction (budget 128 + the default interval of 64).
NEW_TOKENS = 200


def refused_max_num_seqs(model: str, compression: dict) -> int:
    """Starts the engine expecting the refusal; the --max-num-seqs it says fits."""
    with pytest.raises(ValueError, match=r"needs 5760 .*--max-num-seqs \d+ fits") as refusal:
        EngineHarness(model, compression, **SMALL_POOL)
    return int(re.search(r"--max-num-seqs (\d+) fits", str(refusal.value)).group(1))


def run_two_short_prompts(harness: EngineHarness) -> None:
    outputs = harness.generate(random_prompts([50, 54], seed=38), greedy(NEW_TOKENS))
    assert all(len(tokens) == NEW_TOKENS for tokens in outputs.values())
    assert set(harness.finish_reasons.values()) == {"length"}
    manager = harness.page_manager
    assert not manager.request_ids() and manager.num_available == manager.total_pages


def test_the_refusal_names_the_max_num_seqs_that_fits(embedded_model):
    """Defaults otherwise: refused, naming the decode-score reserve and the fix. Explicit
    hybrid scoring also reserves scratch (a sixteenth of the memory), so fewer fit."""
    assert refused_max_num_seqs(embedded_model, COMPRESSION) == FITS_DEFAULT
    assert refused_max_num_seqs(embedded_model, {**COMPRESSION,
                                                 "kv_scoring": "hybrid"}) == FITS_HYBRID


# Every policy runs (each ~10 s here once the model is cached: no need to trim the list).
@pytest.mark.parametrize("policy", ["window", "h2o", "snapkv", "rkv", "anchors"])
def test_every_decode_policy_starts_with_the_max_num_seqs_named(embedded_model, policy):
    """window reserves no decode scores: it starts as it is; anchors reserves a second
    accumulator per request: fewer fit than h2o's FITS_DEFAULT, as its refusal says."""
    compression = {**COMPRESSION, "kv_decode_policy": policy}
    if policy == "window":
        fits = {}
    elif policy == "anchors":
        fits = {"max_num_seqs": refused_max_num_seqs(embedded_model, compression)}
    else:
        fits = {"max_num_seqs": FITS_DEFAULT}
    harness = EngineHarness(embedded_model, compression, **fits, **SMALL_POOL)
    try:
        assert_default_scoring(harness)
        run_two_short_prompts(harness)
    finally:
        harness.shutdown()


def test_explicit_hybrid_scoring_starts_with_the_max_num_seqs_named(embedded_model):
    harness = EngineHarness(embedded_model, {**COMPRESSION, "kv_scoring": "hybrid"},
                            max_num_seqs=FITS_HYBRID, **SMALL_POOL)
    try:
        assert harness.page_manager.shards[0].layout.scratch_pages > 0
        run_two_short_prompts(harness)
    finally:
        harness.shutdown()
