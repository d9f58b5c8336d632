"""Multi-turn reuse (--kv-reuse): a prompt that continues a finished request adopts its
cached pages and prefills only the rest; vLLM reports the adopted tokens as cached."""

from __future__ import annotations

import random

import numpy as np
import pytest

from .harness import EngineHarness, assert_default_scoring, greedy

pytestmark = pytest.mark.slow

EXACT = {"kv_compression": "pyramidkv", "kv_budget": 100_000}
ENGINE = dict(dtype="float32", max_model_len=2048, max_num_batched_tokens=256, max_num_seqs=8)


def new_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(count)]


def converse(harness: EngineHarness, turns: int, conversations: int, user_tokens: int,
             answer_tokens: int, seed: int = 0, **params_extra) -> list[list[dict]]:
    """Turn k of every conversation runs together; turn k + 1's prompt is turn k's prompt,
    its answer and a new user message. Per conversation and turn: prompt, output, cached."""
    rng = random.Random(seed)
    prompts = [new_tokens(rng, user_tokens + 40 * c) for c in range(conversations)]
    history: list[list[dict]] = [[] for _ in range(conversations)]
    for turn in range(turns):
        ids = [f"c{c}t{turn}" for c in range(conversations)]
        outputs = harness.generate(dict(zip(ids, prompts)),
                                   greedy(answer_tokens, **params_extra))
        for c, request_id in enumerate(ids):
            history[c].append({"prompt": prompts[c], "output": outputs[request_id],
                               "cached": harness.cached_tokens.get(request_id, 0)})
            prompts[c] = prompts[c] + outputs[request_id] + new_tokens(rng, user_tokens)
    return history


def assert_pages_back(harness: EngineHarness) -> None:
    pages = harness.page_manager
    assert not pages.request_ids() and pages.num_available == pages.total_pages
    harness.scheduler.check_pages()


def record_prompt_compactions(harness: EngineHarness) -> dict[str, np.ndarray]:
    """Filled as the engine runs: per request (by the id it was given) its rows' lengths
    after its prompt's compaction."""
    compacted: dict[str, np.ndarray] = {}
    release = harness.scheduler._release

    def record(request_id, compaction):
        if compaction.kind == "prompt":
            compacted[request_id.split("-")[0]] = compaction.physical_lengths.copy()
        release(request_id, compaction)

    harness.scheduler._release = record
    return compacted


def test_conversation_identical_to_vanilla_with_prefix_caching(tiny_llama):
    """Budget above every prompt: each turn adopts the previous turn's whole cache (prompt and
    answer but its last token, which was never computed) and its tokens are vanilla's. With
    ``--kv-reuse prompts`` it adopts the previous prompt and computes the answer again: the
    same tokens."""
    histories = {}
    for name, compression in (("vanilla", None), ("kvcompress", EXACT),
                              ("prompts", {**EXACT, "kv_reuse": "prompts"})):
        harness = EngineHarness(tiny_llama, compression, enable_prefix_caching=True,
                                kv_cache_memory_bytes=64 << 20, **ENGINE)
        try:
            histories[name] = converse(harness, turns=3, conversations=3, user_tokens=150,
                                       answer_tokens=20)
            if compression:
                assert_pages_back(harness)
                assert harness.page_manager.entry_ids(), "finished turns stay cached"
        finally:
            harness.shutdown()
    ours, vanilla = histories["kvcompress"], histories["vanilla"]
    for conversation, prompts_only, reference in zip(ours, histories["prompts"], vanilla):
        assert [t["output"] for t in conversation] == [t["output"] for t in reference]
        assert [t["output"] for t in prompts_only] == [t["output"] for t in reference]
        assert conversation[0]["cached"] == prompts_only[0]["cached"] == 0
        for before, turn in zip(conversation, conversation[1:]):
            assert turn["cached"] == len(before["prompt"]) + len(before["output"]) - 1
        for before, turn in zip(prompts_only, prompts_only[1:]):
            assert turn["cached"] == len(before["prompt"])
        # vLLM caches whole blocks: fewer tokens than we adopt, but some.
        assert all(0 < t["cached"] <= o["cached"] for t, o in zip(reference[1:],
                                                                   conversation[1:]))


def test_with_reuse_prompts_the_answer_is_compressed_with_the_next_turn(tiny_llama):
    """``--kv-reuse prompts``, budget 64 with 200-token turns: a turn adopts the last turn's
    compressed prompt only, and its compaction keeps the budget's total of the answer and
    the new message together (with ``on`` the answer is kept whole besides)."""
    settings = {"kv_compression": "snapkv", "kv_budget": 64, "kv_reuse": "prompts"}
    harness = EngineHarness(tiny_llama, settings, kv_cache_memory_bytes=64 << 20, **ENGINE)
    try:
        kept = record_prompt_compactions(harness)
        history = converse(harness, turns=3, conversations=2, user_tokens=200,
                           answer_tokens=12)
        for entry_id in harness.page_manager.entry_ids():  # each a compacted prompt
            entry = harness.rank_pages().entry(entry_id)
            assert entry.logical_len == entry.prompt_len
        assert_pages_back(harness)
    finally:
        harness.shutdown()
    for c, conversation in enumerate(history):
        for before, turn in zip(conversation, conversation[1:]):
            assert turn["cached"] == len(before["prompt"])
        first, second, third = (kept[f"c{c}t{t}"] for t in range(3))
        rows = first.size
        assert (second - first).sum() == rows * 64 and (third - second).sum() == rows * 64


def converse_adopting_whole(model: str, settings: dict, answer_tokens: int
                            ) -> tuple[dict[str, np.ndarray], list]:
    """Three turns of two conversations with 200-token messages under ``settings``, each
    turn adopting the whole previous context (prompt and answer but its last token); returns
    each request's rows after its prompt's compaction and the entries left. Pages back."""
    harness = EngineHarness(model, settings, kv_cache_memory_bytes=64 << 20, **ENGINE)
    try:
        rows_by_turn = record_prompt_compactions(harness)
        history = converse(harness, turns=3, conversations=2, user_tokens=200,
                           answer_tokens=answer_tokens)
        entries = [harness.rank_pages().entry(entry_id)
                   for entry_id in harness.page_manager.entry_ids()]
        assert_pages_back(harness)
    finally:
        harness.shutdown()
    for conversation in history:
        for before, turn in zip(conversation, conversation[1:]):
            assert turn["cached"] == len(before["prompt"]) + len(before["output"]) - 1
    return rows_by_turn, entries


def test_compressed_turns_adopt_and_compress_only_the_new_part(tiny_llama):
    """Budget 64 with 200-token turns: each turn adopts the compressed cache of the last and
    its rows grow by at most the budget of the new part; pages checked every step."""
    rows_by_turn, _ = converse_adopting_whole(
        tiny_llama, {"kv_compression": "snapkv", "kv_budget": 64}, answer_tokens=12)
    for c in range(2):
        first, second, third = (rows_by_turn[f"c{c}t{t}"] for t in range(3))
        # The budget's total, shared model-wide (the default where a reconstruction scores):
        # every row's window at least, and the rows' total exactly.
        rows = first.size
        assert first.sum() == rows * 64 and np.all(first >= 8)
        # The adopted part (first turn's rows + its 11 computed answer tokens) stays; the
        # 200-odd new tokens are compressed to the budget's total again.
        assert np.all(second >= first + 11 + 8)
        assert (second - first - 11).sum() == rows * 64
        assert np.all(third >= second + 11 + 8)
        assert (third - second - 11).sum() == rows * 64


def test_an_answer_compressed_by_decode_eviction_is_adopted_whole(tiny_llama):
    """``--kv-decode-budget`` with ``on``: after a decode eviction the answer's slots are no
    longer one per position, yet the entry's end is a cut: the next turn adopts the whole
    previous context (prompt and answer) and computes only its new message, and its rows
    hold the answer's decode budget, not the answer."""
    settings = {"kv_compression": "snapkv", "kv_budget": 64, "kv_decode_policy": "window",
                "kv_decode_budget": 16, "kv_decode_interval": 4}
    rows_by_turn, entries = converse_adopting_whole(tiny_llama, settings, answer_tokens=40)
    assert entries and not any(entry.tail_in_order for entry in entries)
    for c in range(2):
        first, second, third = (rows_by_turn[f"c{c}t{t}"] for t in range(3))
        rows = first.size
        # Each row adopted its prompt part and 16 to 20 of the 39 computed answer tokens
        # (evicted down to 16 each time it held 4 more), then the new part's budget.
        for before, after in ((first, second), (second, third)):
            assert rows * (16 + 64) <= (after - before).sum() <= rows * (20 + 64)


def test_under_pressure_entries_are_evicted_shared_and_adopters_preempted(
        surrogate_tiny_llama):
    """A pool too small for 5 conversations' caches: entries are evicted for running
    requests; five continuations of one entry share it and, too long to run together, are
    preempted and resume; an adopter is aborted mid-prefill. The page invariants hold after
    every step (KVCOMPRESS_CHECK_PAGES) and every page comes back."""
    # The default scoring (auto: the surrogate beside the model), as users
    # run reuse: entries kept by its query-agnostic scores are what later turns adopt.
    settings = {"kv_compression": "snapkv", "kv_budget": 48, "kv_admission_lookahead": 0}
    token_bytes = 4 * 2 * 2 * 32 * 4  # layers x (K, V) x KV heads x head dim x fp32
    harness = EngineHarness(surrogate_tiny_llama, settings,
                            kv_cache_memory_bytes=1700 * token_bytes,
                            **{**ENGINE, "max_model_len": 1024})
    try:
        assert_default_scoring(harness)
        history = converse(harness, turns=2, conversations=5, user_tokens=160,
                           answer_tokens=40, seed=3)
        reuse = harness.scheduler.reuse
        assert sum(t["cached"] > 0 for c in history for t in c[1:]) >= 3
        # Branches: two continuations of one finished turn (the newest entry) at once.
        rng = random.Random(9)
        last = history[0][-1]
        prompt = last["prompt"] + last["output"] + new_tokens(rng, 20)
        base = prompt + harness.generate({"again": prompt}, greedy(8))["again"]
        # Five long answers do not fit together: adopters are preempted and resume.
        branches = {f"b{i}": base + new_tokens(rng, 30) for i in range(5)}
        harness.generate(branches, greedy(180))
        cached = [harness.cached_tokens[b] for b in branches]
        assert cached.count(len(base) - 1) >= 2, (cached, len(base))
        assert harness.stats.preemptions > 0, "the branches were meant not to fit together"
        # An adopter aborted right after its adoption step.
        harness.add("aborted", base + new_tokens(rng, 300), greedy(8))
        harness.step()
        assert harness.scheduler.page_manager.shards[0].physical_lengths(
            harness.internal_id("aborted")).min() > 0
        harness.abort(["aborted"])
        harness.run_until_done()
        assert_pages_back(harness)
        figures = vars(reuse.totals)
    finally:
        harness.shutdown()
    assert figures["evicted_entries"] > 0, ("the pool was meant to be too small to keep all",
                                            figures, harness.stats.preemptions)
    assert figures["shares"] > 0


def test_entries_are_adopted_only_under_the_same_settings(tiny_llama):
    """A compressed entry is not adopted by a request compressed otherwise or not at all;
    an exact one is adopted by anyone who would keep it whole (``none``, a larger budget);
    --kv-reuse off adopts nothing."""
    rng = random.Random(4)
    long_prompt, short_prompt = new_tokens(rng, 300), new_tokens(rng, 40)
    harness = EngineHarness(tiny_llama, {"kv_compression": "snapkv", "kv_budget": 64},
                            kv_cache_memory_bytes=64 << 20, **ENGINE)
    try:
        first = harness.generate({"a": long_prompt, "s": short_prompt}, greedy(4))
        follow = {name: prompt + first[name] + new_tokens(rng, 50)
                  for name, prompt in (("a", long_prompt), ("s", short_prompt))}
        # Submitted together: each looks up before any of the others has finished.
        for name, extra in (("none", {"kv_compression": "none"}), ("other", {"kv_budget": 96}),
                            ("same", {})):
            for source in ("a", "s"):
                harness.add(f"{source}-{name}", follow[source],
                            greedy(4, extra_args=extra or None))
        harness.run_until_done()
        cached = harness.cached_tokens
        assert cached["a-none"] == 0 and cached["a-other"] == 0
        assert cached["a-same"] == len(long_prompt) + 3
        for name in ("none", "other", "same"):  # the short prompt kept everything: exact
            assert cached[f"s-{name}"] == len(short_prompt) + 3
        assert_pages_back(harness)
    finally:
        harness.shutdown()
    off = EngineHarness(tiny_llama, {"kv_compression": "snapkv", "kv_budget": 64,
                                     "kv_reuse": "off"},
                        kv_cache_memory_bytes=64 << 20, **ENGINE)
    try:
        off.generate({"a": long_prompt}, greedy(4))
        off.generate({"b": long_prompt + first["a"] + new_tokens(rng, 50)}, greedy(4))
        assert off.cached_tokens.get("b", 0) == 0 and not off.page_manager.entry_ids()
        assert off.page_manager.num_free == off.page_manager.total_pages
    finally:
        off.shutdown()


def test_a_prompt_that_ended_in_its_prefill_is_not_adopted_uncompressed(tiny_llama):
    """A 300-token prompt sent with ``max_tokens=1`` ends before its compaction and is filed
    uncompressed; the same prompt plus a question (a client's retry) must not adopt it whole
    but prefill and compress it to the budget. A two-token warm-up is compressed, and then
    adopted."""
    rng = random.Random(6)
    harness = EngineHarness(tiny_llama, {"kv_compression": "snapkv", "kv_budget": 64},
                            kv_cache_memory_bytes=64 << 20, **ENGINE)
    try:
        compacted = record_prompt_compactions(harness)
        prompt = new_tokens(rng, 300)
        harness.generate({"warm": prompt}, greedy(1))
        assert "warm" not in compacted and harness.page_manager.entry_ids()
        harness.generate({"retry": prompt + new_tokens(rng, 30)}, greedy(4))
        assert harness.cached_tokens.get("retry", 0) == 0, "adopted an uncompressed prompt"
        rows = compacted["retry"]
        assert rows.sum() == rows.size * 64  # its 330 tokens compressed to the budget

        warmed = new_tokens(rng, 300)
        harness.generate({"warm2": warmed}, greedy(2))
        assert compacted["warm2"].sum() == rows.size * 64
        harness.generate({"question": warmed + new_tokens(rng, 30)}, greedy(4))
        assert harness.cached_tokens["question"] == len(warmed)
        assert_pages_back(harness)
    finally:
        harness.shutdown()


def test_concurrent_adopters_read_one_entry_in_place_and_match_vanilla(tiny_llama):
    """A shared prefix (a system prompt) warmed once, then four questions on it at once:
    each adopts the entry by sharing (its whole pages read in place by all four, each row's
    partial page copied), the pages they hold together count the shared ones once, and with
    a budget above every prompt the answers are vanilla's. Pages checked every step."""
    rng = random.Random(11)
    prefix = new_tokens(rng, 300)
    questions = {f"q{i}": prefix + new_tokens(rng, 40) for i in range(4)}
    answers, held = {}, {}
    for name, compression in (("vanilla", None), ("kvcompress", EXACT)):
        harness = EngineHarness(tiny_llama, compression, enable_prefix_caching=True,
                                kv_cache_memory_bytes=64 << 20, **ENGINE)
        try:
            harness.generate({"warm": prefix}, greedy(2))
            for request_id, prompt in questions.items():
                harness.add(request_id, prompt, greedy(12))
            harness.step()  # all four admitted in one step: 4 x 40 new tokens
            if compression:
                pages = harness.rank_pages()
                ids = [harness.internal_id(q) for q in questions]
                own = sum(pages.owned_pages(i) - int(pages.shared_pages([i])[0]) for i in ids)
                held = {"together": pages.owned_pages(), "read": pages.num_read, "own": own,
                        "each": sum(pages.owned_pages(i) for i in ids)}
            answers[name] = harness.run_until_done()
            if compression:
                assert_pages_back(harness)
                reuse = harness.scheduler.reuse.totals
                assert (reuse.shares, reuse.handovers) == (4, 0)
                assert harness.page_manager.entry_ids(), "the shared entry stays cached"
            assert all(harness.cached_tokens[q] >= 256 for q in questions)
        finally:
            harness.shutdown()
    assert {q: answers["kvcompress"][q] for q in questions} == {
        q: answers["vanilla"][q] for q in questions}
    # The four read the prefix's whole pages once between them: held together == the read
    # pages once + each one's own pages, far below four copies.
    assert held["read"] > 0 and held["together"] == held["read"] + held["own"]
    assert held["each"] - held["together"] == 3 * held["read"]


def test_compressed_prefix_read_by_concurrent_adopters_answers_as_one_adopter_at_a_time(
        tiny_llama):
    """A compressed prefix (budget 64 of 300 tokens, warmed with two tokens) read in place
    by four questions at once gives the answers each question gets adopting it alone (when
    nothing else reads its pages): sharing changes where the K/V is read from, not what."""
    rng = random.Random(12)
    prefix = new_tokens(rng, 300)
    questions = {f"q{i}": prefix + new_tokens(rng, 40) for i in range(4)}
    settings = {"kv_compression": "snapkv", "kv_budget": 64}
    answers = {}
    for mode in ("together", "alone"):
        harness = EngineHarness(tiny_llama, settings, kv_cache_memory_bytes=64 << 20, **ENGINE)
        try:
            harness.generate({"warm": prefix}, greedy(2))
            if mode == "together":
                answers[mode] = harness.generate(questions, greedy(12))
                assert harness.scheduler.reuse.totals.shares == 4
            else:
                answers[mode] = {q: harness.generate({q: p}, greedy(12))[q]
                                 for q, p in questions.items()}
            assert all(harness.cached_tokens[q] == len(prefix) for q in questions)
            assert_pages_back(harness)
        finally:
            harness.shutdown()
    assert answers["together"] == answers["alone"]
