"""Prefixes of prefixes (issue 51): a system prompt every request sends and a document some
of them send after it. Both become shared segments, the longer one adopting the shorter one
while that one is still pending (filed uncompressed); either may be compacted first, and the
pages each records must stay the right ones whichever is. Page invariants are checked every
step (KVCOMPRESS_CHECK_PAGES=1)."""

from __future__ import annotations

import random

import pytest

from .harness import EngineHarness, greedy

pytestmark = pytest.mark.slow


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(count)]


def prefix_tree(system: int, document: int, questions: int, seed: int) -> dict[str, list[int]]:
    """``questions`` prompts on the system prompt alone, as many on it and the document."""
    rng = random.Random(seed)
    shared, doc = tokens(rng, system), tokens(rng, document)
    prompts = {f"sys{i}": shared + tokens(rng, 40) for i in range(questions)}
    prompts.update({f"doc{i}": shared + doc + tokens(rng, 40) for i in range(questions)})
    return prompts


def assert_all_answered_and_pages_back(harness: EngineHarness, prompts: dict, length: int):
    assert set(harness.finished) >= set(prompts)
    reasons = {request_id: harness.finish_reasons[request_id] for request_id in prompts}
    assert set(reasons.values()) == {"length"}, reasons
    assert all(len(harness.outputs[request_id]) == length for request_id in prompts)
    pages = harness.page_manager
    assert not pages.request_ids() and pages.num_available == pages.total_pages
    assert not pages.pending_ids()
    harness.scheduler.check_pages()


def test_issue_program_a_document_after_a_shared_system_prompt(embedded_model):
    """The issue's program: 4 prompts on a 1,024-token system prompt, 4 more on it and a
    1,024-token document, sent at once with the default compression (pyramidkv, surrogate
    scoring, reuse on) in 300 MB. Before identities it killed the engine ("a table reads
    only some rows of segment ..."). Every prompt answers, the nested segments are made,
    and every page comes back."""
    prompts = prefix_tree(1024, 1024, 4, seed=0)
    harness = EngineHarness(embedded_model, {"kv_compression": "pyramidkv"}, dtype="float32",
                            max_model_len=4096, kv_cache_memory_bytes=300_000_000)
    try:
        harness.generate(prompts, greedy(8))
        assert_all_answered_and_pages_back(harness, prompts, 8)
        # The document's readers report it cached as well as the system prompt.
        assert all(harness.cached_tokens[f"doc{i}"] >= 2000 for i in range(4)), (
            harness.cached_tokens)
    finally:
        harness.shutdown()


@pytest.mark.parametrize("order", ["together", "system-first", "document-first"])
def test_nested_segments_in_every_arrival_order(surrogate_tiny_llama, order):
    """snapkv at budget 64 on 512-token prefixes (the issue's second case) on the tiny model,
    with the two groups arriving together or one a few steps before the other: every prompt
    answers, the document is shared as well as the system prompt, and the pool is whole
    after."""
    prompts = prefix_tree(512, 512, 4, seed=1)
    first = {k: v for k, v in prompts.items()
             if k.startswith("sys" if order == "system-first" else "doc")}
    harness = EngineHarness(surrogate_tiny_llama, {"kv_compression": "snapkv", "kv_budget": 64},
                            dtype="float32", max_model_len=2048, max_num_batched_tokens=2048,
                            max_num_seqs=16, kv_cache_memory_bytes=32 << 20)
    try:
        if order == "together":
            harness.generate(prompts, greedy(8))
        else:
            for request_id, prompt in first.items():
                harness.add(request_id, prompt, greedy(8))
            for _ in range(3):
                harness.step()
            for request_id, prompt in prompts.items():
                if request_id not in first:
                    harness.add(request_id, prompt, greedy(8))
            harness.run_until_done()
        assert_all_answered_and_pages_back(harness, prompts, 8)
        assert sum(harness.cached_tokens[f"doc{i}"] >= 1024 for i in range(4)) >= 3, (
            harness.cached_tokens)
    finally:
        harness.shutdown()


def test_a_client_cannot_pass_for_a_segment_request(surrogate_tiny_llama):
    """Segment requests are known by the scheduler as made, not by their ids or arguments: a
    client request whose id starts like ours, and one that sends the worker's segment
    argument, are answered as any other (their outputs were filtered out, and the first hung)
    and answer as they do alone."""
    from kvcompress.engine.messages import SEGMENT_READERS_AFTER_ARG

    rng = random.Random(5)
    prompts = {"kvcompress-segment-1": tokens(rng, 300), "marked": tokens(rng, 300)}
    settings = {"kv_compression": "snapkv", "kv_budget": 64}
    engine = dict(dtype="float32", max_model_len=1024, max_num_seqs=4,
                  kv_cache_memory_bytes=32 << 20)
    answers = {}
    for mode in ("alone", "posing"):
        harness = EngineHarness(surrogate_tiny_llama, settings, **engine)
        try:
            for request_id, prompt in prompts.items():
                extra = ({SEGMENT_READERS_AFTER_ARG: 3}
                         if mode == "posing" and request_id == "marked" else None)
                params = greedy(6, extra_args=extra) if extra else greedy(6)
                name = request_id if mode == "posing" else f"plain-{request_id}"
                harness.add(name, prompt, params)
            answers[mode] = harness.run_until_done(max_steps=200)
            assert len(answers[mode]) == 2
            pages = harness.page_manager
            assert not pages.request_ids() and not pages.pending_ids()
        finally:
            harness.shutdown()
    assert answers["posing"]["kvcompress-segment-1"] == answers["alone"][
        "plain-kvcompress-segment-1"]
    assert answers["posing"]["marked"] == answers["alone"]["plain-marked"]


def test_prefix_trees_over_http_answer_as_vanilla_and_leave_the_pool_empty(embedded_model,
                                                                           tmp_path):
    """The issue's eight prompts (a 1,024-token system prompt; a 1,024-token document after
    it for half) and four more that override compression to ``none`` on the system prompt
    and another document (two share a third document after it: prefixes of prefixes), all
    sent at once to /v1/completions of the README's server (pyramidkv, its defaults) in
    300 MB, and to a vanilla server (``--kv-compression none``). Before identities the
    README's server answered HTTP 500 and died. Every request answers, each ``none``
    request's greedy tokens are vanilla's, the server answers after them, and no page stays
    in use."""
    from concurrent.futures import ThreadPoolExecutor

    from .serving import client, kv_usage, running_server

    rng = random.Random(3)
    tree = prefix_tree(1024, 1024, 4, seed=0)
    system = tree["sys0"][:1024]
    other, third = tokens(rng, 512), tokens(rng, 256)
    exact = {f"none{i}": system + other + (third if i % 2 else []) + tokens(rng, 40)
             for i in range(4)}
    prompts = {**tree, **exact}
    replies: dict[str, dict[str, str]] = {}
    for side, flags in (("kvcompress", ("--kv-compression", "pyramidkv")),
                        ("vanilla", ("--kv-compression", "none"))):
        with running_server(embedded_model, tmp_path, *flags,
                            "--kv-cache-memory-bytes", "300000000") as (base, _):
            def complete(item: tuple[str, list[int]], base: str = base, side: str = side):
                name, prompt = item
                extra = ({"vllm_xargs": {"kv_compression": "none"}}
                         if side == "kvcompress" and name.startswith("none") else None)
                return name, client(base).completions.create(
                    model=embedded_model, prompt=prompt, max_tokens=8, temperature=0,
                    extra_body=extra)

            with ThreadPoolExecutor(len(prompts)) as pool:
                answered = dict(pool.map(complete, prompts.items()))
            assert all(reply.choices[0].finish_reason == "length"
                       for reply in answered.values())
            replies[side] = {name: reply.choices[0].text for name, reply in answered.items()}
            _, after = complete(("none0", prompts["none0"]))  # the server still answers
            assert after.choices[0].text == replies[side]["none0"]
            assert kv_usage(base) == 0.0
    assert {n: replies["kvcompress"][n] for n in exact} == {n: replies["vanilla"][n]
                                                             for n in exact}
