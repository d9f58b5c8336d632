"""Where a shared prefix ends, who computes it and who waits for it (``prefix_segments``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvcompress.engine.messages import SEGMENT_READERS_AFTER_ARG
from kvcompress.engine.sched.prefix_segments import (
    SEGMENT_ID_PREFIX,
    Candidate,
    PrefixSegments,
    choose_segment,
    may_segment,
    segment_boundary,
    segment_request,
    shared_length,
)
from kvcompress.settings.config import KVCompressionConfig


def prompt(*parts: tuple[int, int]) -> np.ndarray:
    """Concatenated runs ``(first_token, count)``: runs with equal first tokens are equal."""
    return np.concatenate([np.arange(first, first + count) for first, count in parts])


def candidate(name: str, tokens: np.ndarray, settings: str = "s",
              cached: int | None = None) -> Candidate:
    return Candidate(name, tokens, settings, cached)


SYSTEM = (1000, 304)  # a whole number of 16-token blocks


def test_shared_length_leaves_each_prompt_its_last_token():
    a, b = prompt(SYSTEM, (5, 10)), prompt(SYSTEM, (90, 10))
    assert shared_length(a, b) == 304
    assert shared_length(a, a.copy()) == len(a) - 1  # parallel samples: all but the last
    assert shared_length(a[:1], a) == 0


def test_the_segment_is_what_most_readers_share_not_a_stray_pair_or_a_stray_request():
    first = candidate("q0", prompt(SYSTEM, (5, 40)))
    others = [candidate(f"q{i}", prompt(SYSTEM, (100 * i, 40))) for i in range(1, 6)]
    # q6 shares 20 tokens more with q0 (the same first question words); q7 only 100 tokens.
    others.append(candidate("q6", prompt(SYSTEM, (5, 20), (9000, 20))))
    others.append(candidate("q7", prompt((1000, 100), (7000, 240))))
    length, readers = choose_segment(first, others)
    assert length == 304
    assert readers == ["q0", "q1", "q2", "q3", "q4", "q5", "q6"]


@pytest.mark.parametrize("page_size", [8, 16, 32, 64])
def test_a_segment_is_whole_blocks_and_whole_pages(page_size):
    """Whole pages: no reader copies a partial page of it, and a filed segment its readers
    read holds no page of its own (nothing to evict it for while they run)."""
    boundary = segment_boundary(page_size)
    assert boundary % 16 == 0 and boundary % page_size == 0
    first = candidate("q0", prompt(SYSTEM, (5, 40)))
    others = [candidate(f"q{i}", prompt(SYSTEM, (100 * i, 40))) for i in range(1, 4)]
    length, readers = choose_segment(first, others, boundary=boundary)
    assert length == 304 // boundary * boundary and readers == ["q0", "q1", "q2", "q3"]
    made = PrefixSegments(boundary=boundary).plan([first, *others])
    assert [len(segment.tokens) for segment, _ in made] == [length]


def test_no_segment_alone_short_or_already_cached_or_under_other_settings():
    first = candidate("q0", prompt(SYSTEM, (5, 40)))
    assert choose_segment(first, []) == (0, [])
    assert choose_segment(first, [candidate("q1", prompt(SYSTEM, (9, 40)), "other")]) == (0, [])
    short = candidate("q1", prompt((1000, 40), (9, 40)))
    assert choose_segment(first, [short]) == (0, [])
    # A cached entry gives them 280 already: 20 more tokens are not worth a request.
    cached = [candidate("q1", prompt(SYSTEM, (9, 40)), cached=280)]
    assert choose_segment(first, cached) == (0, [])
    assert choose_segment(first, [candidate("q1", prompt(SYSTEM, (9, 40)), cached=100)])[0] == 304


def test_plan_makes_one_segment_per_shared_prefix_and_holds_its_readers_until_it_is_gone():
    segments = PrefixSegments()
    waiting = [candidate("a0", prompt(SYSTEM, (5, 40))),
               candidate("b0", prompt((3000, 200), (6, 40))),
               candidate("a1", prompt(SYSTEM, (7, 40))),
               candidate("b1", prompt((3000, 200), (8, 40))),
               candidate("c0", prompt((5000, 500)))]
    looked_up = []
    made = segments.plan(waiting, lambda request_id: looked_up.append(request_id) or 0)
    assert looked_up == ["a0", "a1", "b0", "b1"], "c0 starts like nobody: no lookup"
    assert [(len(segment.tokens), readers) for segment, readers in made] == [
        (304, ["a0", "a1"]), (192, ["b0", "b1"])], "200 shared tokens: a segment of 192"
    assert all(segment.request_id.startswith(SEGMENT_ID_PREFIX) for segment, _ in made)
    assert segments.is_segment(made[0][0].request_id) and not segments.is_segment("a0")
    assert (segments.made, segments.tokens) == (2, 496)
    # A request arriving while the segment is computed waits for it; one under other
    # settings, or whose prompt is the prefix itself, does not.
    late = prompt(SYSTEM, (11, 30))
    assert segments.holding(late, len(late), "s")
    assert not segments.holding(late, len(late), "other")
    assert not segments.holding(prompt(SYSTEM), 304, "s")
    # Held requests are not grouped again (the scheduler leaves them out), and the
    # segment request gone (filed, aborted, failed) holds nobody.
    first_id = made[0][0].request_id
    segments.prune(lambda request_id: request_id != first_id)
    assert not segments.holding(late, len(late), "s")
    assert segments.holding(prompt((3000, 200), (1, 9)), 209, "s")
    segments.prune(lambda request_id: False)
    assert not segments.pending


def test_a_segment_ends_on_a_block_boundary_so_that_later_arrivals_adopt_it_whole():
    """A tokenizer merges the prompt's last shared characters with the question's first: the
    requests that arrive first may share a token more among themselves (here 305) than with
    those arriving later (304). Cut to the block boundary, their segment is one that every
    later request adopts whole, instead of a second segment of 305 made for the others."""
    first = candidate("q0", prompt(SYSTEM, (5, 41)))
    early = [candidate("q1", prompt(SYSTEM, (5, 1), (60, 40)))]
    length, readers = choose_segment(first, early)
    assert (length, readers) == (304, ["q0", "q1"])
    late = prompt(SYSTEM, (7, 40))
    segment = PrefixSegments().plan([first, *early])[0][0]
    assert segment.covers(late, len(late), "s")


def test_parallel_samples_share_all_but_their_last_token():
    same = prompt(SYSTEM, (5, 40))
    made = PrefixSegments().plan([candidate(f"{i}_r", same.copy()) for i in range(4)])
    assert [(len(segment.tokens), len(readers)) for segment, readers in made] == [(336, 4)]


def test_only_query_agnostic_scores_or_a_prompt_kept_whole_make_a_segment():
    def config(**values):
        return KVCompressionConfig.from_mapping({"kv_compression": "pyramidkv", **values})

    assert may_segment(config(kv_scoring="surrogate"), 2000)
    assert may_segment(config(kv_scoring="reconstruct"), 2000)
    assert not may_segment(config(kv_scoring="window"), 2000)
    assert not may_segment(config(kv_scoring="hybrid-surrogate"), 2000)
    assert may_segment(config(kv_scoring="window", kv_budget=4096), 2000)  # kept whole
    assert may_segment(config(kv_scoring="window", kv_compression="streamingllm"), 2000)
    assert may_segment(KVCompressionConfig.from_mapping({"kv_compression": "none"}), 2000)


def test_held_requests_are_skipped_by_vllms_waiting_loop_in_their_places():
    """A request held for a shared prefix stays in vLLM's waiting queue: vLLM's loop asks
    the scheduler whether it may be scheduled (the seam vLLM offers for requests waiting
    on something, as for a grammar) and keeps its place; the others are vLLM's to decide."""
    from vllm.v1.request import RequestStatus

    from kvcompress.engine.sched.request_life import Life, RequestLives
    from kvcompress.engine.sched.scheduler import KVCompressScheduler

    lives = RequestLives()
    lives.hold_exactly(["held"], schedule=1)
    scheduler = object.__new__(KVCompressScheduler)
    scheduler.lives = lives
    waiting = SimpleNamespace(request_id="waiting", status=RequestStatus.WAITING)
    held = SimpleNamespace(request_id="held", status=RequestStatus.WAITING)
    skip = scheduler._handle_blocked_waiting_request
    assert not skip(held)
    assert skip(waiting)  # (vLLM's own answer for a plain waiting request)
    lives.hold_exactly([], schedule=2)  # a hold lasts one schedule
    assert lives.state("held") is Life.FREE and skip(held)


def test_a_segment_request_asks_two_tokens_and_says_where_its_readers_place_it():
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=100, n=1, extra_args={"kv_budget": 64,
                                                             "kv_transfer_params": {"x": 1}})
    reader = Request("r", list(range(500)), params, None)
    segment = segment_request("kvcompress-segment-1", np.arange(300), reader, readers_after=120)
    assert segment.prompt_token_ids == list(range(300))
    assert segment.sampling_params.max_tokens == segment.sampling_params.min_tokens == 2
    assert segment.sampling_params.extra_args == {"kv_budget": 64,
                                                  SEGMENT_READERS_AFTER_ARG: 120}
    assert reader.sampling_params.extra_args == {"kv_budget": 64, "kv_transfer_params": {"x": 1}}


def test_a_segment_is_made_once_for_its_readers_and_replanning_waits_for_something_new():
    """Issue 51: a segment its readers could not adopt (filed without a plan, evicted
    first) is not made again for them every schedule (it was, forever, in the scheduler
    benchmark: a livelock); a longer one may be. And a queue that brings no new request
    against an unchanged cache is not grouped again (its pairs would all be compared)."""
    segments = PrefixSegments()
    longer = prompt(SYSTEM, (9000, 160))  # 464 tokens, starting with the 304 of SYSTEM
    a0 = candidate("a0", np.concatenate([longer, np.arange(5, 45)]))
    x = candidate("x", prompt(SYSTEM, (7, 400)))
    made = segments.plan([a0, x], version=1)
    assert [(len(segment.tokens), readers) for segment, readers in made] == [
        (304, ["a0", "x"])]
    (segment, readers), = made
    segments.lives.serve(readers, len(segment.tokens))  # (its request ended, all computed)
    segments.prune(lambda request_id: request_id in ("a0", "x", "a2"))  # the segment is gone
    assert segments.plan([a0, x], version=2) == [], "the same segment again"
    # With a newcomer that shares a longer prefix with a0: a longer segment is made.
    a2 = candidate("a2", np.concatenate([longer, np.arange(9, 49)]))
    made = segments.plan([a0, x, a2], version=3)
    assert [(len(segment.tokens), readers) for segment, readers in made] == [
        (464, ["a0", "a2"])]
    # Nothing new since (the same candidates, or fewer, the same cache): not grouped again.
    b = [candidate("b0", prompt((3000, 200), (6, 40))), candidate("b1", prompt((3000, 200)))]
    segments._planned, segments._planned_at = {"b0", "b1"}, 4
    assert segments.plan(b[:1], version=4) == []
    assert segments.plan(b, version=4) == []  # (b0 and b1 share 192 tokens: skipped)
    assert [readers for _, readers in segments.plan(b, version=5)] == [["b0", "b1"]]


def test_token_chains_share_what_the_tokens_share():
    """``TokenChain.shared_with`` (block hashes, then one block's tokens) equals the token by
    token comparison on prompts that share any prefix length, under any limit."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from kvcompress.paging.prefix_index import TokenChain, shared_prefix

    @settings(max_examples=300, deadline=None)
    @given(st.integers(0, 200), st.integers(0, 60), st.integers(0, 60), st.integers(0, 300),
           st.integers(0, 2**31))
    def check(common, first_rest, second_rest, limit, seed):
        rng = np.random.default_rng(seed)
        base = rng.integers(0, 50, common)
        first = np.concatenate([base, rng.integers(50, 100, first_rest)])
        second = np.concatenate([base, rng.integers(100, 150, second_rest)])
        expected = shared_prefix(first, second, limit)
        assert TokenChain(first).shared_with(TokenChain(second), limit) == expected
        assert TokenChain(second).shared_with(TokenChain(first), limit) == expected

    check()
