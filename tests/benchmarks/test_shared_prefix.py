"""Shared-prefix benchmark without an engine: prompts that share exactly the prefix's ids,
scenarios and their arrival waves, the wave driver over a fake engine, figures, ratios to
vanilla and the table."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from benchmarks.documents import (
    SYSTEM_HEADER,
    Prompts,
    make_documents,
    system_prompt_prompts,
)
from benchmarks.engine import Wave, run_waves
from benchmarks.shared_prefix import (
    ARRIVALS,
    QUICK,
    add_ratios,
    apply_workload_defaults,
    build_parser,
    kv_held,
    make_scenarios,
    pool_tokens,
    render,
    scenario_figures,
    shared_prefix_prompts,
    waves,
)
from benchmarks.specs import token_counter
from tests.benchmarks.test_shared_context import FakeTokenizer


def test_every_prompt_starts_with_the_shared_prefix_and_asks_its_own_question(count_words):
    (document,) = make_documents(1, 150, seed=4, count=count_words)
    prefix, prompts, asked = shared_prefix_prompts(Prompts(FakeTokenizer()), document, 7)
    text = "".join(map(chr, prefix))
    assert text.endswith(document.text) and "Question" not in text
    assert len(prompts) == 7 and len({tuple(p) for p in prompts}) == 7
    assert all(p[: len(prefix)] == prefix for p in prompts)
    assert asked == [0, 1, 2, 3, 4, 0, 1]  # cycling through the document's five questions
    for number, (ids, index) in enumerate(zip(prompts, asked)):
        tail = "".join(map(chr, ids[len(prefix):]))
        question = document.questions[index]
        assert f"Question {number + 1}: {question.text}" in tail
        assert tail.endswith(question.prefix)


def test_scenarios_each_on_a_document_of_their_own(count_words):
    documents = make_documents(4, 100, seed=5, count=count_words)
    scenarios = make_scenarios(Prompts(FakeTokenizer()), documents, [2, 3],
                               ["concurrent", "warmed"])
    assert [s.name for s in scenarios] == ["n2-concurrent", "n2-warmed", "n3-concurrent",
                                           "n3-warmed"]
    assert [s.document for s in scenarios] == [0, 1, 2, 3]
    assert [len(s.prompts) for s in scenarios] == [2, 2, 3, 3]
    with pytest.raises(ValueError, match="documents"):
        make_scenarios(Prompts(FakeTokenizer()), documents[:3], [2, 3], ["concurrent", "warmed"])


def test_arrivals_become_waves(count_words):
    concurrent, staggered, warmed = make_scenarios(
        Prompts(FakeTokenizer()), make_documents(3, 80, seed=6, count=count_words), [3],
        ["concurrent", "staggered", "warmed"])
    (wave,) = waves(concurrent, "p", "w")
    assert [i for i, _ in wave.requests] == ["n3-concurrent-0", "n3-concurrent-1",
                                             "n3-concurrent-2"] and wave.after == "start"
    first, rest = waves(staggered, "p", "w")
    assert len(first.requests) == 1 and len(rest.requests) == 2
    assert rest.after == "first_token" and rest.params == "p"
    warm, questions = waves(warmed, "p", "w")
    assert warm.requests == [("n3-warmed-warm", warmed.prefix_ids)] and warm.params == "w"
    assert questions.after == "finished" and len(questions.requests) == 3


@dataclass
class FakeEngine:
    """Each request prefills in its first step (one token), then one token per step until
    it has ``length`` tokens; records which requests each step saw."""

    length: int = 3
    tokens: dict[str, list[int]] = field(default_factory=dict)
    limits: dict[str, int] = field(default_factory=dict)
    steps: list[list[str]] = field(default_factory=list)

    def add_request(self, request_id, prompt, params):
        self.tokens[request_id] = []
        self.limits[request_id] = params

    def has_unfinished_requests(self):
        return any(len(t) < self.limits[r] for r, t in self.tokens.items())

    def step(self):
        outputs = []
        active = [r for r, t in self.tokens.items() if len(t) < self.limits[r]]
        self.steps.append(active)
        for request_id in active:
            self.tokens[request_id].append(1)
            done = len(self.tokens[request_id]) == self.limits[request_id]
            outputs.append(SimpleNamespace(
                request_id=request_id, finished=done,
                outputs=[SimpleNamespace(token_ids=list(self.tokens[request_id]))]))
        return outputs


def test_run_waves_submits_each_wave_when_the_earlier_ones_reach_its_point():
    engine = FakeEngine()
    run = run_waves(engine, [Wave([("a", [1])], 3), Wave([("b", [1]), ("c", [1])], 2,
                                                         after="first_token")])
    assert engine.steps[:2] == [["a"], ["a", "b", "c"]]  # after a's first token
    assert set(run.outputs) == {"a", "b", "c"} and set(run.ttft_s) == {"a", "b", "c"}
    engine = FakeEngine()
    run_waves(engine, [Wave([("w", [1])], 2), Wave([("x", [1])], 1, after="finished")])
    assert engine.steps == [["w"], ["w"], ["x"]]
    with pytest.raises(ValueError, match="wave start"):
        run_waves(FakeEngine(), [Wave([("a", [1])], 1, after="later")])


def _scenario(name="n2-concurrent"):
    return {"name": name, "requests": 2, "arrivals": "concurrent",
            "prefix_ids": list(range(100)), "prompts": [list(range(110)), list(range(120))]}


def _records(ttfts, cached=(0, 0)):
    return [{"index": k, "prompt_tokens": 110 + 10 * k, "cached_tokens": cached[k],
             "output_tokens": 4, "ttft_s": ttft, "correct": 1.0}
            for k, ttft in enumerate(ttfts)]


STEPS = {"preemptions": 0, "preempted_tokens": None, "peak_running": 2}


def test_figures_count_the_prefix_computations_and_time_to_first_token():
    once = scenario_figures(_scenario(), _records([1.0, 3.0], cached=(0, 96)),
                            elapsed_s=2.0, prefill_tokens=134, steps=STEPS)
    assert once["prefix_computed"] == pytest.approx(1.04)  # (134 - 30) / 100
    assert once["cached_tokens"] == 96 and once["requests_with_cache_hit"] == 1
    assert once["min_cached_after_first"] == 96  # the reader after the first found 96
    assert once["ttft_mean"] == 2.0 and once["ttft_p50"] == 2.0
    assert once["output_tok_s"] == 4.0 and once["peak_running"] == 2
    twice = scenario_figures(_scenario(), _records([2.0, 6.0]), elapsed_s=4.0,
                             prefill_tokens=230, steps=STEPS)
    assert twice["prefix_computed"] == 2.0


def _row(pool, label, prefill, ttft, ok=True):
    figures = scenario_figures(_scenario(), _records([ttft, ttft]), elapsed_s=ttft,
                               prefill_tokens=prefill, steps=STEPS)
    row = {"pool": pool, "label": label, "ok": ok, "scenarios": [figures] if ok else None}
    if not ok:
        row["error"] = "boom"
    return row


def test_ratios_compare_with_vanilla_in_the_same_pool_and_scenario():
    rows = [_row("3x", "vanilla", 130, 1.0), _row("3x", "pyramidkv:r=0.75", 230, 4.0),
            _row("all", "vanilla", 130, 0.5), _row("all", "pyramidkv:r=0.75", 230, 1.0),
            _row("all", "snapkv:r=0.75", 0, 0.0, ok=False)]
    add_ratios(rows)
    tight = rows[1]["scenarios"][0]["vs_vanilla"]
    assert tight["prefill_tokens"] == pytest.approx(230 / 130) and tight["ttft_mean"] == 4.0
    assert tight["output_tok_s"] == 0.25
    assert rows[3]["scenarios"][0]["vs_vanilla"]["ttft_mean"] == 2.0
    assert rows[0]["scenarios"][0]["vs_vanilla"]["ttft_p50"] == 1.0
    table = render(rows)
    assert "pyramidkv:r=0.75" in table and "snapkv" not in table and "n2-concurrent" in table


def test_pools_in_multiples_of_the_longest_request_or_all():
    assert pool_tokens(["3", "all", "1.5"], 1000, 16) == [("3x", 3000), ("all", 16000),
                                                          ("1.5x", 1500)]
    with pytest.raises(ValueError, match="at least one request"):
        pool_tokens(["0.5"], 1000, 16)


def test_pools_in_bytes_as_vllm_reads_them():
    # 130M is 130 MiB (vLLM's --kv-cache-memory-bytes); whole tokens of 23040 bytes
    assert pool_tokens(["130M"], 1000, 16, per_token=23040) == [("130M", 130 * 2**20 // 23040)]
    assert pool_tokens(["136m"], 1000, 16, per_token=1000) == [("136m", 136_000)]
    with pytest.raises(ValueError, match="bytes"):
        pool_tokens(["130M"], 1000, 16)


def test_system_prompt_chats_share_the_system_message_and_ask_their_own_question(
        smollm_tokenizer):
    (document,) = make_documents(1, 300, seed=3, count=token_counter(smollm_tokenizer))
    prefix, prompts, asked = system_prompt_prompts(
        Prompts(smollm_tokenizer), document, 6, 80, token_counter(smollm_tokenizer), seed=0)
    head = smollm_tokenizer.decode(prefix)
    assert head.startswith("<|im_start|>system") and head.endswith(document.text)
    assert "<|im_start|>user" not in head
    assert all(p[: len(prefix)] == prefix for p in prompts)
    assert len({tuple(p) for p in prompts}) == 6 and asked == [0, 1, 2, 3, 4, 0]
    for number, (ids, index) in enumerate(zip(prompts, asked)):
        tail = smollm_tokenizer.decode(ids[len(prefix):])
        assert f"Question {number + 1}: {document.questions[index].text}" in tail
        assert tail.endswith(document.questions[index].prefix)
        # the user message is about --question-tokens long: filler, then the question
        assert 70 <= len(ids) - len(prefix) <= 110
    again = system_prompt_prompts(Prompts(smollm_tokenizer), document, 6, 80,
                                  token_counter(smollm_tokenizer), seed=0)
    assert again == (prefix, prompts, asked)  # seeded


def test_scenarios_of_the_system_prompt_workload(smollm_tokenizer):
    count = token_counter(smollm_tokenizer)
    documents = make_documents(2, 200, seed=1, count=count)
    chats = make_scenarios(Prompts(smollm_tokenizer), documents, [3], ["concurrent", "staggered"],
                           workload="system-prompt", question_tokens=60, count=count)
    plain = make_scenarios(Prompts(smollm_tokenizer), documents, [3],
                           ["concurrent", "staggered"])
    assert [s.name for s in chats] == ["n3-concurrent", "n3-staggered"]
    assert all(SYSTEM_HEADER in smollm_tokenizer.decode(s.prefix_ids) for s in chats)
    assert all(SYSTEM_HEADER not in smollm_tokenizer.decode(s.prefix_ids) for s in plain)
    assert [s.document for s in chats] == [0, 1]
    with pytest.raises(ValueError, match="workload"):
        make_scenarios(Prompts(smollm_tokenizer), documents, [3], ["concurrent"],
                       workload="poem")


def test_kv_held_divides_the_pools_usage_among_the_running_requests():
    busy = [SimpleNamespace(running=4, kv_cache_usage=0.5),
            SimpleNamespace(running=2, kv_cache_usage=0.5)]
    held = kv_held(busy, 1000, per_token=10)
    assert held["kv_held_per_request"] == pytest.approx((125 + 250) / 2)
    assert held["peak_kv_held"] == 500 and held["kv_held_per_request_tokens"] == 18.75
    assert kv_held([], 1000, None) == {"kv_held_per_request": None, "peak_kv_held": 0.0,
                                       "kv_held_per_request_tokens": None}


def test_the_table_shows_kv_held_when_measured_and_keeps_older_tables():
    rows = [_row("3x", "vanilla", 130, 1.0), _row("3x", "pyramidkv:r=0.75", 230, 4.0)]
    add_ratios(rows)
    assert "KV MB/req" not in render(rows)  # a result from before KV held was measured
    for row, held in zip(rows, (2e6, 5e6)):
        row["scenarios"][0].update(kv_held_per_request=held, peak_kv_held=3 * held)
    add_ratios(rows)
    assert rows[1]["scenarios"][0]["vs_vanilla"]["kv_held_per_request"] == 2.5
    table = render(rows)
    assert "KV MB/req" in table and "peak KV MB" in table and "15.00" in table
    assert "min cached after 1st / prefix" in table


def test_defaults_quick_and_workload_defaults():
    args = build_parser().parse_args([])
    apply_workload_defaults(args)
    assert (args.requests, args.arrivals) == ("8,32,128", "concurrent,staggered")
    assert (args.workload, args.doc_tokens, args.answer_tokens) == ("document", 2000, 16)
    assert args.kv_pools == "3,all" and args.max_num_seqs >= 128
    chats = build_parser().parse_args(["--workload", "system-prompt", "--answer-tokens", "64"])
    apply_workload_defaults(chats)
    assert (chats.doc_tokens, chats.question_tokens, chats.answer_tokens,
            chats.kv_pools) == (1500, 270, 64, "130M")  # a flag given wins
    parser = build_parser()
    parser.set_defaults(**QUICK)
    quick = parser.parse_args(["--quick", "--requests", "4"])
    assert quick.requests == "4" and quick.configs == QUICK["configs"]
    assert "warmed" in ARRIVALS  # still available
