"""Shared-context benchmark: documents and questions, prompts that extend exactly turn by turn,
scoring, the configuration grid and the per-turn summary with comparisons to the full cache;
one slow end-to-end run through the real engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.documents import Prompts, make_documents, score_answer
from benchmarks.shared_context import Answer, add_comparisons, config_row, grid_specs, render
from benchmarks.specs import CompressionSpec

ROOT = Path(__file__).resolve().parents[2]


def test_documents_hide_four_facts_of_different_kinds_then_the_people_task(count_words):
    documents = make_documents(3, 300, seed=1, count=count_words)
    assert documents == make_documents(3, 300, seed=1, count=count_words)  # seeded
    for document in documents:
        kinds = [question.kind for question in document.questions]
        assert sorted(kinds[:4]) == ["city", "code", "color", "job"] and kinds[4] == "people"
        for question in document.questions[:4]:
            (answer,) = question.references
            assert answer in document.text and question.metric == "any"
        people = document.questions[4]
        assert people.metric == "all" and all(name in document.text
                                              for name in people.references)
        assert 250 <= count_words(document.text) <= 300
    assert len({d.text for d in documents}) == 3


def test_natural_filler_hides_the_facts_in_prose_from_the_installed_packages(count_words):
    """``--filler natural``: the same four facts and task, the text around them consecutive
    sentences of the installed packages' descriptions (none of the generated filler's)."""
    from benchmarks.natural_text import natural_sentences
    from benchmarks.quality.words import OBJECTS

    corpus = set(natural_sentences())
    assert len(corpus) > 200
    documents = make_documents(2, 400, seed=1, count=count_words, filler="natural")
    assert documents == make_documents(2, 400, seed=1, count=count_words, filler="natural")
    for document in documents:
        kinds = [question.kind for question in document.questions]
        assert sorted(kinds[:4]) == ["city", "code", "color", "job"]
        for question in document.questions[:4]:
            assert question.references[0] in document.text
        prose = [sentence for sentence in corpus if sentence in document.text]
        assert sum(count_words(sentence) for sentence in prose) > 300
        assert not any(thing in document.text for thing in OBJECTS)  # no generated filler


def test_score_answer_needs_the_reference_and_gives_partial_credit(count_words):
    (document,) = make_documents(1, 200, seed=2, count=count_words)
    question = document.questions[0]
    assert score_answer(f" {question.references[0]}.", question) == 1.0
    assert score_answer(" I do not know.", question) == 0.0
    people = document.questions[4]
    first = people.references[0]
    assert score_answer(f" {first} and someone else", people) == 0.5


class FakeTokenizer:
    """Characters as tokens and a ChatML-like template, enough to check prompt extension."""

    def apply_chat_template(self, messages, tokenize=False, continue_final_message=False):
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return text[: -len("</>")] if continue_final_message else text

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_each_chat_turn_extends_the_previous_prompt_and_answer_exactly(count_words):
    (document,) = make_documents(1, 120, seed=3, count=count_words)
    prompts = Prompts(FakeTokenizer())
    history: list[tuple[str, list[int]]] = []
    previous: list[int] = []
    for turn in range(len(document.questions)):
        ids = prompts.chat_turn(document, turn, history, previous)
        if turn:
            assert ids[: len(previous) + len(history[-1][1])] == previous + history[-1][1]
        text = "".join(map(chr, ids))
        assert text.endswith(document.questions[turn].prefix)
        answer = f" answer {turn}"
        history.append((answer, [ord(c) for c in answer]))
        previous = ids
    # an independent request: the document and one question, nothing of other turns
    alone = "".join(map(chr, prompts.independent(document, document.questions[2])))
    assert document.questions[2].text in alone and document.questions[1].text not in alone


def test_grid_runs_the_full_cache_then_every_combination():
    specs = grid_specs(["pyramidkv", "snapkv"], [0.5, 0.75], ["window", "hybrid"], ["on"])
    assert specs[0].is_vanilla and len(specs) == 1 + 2 * 2 * 2
    assert specs[1].label == "pyramidkv:r=0.5+scoring=window+reuse=on"
    assert all(dict(s.options)["kv_scoring"] in ("window", "hybrid") for s in specs[1:])


def _answers(scores_by_turn, mode="chat"):
    return [vars(Answer(document, turn, mode, score, 100, 50, 5, 0.1 * turn, ""))
            for turn, scores in enumerate(scores_by_turn, start=1)
            for document, score in enumerate(scores)]


def test_rows_compare_each_turn_with_the_full_cache():
    full = SimpleNamespace(error=None, seconds=1.0, result={
        "answers": _answers([[1, 1], [1, 1]]), "chat_elapsed_s": 2.0, "chat_output_tokens": 20})
    compressed = SimpleNamespace(error=None, seconds=1.0, result={
        "answers": _answers([[1, 1], [0, 1]]), "chat_elapsed_s": 4.0, "chat_output_tokens": 20})
    failed = SimpleNamespace(error="boom", seconds=1.0, result=None)
    spec = CompressionSpec("pyramidkv", ratio=0.75, options=(("kv_scoring", "hybrid"),))
    rows = [config_row(CompressionSpec(), full, ["chat"], 2),
            config_row(spec, compressed, ["chat"], 2),
            config_row(CompressionSpec("snapkv", ratio=0.5), failed, ["chat"], 2)]
    add_comparisons(rows)
    turn2 = rows[1]["turns"]["chat"][1]
    assert turn2["accuracy"] == 0.5 and turn2["of_full"] == 0.5
    assert turn2["vs_full"]["mean"] == -0.5 and turn2["vs_full"]["n"] == 2
    assert rows[1]["tok_s_ratio"] == 0.5 and rows[1]["scoring"] == "hybrid"
    assert not rows[2]["ok"] and "boom" in rows[2]["error"]
    table = render(rows, "chat", 2)
    assert "0.50 [" in table and "snapkv" not in table


@pytest.mark.slow
def test_a_small_run_end_to_end(tmp_path):
    output = tmp_path / "shared.json"
    command = [sys.executable, "-m", "benchmarks.shared_context", "--conversations", "2",
               "--doc-tokens", "200", "--methods", "snapkv", "--ratios", "0.75",
               "--scorings", "hybrid", "--reuse", "on", "--modes", "chat,independent",
               "--dtype", "float32", "--no-progress", "--output-json", str(output)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(output.read_text())
    labels = [row["label"] for row in report["configs"]]
    assert labels == ["vanilla", "snapkv:r=0.75+scoring=hybrid+reuse=on"]
    vanilla, hybrid = report["configs"]
    for row in report["configs"]:
        assert row["ok"] and set(row["turns"]) == {"chat", "independent"}
        assert all(len(turn["scores"]) == 2 for turn in row["turns"]["chat"])
    # every later chat turn of the compressed run adopted the previous turn's cache
    assert all(turn["cached_tokens"] > 0 for turn in hybrid["turns"]["chat"][1:])
    assert hybrid["turns"]["chat"][0]["vs_full"]["n"] == 2
