"""Task generation (determinism, lengths, answers in context), scoring and summaries."""

from __future__ import annotations

import json
import random
import re

import pytest

from benchmarks.quality.cli import main, make_specs
from benchmarks.quality.report import plot, render
from benchmarks.quality.scoring import (
    add_comparisons,
    add_retained,
    contains,
    evicts_nothing,
    kept_fraction,
    paired_difference,
    prefix_agreement,
    score,
    summarize_config,
    wilson_interval,
)
from benchmarks.quality.tasks import TASKS, Sample, make_samples
from benchmarks.specs import CompressionSpec


def test_generation_is_deterministic_and_seeded(count_words):
    a = make_samples(list(TASKS), [300], 2, seed=7, count=count_words)
    b = make_samples(list(TASKS), [300], 2, seed=7, count=count_words)
    c = make_samples(list(TASKS), [300], 2, seed=8, count=count_words)
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert all(x.prompt != y.prompt for x, y in zip(a, c))
    # samples of one task differ from each other
    assert a[0].prompt != a[1].prompt


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("length", [300, 700])
def test_prompts_fit_and_fill_the_length(task, length, count_words):
    for sample in make_samples([task], [length], 3, seed=1, count=count_words):
        size = count_words(sample.prompt)
        assert size <= length
        assert size >= 0.85 * length, (task, size)


@pytest.mark.parametrize("task", [t for t in TASKS if t != "common_words"])
def test_answers_appear_in_the_context(task, count_words):
    for sample in make_samples([task], [400], 3, seed=2, count=count_words):
        context = sample.prompt.rsplit("\n\n", 1)[0]  # without the question
        for answer in sample.answers:
            assert contains(context, answer), (task, answer)


def test_needle_counts_and_answer_shapes(count_words):
    rng = random.Random(0)
    prompt, answers, metric, _ = TASKS["niah_multikey"](rng, 500, count_words)
    assert len(re.findall(r"The special magic number for \S+ is \d{6}\.", prompt)) == 4
    assert metric == "all" and len(answers) == 1
    prompt, answers, metric, _ = TASKS["niah_multivalue"](rng, 500, count_words)
    assert len(answers) == 3 and len(set(answers)) == 3 and metric == "all"
    prompt, answers, _, _ = TASKS["variable_tracking"](rng, 500, count_words)
    assert len(answers) == 3
    assert f"VAR {answers[1]} = VAR {answers[0]}." in prompt
    assert prompt.endswith("they are: VAR")


def test_common_words_are_the_most_frequent(count_words):
    prompt, answers, _, _ = TASKS["common_words"](random.Random(3), 800, count_words)
    body = prompt.split("\n\n")[1]
    counts: dict[str, int] = {}
    for word in re.findall(r"\d+\. (\w+)", body):
        counts[word] = counts.get(word, 0) + 1
    top = sorted(counts, key=counts.get, reverse=True)[: len(answers)]
    assert sorted(top) == sorted(answers)
    assert min(counts[w] for w in answers) > max(c for w, c in counts.items() if w not in answers)


def test_qa_question_targets_one_document(count_words):
    for i in range(5):
        prompt, answers, metric, _ = TASKS["qa"](random.Random(i), 700, count_words)
        name = re.search(r"Question: .*?([A-Z][a-z]+ [A-Z][a-z]+)", prompt).group(1)
        docs = [d for d in prompt.split("\n") if d.startswith("Document")]
        assert len(docs) == 6 and metric == "any"
        assert sum(name in d for d in docs) == 1
        assert contains(next(d for d in docs if name in d), answers[0])


def test_real_tokenizer_lengths(embedded_model):
    from pathlib import Path

    from tokenizers import Tokenizer  # the model's own tokenizer, without transformers' import

    tokenizer = Tokenizer.from_file(str(Path(embedded_model) / "tokenizer.json"))

    def count(text):
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    for sample in make_samples(list(TASKS), [512], 1, seed=0, count=count):
        assert 0.85 * 512 <= count(sample.prompt) <= 512


def test_contains_and_score():
    assert contains("The number is 123456.", "123456")
    assert not contains("The number is 1234567.", "123456")
    assert contains("ANSWER: Lisbon!", "lisbon")
    assert not contains("apples", "apple")
    assert score(" 111111, 222222", ["111111", "222222", "333333"], "all") == pytest.approx(2 / 3)
    assert score("Oslo or Lima", ["Lima", "Paris"], "any") == 1.0
    assert score("nothing", ["Lima"], "any") == 0.0


def test_prefix_agreement():
    assert prefix_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert prefix_agreement([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5
    assert prefix_agreement([1, 2], [1, 2, 3, 4]) == 0.5
    assert prefix_agreement([7], [1, 2]) == 0.0


def _samples():
    return [
        Sample("a", 100, 0, "", ["x"], "all", 4),
        Sample("a", 100, 1, "", ["y"], "all", 4),
        Sample("b", 100, 0, "", ["z", "w"], "all", 4),
    ]


def test_summarize_and_retained():
    samples = _samples()
    full = [{"text": "x", "token_ids": [1, 2]}, {"text": "y", "token_ids": [3]},
            {"text": "z w", "token_ids": [4, 5]}]
    half = [{"text": "x", "token_ids": [1, 2]}, {"text": "no", "token_ids": [9]},
            {"text": "z", "token_ids": [4, 6]}]
    ref = summarize_config(samples, full, full)
    got = summarize_config(samples, half, full)
    assert ref["accuracy"] == 1.0 and ref["fidelity"] == 1.0 and ref["exact_match_full"] == 1.0
    assert got["per_task"] == {"a": 0.5, "b": 0.5}
    assert got["accuracy"] == 0.5
    assert got["fidelity"] == pytest.approx((1 + 0 + 0.5) / 3)
    rows = [{"ok": True, **ref}, {"ok": True, **got}, {"ok": False}]
    add_retained(rows, rows[0])
    assert rows[0]["retained"] == 1.0 and rows[1]["retained"] == 0.5
    assert rows[1]["retained_per_task"] == {"a": 0.5, "b": 0.5}
    assert "retained" not in rows[2]


def test_wilson_interval_matches_known_values():
    # 8 of 10: the textbook 95% Wilson interval is 0.490-0.943
    low, high = wilson_interval([1.0] * 8 + [0.0] * 2)
    assert (round(low, 3), round(high, 3)) == (0.490, 0.943)
    low, high = wilson_interval([1.0] * 40)  # never [1, 1]: 40 successes leave doubt
    assert 0.90 < low < 0.92 and high == 1.0
    assert wilson_interval([]) is None
    # more samples, narrower interval around the same mean
    wide, narrow = wilson_interval([1.0, 0.0] * 10), wilson_interval([1.0, 0.0] * 100)
    assert wide[0] < narrow[0] < 0.5 < narrow[1] < wide[1]


def test_paired_difference_over_the_same_prompts():
    same = paired_difference([1, 0, 1, 1], [1, 0, 1, 1])
    assert same == {"mean": 0.0, "low": 0.0, "high": 0.0, "n": 4}
    worse = paired_difference([0.0] * 5 + [1.0] * 95, [1.0] * 100)
    assert worse["mean"] == pytest.approx(-0.05) and worse["high"] < 0  # significant
    noisy = paired_difference([0.0, 1.0] * 5, [1.0, 0.0] * 5)
    assert noisy["mean"] == 0 and noisy["low"] < -0.5 < 0.5 < noisy["high"]
    assert paired_difference([1.0], [1.0, 0.0]) is None


def test_rows_compare_with_the_full_cache_and_snapkv_at_the_same_budget():
    def row(method, budget, scores, series=None):
        return {"method": method, "budget": budget, "ratio": None, "ok": True,
                "scores": scores, "series": series or method}

    rows = [row("none", None, [1, 1, 1, 0]), row("snapkv", 64, [1, 1, 0, 0]),
            row("pyramidkv", 64, [1, 0, 0, 0]), row("snapkv", 64, [0, 0, 0, 0],
                                                     series="snapkv+window=16"),
            row("pyramidkv", 128, [1, 1, 1, 1])]
    add_comparisons(rows)
    assert "vs_full" not in rows[0] and rows[1]["vs_full"]["mean"] == -0.25
    assert rows[2]["vs_snapkv"]["mean"] == -0.25 and "vs_snapkv" not in rows[1]
    assert rows[3]["vs_snapkv"]["mean"] == -0.5  # a variant compares with plain SnapKV
    assert "vs_snapkv" not in rows[4]  # no SnapKV at 128


def test_summary_counts_samples_and_gives_intervals():
    samples = _samples()
    outputs = [{"text": "x", "token_ids": [1]}, {"text": "no", "token_ids": [2]},
               {"text": "z", "token_ids": [3]}]
    summary = summarize_config(samples, outputs, None)
    assert summary["n"] == 3 and summary["per_task_n"] == {"a": 2, "b": 1}
    assert summary["interval"] == wilson_interval([1.0, 0.0, 0.5])
    assert summary["per_task_interval"]["a"] == wilson_interval([1.0, 0.0])


def test_specs_and_skips():
    specs = make_specs(["snapkv", "adakv"], [64, 2048], None)
    assert [s.label for s in specs] == ["snapkv:64", "snapkv:2048", "adakv:64", "adakv:2048"]
    assert evicts_nothing(CompressionSpec("snapkv", budget=2048), [1000, 2048])
    assert not evicts_nothing(CompressionSpec("snapkv", budget=2048), [1000, 2049])
    assert not evicts_nothing(CompressionSpec("snapkv", ratio=0.5), [10])
    assert kept_fraction(CompressionSpec("snapkv", budget=128), [1024, 256]) == pytest.approx(
        (0.125 + 0.5) / 2)
    assert kept_fraction(CompressionSpec("snapkv", ratio=0.75), [1024]) == 0.25


def test_render_and_plot(tmp_path):
    rows = [
        {"label": "vanilla", "method": "none", "budget": None, "ratio": None, "ok": True,
         "accuracy": 0.8, "fidelity": 1.0, "per_task": {"qa": 0.8}, "kept_fraction": 1.0,
         "retained": 1.0},
        {"label": "snapkv:64", "method": "snapkv", "budget": 64, "ratio": None, "ok": True,
         "accuracy": 0.4, "fidelity": 0.5, "per_task": {"qa": 0.4}, "kept_fraction": 0.1,
         "retained": 0.5, "n": 10, "interval": [0.17, 0.69],
         "vs_full": {"mean": -0.4, "low": -0.7, "high": -0.1, "n": 10}},
        {"label": "snapkv:128", "method": "snapkv", "budget": 128, "ratio": None, "ok": True,
         "accuracy": 0.6, "fidelity": 0.7, "per_task": {"qa": 0.6}, "kept_fraction": 0.2,
         "retained": 0.75, "not_run": "x"},
    ]
    text = render(rows, ["qa"])
    assert "snapkv:128 (=full)" in text and "0.50" in text
    assert "0.17-0.69" in text and "-0.40 ± 0.30" in text  # interval and paired difference
    plot(rows, tmp_path / "q.png", title="t")
    assert (tmp_path / "q.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replot_from_saved_json(tmp_path, capsys):
    report = {
        "settings": {"model": "/m/Tiny"},
        "workload": {"tasks": ["qa"], "lengths": [256], "samples_per_task_length": 1},
        "configs": [
            {"label": "vanilla", "method": "none", "budget": None, "ratio": None, "ok": True,
             "accuracy": 1.0, "fidelity": 1.0, "per_task": {"qa": 1.0}, "kept_fraction": 1.0},
            {"label": "adakv:64", "method": "adakv", "budget": 64, "ratio": None, "ok": False,
             "error": "boom", "kept_fraction": 0.25},
        ],
    }
    saved = tmp_path / "q.json"
    saved.write_text(json.dumps(report))
    assert main(["--replot", str(saved), "--plot", str(tmp_path / "q.png")]) == 0
    assert "adakv:64" in capsys.readouterr().out
    assert (tmp_path / "q.png").stat().st_size > 1000


def test_qa_drops_documents_when_facts_alone_overflow(count_words):
    prompt, answers, _, _ = TASKS["qa"](random.Random(0), 120, count_words)
    docs = [d for d in prompt.split("\n") if d.startswith("Document")]
    assert count_words(prompt) <= 120 and 1 <= len(docs) < 6
    assert any(contains(d, answers[0]) for d in docs)
