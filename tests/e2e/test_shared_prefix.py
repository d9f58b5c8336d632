"""Requests that arrive together with one prefix (issue 40 items 2-3): the prefix is computed
and compressed once, by a segment request of its own, the requests wait for it and read it
in place (``engine/sched/prefix_segments.py``). Page invariants are checked every step
(KVCOMPRESS_CHECK_PAGES=1)."""

from __future__ import annotations

import random

import pytest
from vllm import SamplingParams
from vllm.v1.request import RequestStatus

from kvcompress.engine.sched import sharing as sharing_module
from kvcompress.paging.page_pool import PageState

from .harness import EngineHarness, assert_default_scoring, greedy

pytestmark = pytest.mark.slow

EXACT = {"kv_compression": "pyramidkv", "kv_budget": 100_000}
ENGINE = dict(dtype="float32", max_model_len=2048, max_num_batched_tokens=256, max_num_seqs=8,
              kv_cache_memory_bytes=64 << 20)


def new_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(count)]


def questions_on(prefix: list[int], count: int, own: int, seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"q{i}": prefix + new_tokens(rng, own) for i in range(count)}


def assert_pages_back(harness: EngineHarness) -> None:
    pages = harness.page_manager
    assert not pages.request_ids() and pages.num_available == pages.total_pages
    harness.scheduler.check_pages()


def segment_ids(harness: EngineHarness) -> list[str]:
    return [request_id for request_id in harness.scheduler.requests
            if harness.scheduler.segments.is_segment(request_id)]


def test_arriving_together_they_compute_the_prefix_once_and_answer_as_vanilla(tiny_llama):
    """Four questions on one 304-token prefix, sent at once, no warm-up: one segment request
    prefills the prefix (304 tokens), the four wait for it, then each adopts it by sharing,
    prefills only its 40 tokens and reports 304 cached; the pages they hold together count
    the prefix's once; with a budget above every prompt the answers are vanilla's (with
    vLLM's prefix caching), and no output of the segment request reaches the client."""
    rng = random.Random(21)
    prefix = new_tokens(rng, 304)
    questions = questions_on(prefix, 4, 40, seed=22)
    answers, held = {}, {}
    for name, compression in (("vanilla", None), ("kvcompress", EXACT)):
        harness = EngineHarness(tiny_llama, compression, enable_prefix_caching=True, **ENGINE)
        try:
            for request_id, prompt in questions.items():
                harness.add(request_id, prompt, greedy(12))
            if compression:
                harness.step()
                scheduler = harness.scheduler
                assert len(segment_ids(harness)) == 1, "one segment request for the four"
                # The questions wait while the segment request prefills (256-token chunks).
                assert not any(scheduler.page_manager.shards[0].request_ids()
                               & {harness.internal_id(q) for q in questions})
                while not all(harness.internal_id(q) in harness.page_manager
                              for q in questions):
                    harness.step()
                pages = harness.rank_pages()
                ids = [harness.internal_id(q) for q in questions]
                own = sum(pages.owned_pages(i) - int(pages.shared_pages([i])[0]) for i in ids)
                held = {"together": pages.owned_pages(), "read": pages.num_read, "own": own}
            answers[name] = harness.run_until_done()
            if compression:
                assert all(harness.cached_tokens[q] == 304 for q in questions)
                reuse = harness.scheduler.reuse.totals
                assert (reuse.segments, reuse.segment_tokens) == (1, 304)
                assert reuse.adopted_tokens == 4 * 304 and reuse.shares + reuse.handovers == 4
                assert set(answers[name]) == set(questions), "segment outputs stay inside"
                assert not segment_ids(harness)
                assert_pages_back(harness)
        finally:
            harness.shutdown()
    assert answers["kvcompress"] == answers["vanilla"]
    assert held["read"] > 0 and held["together"] == held["read"] + held["own"]


def test_compressed_once_by_the_surrogate_and_answers_sensible(embedded_model):
    """The default serve settings (pyramidkv, surrogate scoring, reuse on) on the embedded
    SmolLM2: eight questions on a 608-token prefix; the prefix is computed once, filed
    uncompressed while the eight (admitted in one step) prefill their own parts over all of
    it, then compacted in place once (its entry holds fewer tokens per row than the prefix);
    each answer matches what the question gets reading the same segment beside two other
    readers only (a fresh prefix cache each time)."""
    rng = random.Random(31)
    prefix = new_tokens(rng, 608)
    questions = questions_on(prefix, 8, 120, seed=32)
    settings = {"kv_compression": "pyramidkv", "kv_budget": 128}
    answers = {}
    for mode in ("together", "beside two"):
        harness = EngineHarness(embedded_model, settings, dtype="float32", max_model_len=1024,
                                max_num_batched_tokens=1024, max_num_seqs=16,
                                kv_cache_memory_bytes=256 << 20)
        try:
            assert_default_scoring(harness)
            if mode == "together":
                answers[mode] = harness.generate(questions, greedy(8))
                reuse = harness.scheduler.reuse.totals
                assert (reuse.segments, reuse.segment_tokens) == (1, 608)
                entries = [harness.rank_pages().entry(e) for e in harness.page_manager.entry_ids()]
                segment = [e for e in entries if e.prompt_len == 608]
                # Compacted (budget shared model-wide: some rows keep all, most keep few).
                assert len(segment) == 1 and segment[0].prompt_evicted.mean() > 300
                assert not harness.page_manager.pending_ids()
            else:
                # Two other readers, with as many tokens of their own (the segment is scored
                # as placed before 120 of them), and the question, at once.
                answers[mode] = {}
                for question, prompt in questions.items():
                    assert harness.engine.reset_prefix_cache()
                    others = {f"{question}-warm1": [*prefix, 1, *[3] * 119],
                              f"{question}-warm2": [*prefix, 2, *[3] * 119]}
                    answers[mode][question] = harness.generate(
                        {**others, question: prompt}, greedy(8))[question]
                assert harness.scheduler.reuse.totals.segments == len(questions)
            assert all(harness.cached_tokens[q] == 608 for q in questions)
            assert_pages_back(harness)
        finally:
            harness.shutdown()
    assert answers["together"] == answers["beside two"]


def test_readers_queued_beyond_the_lookahead_wait_for_the_segment_too(tiny_llama,
                                                                       monkeypatch):
    """Only the first waiting requests are grouped (two here, 64 by default), but every
    waiting request that starts with a segment being computed waits for it: the prefix is
    computed once for all six questions, and they answer as vanilla."""
    monkeypatch.setattr(sharing_module, "SEGMENT_LOOKAHEAD", 2)
    rng = random.Random(61)
    prefix = new_tokens(rng, 304)
    questions = questions_on(prefix, 6, 30, seed=62)
    answers = {}
    for name, compression in (("vanilla", None), ("kvcompress", EXACT)):
        harness = EngineHarness(tiny_llama, compression, enable_prefix_caching=True, **ENGINE)
        try:
            answers[name] = harness.generate(questions, greedy(6))
            if compression:
                reuse = harness.scheduler.reuse.totals
                assert (reuse.segments, reuse.segment_tokens) == (1, 304)
                assert reuse.adopted_tokens == 6 * 304
                assert all(harness.cached_tokens[q] == 304 for q in questions)
                assert_pages_back(harness)
        finally:
            harness.shutdown()
    assert answers["kvcompress"] == answers["vanilla"]


def test_aborting_the_segment_request_releases_its_readers(tiny_llama):
    """The segment request aborted while it prefills (256 of its 608 tokens computed): the
    questions are held no longer. What it computed was filed (an aborted prompt is kept
    whole), so the next step makes a second segment request that adopts those 256 tokens
    and computes the rest; the questions adopt its 608 and answer as vanilla."""
    rng = random.Random(41)
    prefix = new_tokens(rng, 608)
    questions = questions_on(prefix, 3, 30, seed=42)
    answers = {}
    for name, compression in (("vanilla", None), ("kvcompress", EXACT)):
        harness = EngineHarness(tiny_llama, compression, **ENGINE)
        try:
            for request_id, prompt in questions.items():
                harness.add(request_id, prompt, greedy(6))
            if compression:
                harness.step()
                (segment,) = segment_ids(harness)
                harness.scheduler.finish_requests(segment, RequestStatus.FINISHED_ABORTED)
            answers[name] = harness.run_until_done()
            if compression:
                reuse = harness.scheduler.reuse.totals
                assert (reuse.segments, reuse.segment_tokens) == (2, 1216)
                assert reuse.adopted_tokens == 256 + 3 * 608
                assert all(harness.cached_tokens[q] == 608 for q in questions)
                assert_pages_back(harness)
        finally:
            harness.shutdown()
    assert answers["kvcompress"] == answers["vanilla"]


def test_parallel_samples_share_their_prompt(tiny_llama):
    """n = 4: vLLM's four sample requests of one prompt compute it once between them (its
    whole 16-token blocks short of its last token, which each computes for its logits)."""
    rng = random.Random(51)
    prompt = new_tokens(rng, 200)
    harness = EngineHarness(tiny_llama, EXACT, **ENGINE)
    try:
        harness.add("p", prompt, SamplingParams(temperature=0.8, seed=1, max_tokens=6, n=4))
        harness.run_until_done()
        reuse = harness.scheduler.reuse.totals
        assert (reuse.segments, reuse.segment_tokens) == (1, 192)
        assert reuse.adopted_tokens == 4 * 192
        assert harness.cached_tokens["p"] == 192
        assert_pages_back(harness)
    finally:
        harness.shutdown()


def test_on_32_token_pages_a_segment_is_whole_pages_its_running_readers_all_read(tiny_llama):
    """A 304-token prefix on 32-token pages: the segment ends at 288 (whole blocks and whole
    pages), so each reader reads every page of it in place and, while they run, the filed
    segment holds no page of its own, nothing to evict it for (a 304-token segment left a
    partial page a row that only the entry held)."""
    rng = random.Random(57)
    prefix = new_tokens(rng, 304)
    questions = questions_on(prefix, 3, 40, seed=58)
    harness = EngineHarness(tiny_llama, {**EXACT, "kv_page_size": 32}, **ENGINE)
    try:
        for request_id, prompt in questions.items():
            harness.add(request_id, prompt, greedy(12))
        while not all(harness.internal_id(q) in harness.page_manager for q in questions):
            harness.step()
        harness.step()  # each reader's first step: its own part prefilled over the prefix
        pages = harness.rank_pages()
        assert pages.layout.page_size == 32 and len(pages.entry_ids()) == 1
        entry = pages.entry(pages.entry_ids()[0])
        assert entry.logical_len == 288
        assert not pages.pool.count_in_state(entry.table.all_pages(), PageState.CACHED), (
            "running readers read every page of the segment")
        harness.run_until_done()
        reuse = harness.scheduler.reuse.totals
        assert (reuse.segments, reuse.segment_tokens) == (1, 288)
        assert all(harness.cached_tokens[q] == 288 for q in questions)
        assert_pages_back(harness)
    finally:
        harness.shutdown()


def test_a_segment_scored_by_reconstruction_passes_is_filed_after_them(tiny_llama):
    """--kv-scoring reconstruct: the segment request waits for its passes (parked) and is
    ended only once its prompt is compacted; the questions adopt the compressed segment."""
    rng = random.Random(61)
    prefix = new_tokens(rng, 304)
    questions = questions_on(prefix, 3, 40, seed=62)
    harness = EngineHarness(tiny_llama, {"kv_compression": "snapkv", "kv_budget": 64,
                                         "kv_scoring": "reconstruct"}, **ENGINE)
    try:
        answers = harness.generate(questions, greedy(6))
        assert all(len(answer) == 6 for answer in answers.values())
        reuse = harness.scheduler.reuse.totals
        assert (reuse.segments, reuse.segment_tokens, reuse.adopted_tokens) == (1, 304, 912)
        assert all(harness.cached_tokens[q] == 304 for q in questions)
        entries = [harness.rank_pages().entry(e) for e in harness.page_manager.entry_ids()]
        (segment,) = [entry for entry in entries if entry.prompt_len == 304]
        assert not segment.exact_prompt and segment.logical_len == 304
        assert_pages_back(harness)
    finally:
        harness.shutdown()


def first_and_later_questions(own: int) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Three questions of ``own`` tokens on a 320-token prefix, and three later ones that
    share only its first 304 tokens."""
    prefix = new_tokens(random.Random(71), 320)
    first = questions_on(prefix, 3, own, seed=72)
    later = {f"late{i}": prompt
             for i, prompt in enumerate(questions_on(prefix[:304], 3, 56, seed=73).values())}
    return first, later


def send_later_while_pending(harness: EngineHarness, first: dict[str, list[int]],
                             later: dict[str, list[int]]) -> None:
    """``first`` sent, steps until their segment is filed pending, then ``later`` sent."""
    for request_id, prompt in first.items():
        harness.add(request_id, prompt, greedy(6))
    for _ in range(100):
        harness.step()
        if harness.page_manager.pending_ids():
            break
    assert harness.page_manager.pending_ids(), "the first segment is filed pending"
    for request_id, prompt in later.items():
        harness.add(request_id, prompt, greedy(6))


def test_requests_that_share_less_than_a_pending_segment_wait_for_its_compaction(tiny_llama):
    """Three questions share a 320-token prefix, computed once by a segment request and filed
    pending (read whole until compacted in place). Three more arrive then that share only its
    first 304 tokens (over HTTP: the tokenizer merged the prefix's last characters with the
    question's first): they cannot adopt it whole, so they wait for its compaction, and only
    then is a segment of their own made. Made at once, its pages evicted the pending one
    before its readers adopted it, and theirs evicted the new one in turn: two groups
    recomputing their prefixes forever. Everyone answers; the pages come back."""
    first, later = first_and_later_questions(own=40)
    harness = EngineHarness(tiny_llama, {"kv_compression": "snapkv", "kv_budget": 64,
                                         "kv_scoring": "reconstruct"}, **ENGINE)
    try:
        send_later_while_pending(harness, first, later)
        made_while_pending, steps_pending = set(), 0
        while harness.page_manager.pending_ids():
            harness.step()
            if harness.page_manager.pending_ids():  # (compaction comes first in a schedule)
                made_while_pending.update(segment_ids(harness))
                steps_pending += 1
        assert steps_pending and not made_while_pending
        answers = harness.run_until_done()
        assert all(len(answers[q]) == 6 for q in [*first, *later])
        reuse = harness.scheduler.reuse.totals
        assert (reuse.segments, reuse.segment_tokens) == (2, 320 + 304)
        assert all(harness.cached_tokens[q] == 320 for q in first)
        assert all(harness.cached_tokens[q] == 304 for q in later)
        assert_pages_back(harness)
    finally:
        harness.shutdown()


def test_a_wait_for_a_pending_segment_is_bounded_by_the_sharing_wait(tiny_llama):
    """Arrivals as above, the first questions long enough that the segment stays pending a
    few steps, with --kv-sharing-wait 1 (issue 51: every wait has a bound): the later
    questions are held one schedule, then prefill and compress their own copies while the
    first segment is still pending, and no segment is made for them; all answer and the
    pages come back."""
    # Long questions: their prefill over the pending segment takes several steps.
    first, later = first_and_later_questions(own=400)
    harness = EngineHarness(tiny_llama, {"kv_compression": "snapkv", "kv_budget": 64,
                                         "kv_scoring": "reconstruct", "kv_sharing_wait": 1},
                            **ENGINE)
    try:
        send_later_while_pending(harness, first, later)
        admitted_while_pending = set()
        while harness.page_manager.pending_ids():
            harness.step()
            if harness.page_manager.pending_ids():
                admitted_while_pending.update(
                    q for q in later if any(r.startswith(q + "-")
                                            for r in harness.page_manager.request_ids()))
        assert admitted_while_pending, "the bound let the later questions go on"
        answers = harness.run_until_done()
        assert all(len(answers[q]) == 6 for q in [*first, *later])
        assert harness.scheduler.reuse.totals.segments == 1
        assert_pages_back(harness)
    finally:
        harness.shutdown()


# A tight pool: kvcompress makes 273 pages of 16 tokens of it for 8 rows (tiny_llama: 4
# layers x 2 KV heads), 544 tokens uncompressed; vanilla vLLM 768 tokens of blocks. Admission
# as vLLM does it (no growth reserved), so that growing requests preempt each other.
TIGHT = dict(dtype="float32", max_model_len=512, max_num_seqs=8, enable_prefix_caching=True,
             kv_cache_memory_bytes=768 * 4 * 2 * 2 * 32 * 4)
EXACT_NO_LOOKAHEAD = {**EXACT, "kv_admission_lookahead": 0}


def step_tracking(harness: EngineHarness, preemptions: dict[str, list[int]],
                  readers_running: list[int], readers: list[str]) -> None:
    """One step; then, by internal id, each live request's preemptions so far and how many
    of them came once it had generated tokens (``[all, decoding]``), and how many of
    ``readers`` hold pages (kvcompress; none counted on vanilla vLLM)."""
    harness.step()
    for request_id, request in harness.scheduler.requests.items():
        seen = preemptions.setdefault(request_id, [0, 0])
        if request.num_preemptions > seen[0]:
            if request.num_output_tokens:
                seen[1] += request.num_preemptions - seen[0]
            seen[0] = request.num_preemptions
    held = harness.page_manager.request_ids() if hasattr(harness.scheduler, "page_manager") \
        else set()
    readers_running.append(sum(1 for request_id in held
                               if any(request_id.startswith(r + "-") for r in readers)))


def test_readers_of_one_segment_preempted_while_decoding_answer_as_vanilla(tiny_llama):
    """Six questions on one 320-token prefix, sent at once, in a pool of 544 tokens that
    holds the prefix and a few questions but not all of them grown by 96 tokens: with
    128-token chunks the segment request prefills the prefix in three, the questions adopt
    it together (several at once, sharing its pages) and are preempted as they grow; a
    preempted question is recomputed, adopting the entry again. Token for token the answers
    are vanilla vLLM's (prefix caching on, same pool, same chunks), and every page comes
    back. Every step the page invariants hold (KVCOMPRESS_CHECK_PAGES): no page a question
    reads is freed while another still reads it.

    Before adopters were admitted by what they hold once adopted (the full-sequence check,
    ``sched.kv_cache_manager``), each question had to fit as if its prefix were new pages: with
    the entry read by one question, no second one fitted, and they ran one at a time."""
    rng = random.Random(71)
    prefix = new_tokens(rng, 320)
    questions = questions_on(prefix, 6, 48, seed=72)
    answers, preempted, together = {}, {}, {}
    for name, compression in (("vanilla", None), ("kvcompress", EXACT_NO_LOOKAHEAD)):
        harness = EngineHarness(tiny_llama, compression, max_num_batched_tokens=128, **TIGHT)
        try:
            for request_id, prompt in questions.items():
                harness.add(request_id, prompt, greedy(96))
            preemptions: dict[str, list[int]] = {}
            readers_running: list[int] = []
            for _ in range(5_000):
                if not harness.engine.has_unfinished_requests():
                    break
                step_tracking(harness, preemptions, readers_running, list(questions))
            answers[name] = dict(harness.outputs)
            preempted[name] = {request_id.rsplit("-", 1)[0]: counts
                               for request_id, counts in preemptions.items() if counts[0]}
            together[name] = max(readers_running)
            if compression:
                reuse = harness.scheduler.reuse.totals
                assert (reuse.segments, reuse.segment_tokens) == (1, 320)
                # Each question adopted the prefix at least once, preempted ones again.
                assert reuse.adopted_tokens >= 320 * (
                    6 + sum(counts[0] for counts in preempted[name].values()))
                assert all(harness.cached_tokens[q] == 320 for q in questions)
                assert set(answers[name]) == set(questions)
                assert not segment_ids(harness)
                assert_pages_back(harness)
        finally:
            harness.shutdown()
    assert answers["kvcompress"] == answers["vanilla"]
    assert all(len(answer) == 96 for answer in answers["vanilla"].values())
    # The pool was tight indeed: questions preempted while they decoded, on both engines.
    assert sum(counts[1] for counts in preempted["kvcompress"].values()) >= 2, preempted
    assert preempted["vanilla"], preempted
    assert together["kvcompress"] >= 3, together


def test_a_segment_request_preempted_in_its_prefill_holds_its_readers(tiny_llama):
    """The segment request preempted in the middle of its prefill. Two requests (150 new
    tokens each) decode in the tight pool; after 68 steps four questions on one 336-token
    prefix arrive. The segment request's prompt fits when it is admitted, but not beside
    the others' growth: with 32-token chunks, 300 tokens in, a running request needs a page
    and vLLM preempts the last running one, the segment request (still prefilling, so
    ordered last: the cheapest to recompute). Its pages are freed, not filed (it did not
    finish), and it stays pending: the questions stay held, holding no page and computing
    nothing, until the others have ended and it is readmitted and recomputed. Then they
    adopt its 336 tokens (one segment made, not a second), answer as vanilla vLLM's (same
    pool, same arrival step), and every page comes back."""
    rng = random.Random(81)
    prefix = new_tokens(rng, 336)
    questions = questions_on(prefix, 4, 32, seed=82)
    background = {f"b{i}": new_tokens(rng, 40 + 4 * i) for i in range(2)}
    arrive_after = 68  # steps
    answers, segment_preemptions = {}, {}
    for name, compression in (("vanilla", None), ("kvcompress", EXACT_NO_LOOKAHEAD)):
        harness = EngineHarness(tiny_llama, compression, max_num_batched_tokens=32, **TIGHT)
        try:
            for request_id, prompt in background.items():
                harness.add(request_id, prompt, greedy(150))
            for _ in range(arrive_after):
                harness.step()
            for request_id, prompt in questions.items():
                harness.add(request_id, prompt, greedy(16))
            segment, held_steps = None, 0
            for _ in range(5_000):
                if not harness.engine.has_unfinished_requests():
                    break
                harness.step()
                if not compression:
                    continue
                scheduler = harness.scheduler
                if segment is None and segment_ids(harness):
                    (segment_id,) = segment_ids(harness)
                    segment = scheduler.requests[segment_id]
                if segment is not None and not segment.is_finished():
                    # Held: no question holds a page or has computed a token.
                    for question in questions:
                        request = scheduler.requests[harness.internal_id(question)]
                        assert request.num_computed_tokens == 0, question
                        assert request.request_id not in harness.page_manager, question
                    if segment.status == RequestStatus.PREEMPTED:
                        held_steps += 1
            answers[name] = dict(harness.outputs)
            if compression:
                assert segment is not None
                segment_preemptions[name] = (segment.num_preemptions, held_steps)
                reuse = harness.scheduler.reuse.totals
                assert (reuse.segments, reuse.segment_tokens) == (1, 336)
                assert all(harness.cached_tokens[q] == 336 for q in questions)
                assert set(answers[name]) == {*questions, *background}
                assert_pages_back(harness)
        finally:
            harness.shutdown()
    assert answers["kvcompress"] == answers["vanilla"]
    # The segment request was preempted, and the questions waited while it was out.
    preemptions, held_steps = segment_preemptions["kvcompress"]
    assert preemptions >= 1 and held_steps >= 1, segment_preemptions


def prompt_done(harness: EngineHarness, request_id: str) -> bool:
    request = harness.scheduler.requests[harness.internal_id(request_id)]
    return request.num_computed_tokens >= request.num_prompt_tokens


def first_alone_then_the_rest(harness: EngineHarness, questions: dict[str, list[int]],
                              params: SamplingParams) -> dict[str, list[int]]:
    """The first question alone until its prompt is computed, then the others at once."""
    (first, *rest) = questions
    harness.add(first, questions[first], params)
    while not prompt_done(harness, first):
        harness.step()
    for request_id in rest:
        harness.add(request_id, questions[request_id], params)
    return harness.run_until_done()


def test_a_burst_whose_first_request_arrives_alone_reads_a_fork_of_its_pages(tiny_llama):
    """The first of four questions on a 304-token prefix arrives alone (over HTTP a burst's
    first request reaches an idle engine before the others): its compaction waits a step,
    by which time the other three wait, and what they share with it (the 304 tokens) is
    forked off its uncompacted pages, a copy planned as a segment, instead of a segment
    request computing the prefix again. They report it cached and, as its plan keeps every
    token (a StreamingLLM budget of 320 above the prefix, under the first's 344), answer
    as vanilla vLLM with its prefix cache."""
    rng = random.Random(81)
    prefix = new_tokens(rng, 304)
    questions = questions_on(prefix, 4, 40, seed=82)
    answers = {}
    for name, compression in (("vanilla", None),
                              ("kvcompress", {"kv_compression": "streamingllm",
                                              "kv_budget": 320})):
        harness = EngineHarness(tiny_llama, compression, enable_prefix_caching=True, **ENGINE)
        try:
            answers[name] = first_alone_then_the_rest(harness, questions, greedy(8))
            if compression:
                scheduler = harness.scheduler
                reuse = scheduler.reuse.totals
                assert scheduler.segments.forks == 1 and reuse.segments == 0
                assert reuse.adopted_tokens == 3 * 304
                assert all(harness.cached_tokens[q] == 304 for q in list(questions)[1:])
                assert_pages_back(harness)
        finally:
            harness.shutdown()
    readers = list(questions)[1:]
    assert {q: answers["kvcompress"][q] for q in readers} == {
        q: answers["vanilla"][q] for q in readers}


def test_a_fork_scored_by_the_surrogate_is_compacted_once_for_its_readers(
        surrogate_tiny_llama):
    """The default scoring (the surrogate) and a budget the prefix exceeds: the fork's plan
    drops pages, so it is filed pending, read whole while its three readers prefill their
    own parts, then compacted in place once; the first question's answer is what it gets
    arriving with nobody after it (its compaction is only later, the same)."""
    rng = random.Random(91)
    prefix = new_tokens(rng, 320)
    questions = questions_on(prefix, 4, 48, seed=92)
    settings = {"kv_compression": "pyramidkv", "kv_budget": 64}
    harness = EngineHarness(surrogate_tiny_llama, settings, **ENGINE)
    try:
        answers = first_alone_then_the_rest(harness, questions, greedy(8))
        scheduler = harness.scheduler
        reuse = scheduler.reuse.totals
        assert scheduler.segments.forks == 1 and reuse.segments == 0
        assert reuse.whole_segment_reads == 3 and reuse.adopted_tokens == 3 * 320
        assert all(harness.cached_tokens[q] == 320 for q in list(questions)[1:])
        assert all(len(answer) == 8 for answer in answers.values())
        entries = [harness.rank_pages().entry(e) for e in harness.page_manager.entry_ids()]
        (segment,) = [entry for entry in entries if entry.prompt_len == 320]
        assert segment.segment and segment.prompt_evicted.min() > 0
        assert not harness.page_manager.pending_ids()
        assert_pages_back(harness)
    finally:
        harness.shutdown()
    (first,) = list(questions)[:1]
    alone = EngineHarness(surrogate_tiny_llama, settings, **ENGINE)
    try:
        assert alone.generate({first: questions[first]}, greedy(8))[first] == answers[first]
        assert alone.scheduler.segments.forks == 0
    finally:
        alone.shutdown()


def test_a_fork_whose_plan_fails_frees_its_pages_and_its_readers(tiny_llama, monkeypatch):
    """The fork's planning fails (an injected fault for 304-token prompts: the fork's): the
    first question is compacted as usual, the fork's pages are freed, its readers are held
    no longer and compress their own copies (no segment is made for them: it would fail
    the same way, and before, a segment request failing again and again held them
    forever); every question answers, none with an error, and every page comes back."""
    monkeypatch.setenv("KVCOMPRESS_FAULT_INJECTION", "plan:304")
    rng = random.Random(101)
    questions = questions_on(new_tokens(rng, 304), 4, 40, seed=102)
    harness = EngineHarness(tiny_llama, {"kv_compression": "streamingllm", "kv_budget": 64},
                            **ENGINE)
    try:
        answers = first_alone_then_the_rest(harness, questions, greedy(6))
        assert harness.scheduler.segments.forks == 1
        assert harness.scheduler.reuse.totals.segments == 0
        assert all(len(answers[q]) == 6 for q in questions)
        assert all(harness.finish_reasons[q] == "length" for q in questions)
        assert_pages_back(harness)
    finally:
        harness.shutdown()


def test_readers_of_a_failed_segment_request_compress_their_own_copies(tiny_llama,
                                                                       monkeypatch):
    """Sent together, three questions get a segment request, whose planning fails (an
    injected fault for its 304 tokens): it ends with its error, and the questions compress
    their own copies. Before, every step made them a new segment request that failed the
    same way: they were held forever."""
    monkeypatch.setenv("KVCOMPRESS_FAULT_INJECTION", "plan:304")
    rng = random.Random(111)
    questions = questions_on(new_tokens(rng, 304), 3, 40, seed=112)
    harness = EngineHarness(tiny_llama, {"kv_compression": "streamingllm", "kv_budget": 64},
                            **ENGINE)
    try:
        answers = harness.generate(questions, greedy(6))
        assert harness.scheduler.reuse.totals.segments == 1
        assert all(len(answers[q]) == 6 for q in questions)
        assert all(harness.finish_reasons[q] == "length" for q in questions)
        assert_pages_back(harness)
    finally:
        harness.shutdown()
