"""The engine's prefix-cache policy: what is kept, what is looked up, and by whom."""

from types import SimpleNamespace

import numpy as np
import pytest
from vllm.v1.request import RequestStatus

from kvcompress.engine.sched.prefix_cache import PrefixCachePolicy
from kvcompress.paging import PageLayout, ShardedPageManager
from kvcompress.settings.config import KVCompressionConfig


def request(request_id, tokens, prompt_len, computed=None, status=RequestStatus.WAITING,
            **overrides):
    fields = dict(request_id=request_id, all_token_ids=list(tokens), num_prompt_tokens=prompt_len,
                  num_computed_tokens=len(tokens) - 1 if computed is None else computed,
                  status=status, sampling_params=None, lora_request=None,
                  has_encoder_inputs=False, prompt_embeds=None, cache_salt=None,
                  skip_reading_prefix_cache=False)
    fields.update(overrides)
    return SimpleNamespace(**fields)


def cache(reuse="on"):
    layout = PageLayout(2, 2, head_size=8, page_size=4, dtype_bytes=2, total_pages=200)
    config = KVCompressionConfig.from_mapping({"kv_compression": "snapkv", "kv_budget": 64,
                                               "kv_reuse": reuse})
    return PrefixCachePolicy(ShardedPageManager(layout), config)


def finish(reuse, request_id, tokens, prompt_len, **overrides):
    done = request(request_id, tokens, prompt_len, status=RequestStatus.FINISHED_STOPPED,
                   **overrides)
    assert reuse.pages.allocate(request_id, done.num_computed_tokens)
    return reuse.retire(done)


def test_a_continuation_finds_the_whole_finished_request():
    reuse = cache()
    assert finish(reuse, "a", range(100, 141), prompt_len=36)
    follow = request("b", [*range(100, 141), 7, 8, 9], prompt_len=44)
    match = reuse.lookup(follow)
    assert match is not None and match.hit == 40  # the last token was never computed
    assert reuse.lookup(request("c", [*range(100, 120), 5, 6, 7], prompt_len=23)).hit == 20
    assert reuse.lookup(request("d", [1, 2, *range(100, 141)], prompt_len=43)) is None


@pytest.mark.parametrize("field, value", [("lora_request", object()),
                                          ("has_encoder_inputs", True),
                                          ("prompt_embeds", object()), ("cache_salt", "s")])
def test_requests_not_told_by_their_tokens_neither_look_up_nor_leave_an_entry(field, value):
    reuse = cache()
    assert not finish(reuse, "a", range(100, 141), prompt_len=36, **{field: value})
    assert not reuse.pages.entry_ids() and "a" in reuse.pages  # the caller frees them
    reuse.pages.free("a")
    assert finish(reuse, "b", range(100, 141), prompt_len=36)
    follow = [*range(100, 141), 7]
    assert reuse.lookup(request("c", follow, prompt_len=42, **{field: value})) is None
    assert reuse.lookup(request("d", follow, prompt_len=42, skip_reading_prefix_cache=True)) is None
    assert reuse.lookup(request("e", follow, prompt_len=42)).hit == 40


def test_errors_and_reuse_off_keep_nothing():
    reuse = cache()
    failed = request("f", range(100, 141), 36, status=RequestStatus.FINISHED_ERROR)
    assert reuse.pages.allocate("f", 40) and not reuse.retire(failed)
    assert not reuse.pages.entry_ids()
    off = cache("off")
    assert not finish(off, "a", range(100, 141), prompt_len=36)
    assert off.lookup(request("b", [*range(100, 141), 7], prompt_len=42)) is None


def test_a_prompt_that_ended_before_its_compaction_is_not_adopted_whole():
    """A prompt longer than the budget that ended in its prefill step (``max_tokens=1``) or
    was aborted during it is filed uncompressed (exact). The same settings would compress
    it, so a retry prefills and compresses it rather than holding it whole for its life."""
    reuse = cache()  # snapkv, budget 64
    prompt = list(range(100, 300))
    assert finish(reuse, "warm", [*prompt, 7], prompt_len=200)  # 200 computed, none evicted
    assert reuse.lookup(request("retry", [*prompt, 8, 9], prompt_len=202)) is None
    aborted = request("cut", range(400, 600), 200, computed=150,
                      status=RequestStatus.FINISHED_ABORTED)
    assert reuse.pages.allocate("cut", 150) and reuse.retire(aborted)
    assert reuse.lookup(request("again", [*range(400, 600), 8], prompt_len=201)) is None
    # Within the budget either is adopted: the same settings keep that much whole.
    assert reuse.lookup(request("short", [*range(400, 440), 8], prompt_len=41)).hit == 40


def test_compressed_and_short_entries_are_still_adopted_under_the_same_settings():
    reuse = cache()
    rows = reuse.pages.layout.num_rows
    prompt = list(range(100, 300))
    assert reuse.pages.allocate("c", 200)
    reuse.pages.release_after_compression("c", 200, np.full(rows, 64))
    assert finish(reuse, "c", [*prompt, *range(10, 21)], prompt_len=200)  # 210 computed
    assert reuse.lookup(request("next", [*prompt, *range(10, 21), 5], prompt_len=212)).hit == 210
    # A prompt within the budget kept whole, then a long answer: its generated part is what
    # these settings hold too (no decode policy), so the whole context is adopted.
    short = list(range(1000, 1036))
    answer = list(range(2000, 2100))
    assert finish(reuse, "s", [*short, *answer], prompt_len=36)
    assert reuse.lookup(request("turn2", [*short, *answer, 5], prompt_len=137)).hit == 135
