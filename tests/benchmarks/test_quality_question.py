"""The question-outside mode of the quality suite (kvpress's default evaluation): prompts split
into context and question, exact token extensions, the two-request run (fake engine), the
adoption check and the side-by-side report. No engine, no vLLM import."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.extension import exact_extension
from benchmarks.jobs import JobResult
from benchmarks.quality.cli import build_parser, build_rows, job_id, main, make_specs
from benchmarks.quality.question import (
    CONTEXT_MAX_TOKENS,
    adoption,
    adoption_problems,
    compressible,
    positions,
    question_split,
    resolved_scoring,
    run_outside,
)
from benchmarks.quality.report import plot, render_report
from benchmarks.quality.scoring import add_comparisons, contains
from benchmarks.quality.tasks import TASKS, Sample, make_samples, split_question
from benchmarks.specs import CompressionSpec, EngineSettings


# ----------------------------------------------------------------------------- prompts
@pytest.mark.parametrize("task", list(TASKS))
def test_every_task_splits_into_context_and_question(task, count_words):
    for sample in make_samples([task], [400], 3, seed=4, count=count_words):
        context, question = split_question(sample.prompt)
        assert context + question == sample.prompt
        assert question.startswith("\n\n") and "\n\n" not in question[2:]
        assert count_words(question) < 60 and count_words(context) > 250
        # the needles are in the part compressed without the question, not in the question
        for answer in sample.answers:
            assert not contains(question, answer), (task, answer)
        if task != "common_words":  # its answers are list entries, not sentences
            assert all(contains(context, answer) for answer in sample.answers)


def test_split_needs_a_blank_line_before_the_question():
    with pytest.raises(ValueError, match="blank line"):
        split_question("no question here")
    assert split_question("a\n\nb\n\nQ? A:") == ("a\n\nb", "\n\nQ? A:")


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def merging(text: str) -> list[int]:
    """A tokenizer whose tokens span the context's end: "." + "\\n" is one token (0)."""
    ids: list[int] = []
    for c in text:
        if c == "\n" and ids and ids[-1] == ord("."):
            ids[-1] = 0
        else:
            ids.append(ord(c))
    return ids


def test_question_split_keeps_the_inside_prompt_when_the_tokens_split_cleanly():
    prompt = "Header.\n\nSome text. The key is 42.\n\nWhat is the key? The key is"
    ids, context_tokens = question_split(prompt, chars, chars)
    assert ids == chars(prompt)  # the inside mode's prompt, token for token
    assert "".join(map(chr, ids[:context_tokens])) == "Header.\n\nSome text. The key is 42."


def test_question_split_extends_the_context_exactly_when_tokens_merge_across_it():
    prompt = "Header.\n\nThe key is 42.\n\nWhat is the key?"
    ids, context_tokens = question_split(prompt, merging, chars)
    head = merging("Header.\n\nThe key is 42.")
    assert merging(prompt)[:len(head)] != head  # the whole prompt merges "." and "\n"
    assert ids[:context_tokens] == head  # request 2 starts with request 1's tokens
    assert ids[context_tokens:] == chars("\n\nWhat is the key?")  # the question, alone


def test_exact_extension():
    assert exact_extension([7, 8], "ab", "abcd", chars) == [7, 8, ord("c"), ord("d")]
    with pytest.raises(ValueError, match="character 1"):
        exact_extension([7, 8], "ab", "axcd", chars)


def test_quality_prompts_of_the_real_tokenizer_split_cleanly(smollm_tokenizer):
    """SmolLM2: every task's whole-prompt ids start with its context's ids, so the question-
    outside mode asks exactly the inside mode's tokens."""
    tokenizer = smollm_tokenizer

    def count(text):
        return len(tokenizer.encode(text, add_special_tokens=False))

    for sample in make_samples(list(TASKS), [320], 2, seed=0, count=count):
        ids, context_tokens = question_split(
            sample.prompt, tokenizer.encode,
            lambda text: tokenizer.encode(text, add_special_tokens=False))
        assert ids == tokenizer.encode(sample.prompt)
        assert 0 < context_tokens < len(ids) - 5


# ----------------------------------------------------------------------------- the two requests
class FakeEngine:
    """Finishes every request in one step; request 2 reports its context as cached when a
    request 1 with exactly those tokens ran before (and figures as the plugin would)."""

    def __init__(self, figures):
        self.figures, self.pending, self.seen, self.requests = figures, [], set(), []

    def add_request(self, request_id, prompt, params):
        self.pending.append((request_id, list(prompt["prompt_token_ids"]), params))
        self.requests.append((list(prompt["prompt_token_ids"]), params.max_tokens))

    def has_unfinished_requests(self):
        return bool(self.pending)

    def step(self):
        outputs = []
        for request_id, ids, params in self.pending:
            cached = max((len(s) for s in self.seen if tuple(ids[:len(s)]) == s
                          and len(s) < len(ids)), default=0)
            key = "adopted_tokens" if cached else "compressed_requests"
            self.figures[key] = self.figures.get(key, 0) + (cached or 1)
            self.seen.add(tuple(ids))
            outputs.append(SimpleNamespace(
                request_id=request_id, finished=True, prompt_token_ids=ids,
                num_cached_tokens=cached, outputs=[SimpleNamespace(
                    token_ids=[1] * params.max_tokens, text=f"answer {request_id}")]))
        self.pending = []
        return outputs


@pytest.fixture
def fake_vllm(monkeypatch):
    """run_outside's vLLM imports (SamplingParams, TokensPrompt) without vLLM."""
    vllm = SimpleNamespace(SamplingParams=lambda max_tokens, temperature: SimpleNamespace(
        max_tokens=max_tokens, temperature=temperature))
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", SimpleNamespace(TokensPrompt=dict))


def test_run_outside_compresses_each_context_then_asks_its_question(fake_vllm):
    prompts = [{"prompt_token_ids": [1, 2, 3, 4, 5], "context_tokens": 3, "max_tokens": 4},
               {"prompt_token_ids": [1, 2, 9, 9], "context_tokens": 2, "max_tokens": 4}]
    figures: dict[str, int] = {}
    engine = FakeEngine(figures)
    progress: list[int] = []
    params = [SimpleNamespace(max_tokens=4)] * 2
    outputs, extra = run_outside(engine, prompts, params, figures, progress.append)
    # request 1: each context alone, two tokens (one would leave it uncompressed); then
    # request 2: the whole prompt, every context submitted before any question
    assert engine.requests == [([1, 2, 3], CONTEXT_MAX_TOKENS), ([1, 2], CONTEXT_MAX_TOKENS),
                               ([1, 2, 3, 4, 5], 4), ([1, 2, 9, 9], 4)]
    assert [o.cached_tokens for o in outputs] == [3, 2]
    assert [o.text for o in outputs] == ["answer 0", "answer 1"]
    assert extra["context_figures"] == {"compressed_requests": 2}
    assert extra["question_figures"] == {"adopted_tokens": 5}  # taken per phase
    assert progress[-1] == 4 and extra["context_s"] >= 0 and extra["question_s"] >= 0


def test_adoption_counts_hits_and_names_misses():
    done = adoption([100, 120, 90], [100, 0, 91], 3, {"compressed_requests": 3},
                    {"adopted_tokens": 191})
    assert (done["hits"], done["n"], done["misses"]) == (2, 3, [1])
    assert done["contexts_compressed"] == 3 and done["question_figures"]["adopted_tokens"] == 191
    assert adoption_problems({"adoption": done}) == (
        "1 of 3 questions did not adopt their context (asked with it inside): samples [1]")
    # a context within the budget is kept whole: not a problem, nor in the table
    short = adoption([100, 60], [100, 60], 1, {"compressed_requests": 1}, {})
    assert adoption_problems({"adoption": short}) is None
    uncompressed = adoption([100], [100], 1, {"compressed_requests": 0}, {})
    assert adoption_problems({"adoption": uncompressed}) == (
        "1 of the 1 contexts longer than the budget not compressed")
    full = adoption([100, 120], [64, 64], 0, {}, {})
    assert full["misses"] == [] and adoption_problems({"adoption": full}) is None
    assert adoption_problems({"label": "inside row"}) is None


def test_contexts_the_configuration_compresses():
    lengths = [50, 64, 65, 300]
    assert compressible(CompressionSpec("snapkv", budget=64), {}, lengths) == 2
    assert compressible(CompressionSpec(), {}, lengths) == 0


# ----------------------------------------------------------------------------- settings
def test_positions_and_option():
    assert positions("both") == ["inside", "outside"] and positions("outside") == ["outside"]
    assert build_parser().parse_args([]).question_position == "inside"  # as before
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--question-position", "after"])


def _model_with_surrogate(folder, surrogate: bool = True) -> str:
    """A model folder (a config only) with a score surrogate made for it, or none."""
    import json

    import torch

    from kvcompress.profile_model.profiles import model_fingerprint
    from kvcompress.profile_model.store import beside_path
    from kvcompress.profile_model.surrogates import ScoreSurrogate

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if surrogate:
        ScoreSurrogate(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4),
                       torch.zeros(1, 1), model_fingerprint(folder), 1).save(
            beside_path("surrogate", folder))
    return str(folder)


def test_scoring_auto_resolves_per_mode_as_the_engine_does(tmp_path):
    bare = _model_with_surrogate(tmp_path / "bare", surrogate=False)
    fitted = _model_with_surrogate(tmp_path / "fitted")
    auto, window = CompressionSpec("snapkv", budget=64), CompressionSpec(
        "snapkv", budget=64, options=(("kv_scoring", "window"),))
    for model in (bare, fitted):  # no prefix caching: no reuse, the window's
        assert resolved_scoring(auto, {}, False, model) == "window"
    assert resolved_scoring(auto, {}, True, fitted) == "surrogate"
    assert resolved_scoring(auto, {}, True, bare) == "window"  # no surrogate
    assert resolved_scoring(window, {}, True, fitted) == "window"
    assert resolved_scoring(auto, {"kv_scoring": "reconstruct"}, False, bare) == "reconstruct"
    assert resolved_scoring(CompressionSpec(), {}, True, bare) is None


def test_grid_of_methods_budgets_and_scorings():
    specs = make_specs(["pyramidkv", "snapkv"], [64], None, ["window", "hybrid"])
    assert [s.label for s in specs] == [
        "pyramidkv:64+scoring=window", "pyramidkv:64+scoring=hybrid",
        "snapkv:64+scoring=window", "snapkv:64+scoring=hybrid"]
    assert [s.label for s in make_specs(["snapkv"], None, [0.5], ["window"])] == [
        "snapkv:r=0.5+scoring=window"]
    assert [s.label for s in make_specs(["snapkv"], [64], None)] == ["snapkv:64"]


def test_bad_scoring_is_refused_before_anything_loads():
    with pytest.raises(SystemExit, match="--scorings"):
        main(["--scorings", "window,psychic"])


def test_each_scoring_compares_with_snapkv_of_the_same_scoring():
    def row(method, scoring, scores):
        options = {"kv_scoring": scoring} if scoring else {}
        series = method + (f"+scoring={scoring}" if scoring else "")
        return {"method": method, "budget": 64, "ratio": None, "ok": True, "scores": scores,
                "options": options, "series": series}

    rows = [{"method": "none", "budget": None, "ratio": None, "ok": True, "scores": [1, 1]},
            row("snapkv", "window", [1, 1]), row("snapkv", "hybrid", [0, 0]),
            row("pyramidkv", "window", [1, 0]), row("pyramidkv", "hybrid", [1, 0]),
            row("pyramidkv", "reconstruct", [0, 0])]
    add_comparisons(rows)
    assert rows[3]["vs_snapkv"]["mean"] == -0.5  # against snapkv window
    assert rows[4]["vs_snapkv"]["mean"] == 0.5  # against snapkv hybrid
    assert "vs_snapkv" not in rows[5]  # no snapkv reconstruct, no plain snapkv


# ----------------------------------------------------------------------------- rows and report
def fake_results(specs, modes, texts):
    """JobResults as the workers return them: ``texts[(label, mode)]`` per sample."""
    results = {}
    for spec in specs:
        for mode in modes:
            outputs = [{"text": t, "token_ids": [i]} for i, t in
                       enumerate(texts[(spec.label, mode)])]
            result = {"outputs": outputs, "generate_s": 1.0}
            if mode == "outside":
                result.update(cached_tokens=[30, 0] if not spec.is_vanilla else [16, 16],
                              context_s=0.5, question_s=0.5,
                              context_figures={"compressed_requests": 2},
                              question_figures={"adopted_tokens": 10})
            results[job_id(spec, mode)] = JobResult(job_id(spec, mode), result, None, 2.0)
    return results


def test_rows_and_report_side_by_side(tmp_path):
    samples = [Sample("passkey", 320, 0, "", ["11111"], "all", 8),
               Sample("qa", 320, 0, "", ["Lima"], "any", 8)]
    prompts = [{"prompt_token_ids": list(range(40)), "context_tokens": 30, "max_tokens": 8},
               {"prompt_token_ids": list(range(42)), "context_tokens": 32, "max_tokens": 8}]
    specs = [CompressionSpec(), CompressionSpec("snapkv", budget=16,
                                                options=(("kv_scoring", "window"),)),
             CompressionSpec("snapkv", budget=16)]
    right, wrong = ["11111", "Lima"], ["no", "no"]
    texts = {("vanilla", "inside"): right, ("vanilla", "outside"): right,
             ("snapkv:16+scoring=window", "inside"): right,
             ("snapkv:16+scoring=window", "outside"): ["11111", "no"],
             ("snapkv:16", "inside"): right, ("snapkv:16", "outside"): wrong}
    modes = ["inside", "outside"]
    # the inside engines without prefix caching (--no-prefix-caching): auto is the window
    model = _model_with_surrogate(tmp_path / "m")
    inside = EngineSettings(model, "float32", 64, 4, 64, 1 << 20, enable_prefix_caching=False)
    mode_settings = {"inside": inside,
                     "outside": dataclasses.replace(inside, enable_prefix_caching=True)}
    rows = build_rows(samples, specs, fake_results(specs, modes, texts), prompts, mode_settings)
    assert [(r["label"], r["question"]) for r in rows] == [
        (s.label, m) for m in modes for s in specs]
    outside = {r["label"]: r for r in rows if r["question"] == "outside"}
    window = outside["snapkv:16+scoring=window"]
    assert window["accuracy"] == 0.5 and window["vs_inside"]["mean"] == -0.5
    assert window["vs_full"]["mean"] == -0.5  # against the question-outside full cache
    assert window["adoption"]["hits"] == 1 and window["adoption"]["misses"] == [1]
    # auto with reuse: the model's surrogate
    assert window["scoring"] == "window" and outside["snapkv:16"]["scoring"] == "surrogate"
    assert [r["scoring"] for r in rows if r["question"] == "inside"] == [None, "window", "window"]
    assert not outside["vanilla"]["adoption"]["applies"]

    text = render_report(rows, ["passkey", "qa"])
    assert "question inside:" in text and "question outside:" in text
    side = text.split("question inside vs outside")[1]
    assert "outside - inside (paired 95%)" in side
    line = next(x for x in side.splitlines() if x.startswith("snapkv:16 "))
    assert "window / surrogate" in line and "-1.00" in line and "1/2" in line
    assert "n/a (full)" in side
    plot(rows, tmp_path / "q.png", title="t")  # both modes on one plot
    assert (tmp_path / "q.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_takes_an_accuracy_of_zero(tmp_path):
    """A Wilson bound computed at accuracy 0 can exceed it by a rounding error."""
    rows = [{"label": "snapkv:64", "method": "snapkv", "budget": 64, "ratio": None, "ok": True,
             "accuracy": 0.0, "fidelity": 0.1, "interval": [1e-17, 0.39],
             "question": "outside", "series": "snapkv"}]
    plot(rows, tmp_path / "q.png", title="t")
    assert (tmp_path / "q.png").stat().st_size > 1000


def test_an_inside_only_report_looks_as_before():
    rows = [{"label": "vanilla", "method": "none", "budget": None, "ratio": None, "ok": True,
             "accuracy": 0.8, "per_task": {"qa": 0.8}, "kept_fraction": 1.0}]
    text = render_report(rows, ["qa"])
    assert "question" not in text and "adopted" not in text and "vanilla" in text


@pytest.mark.filterwarnings("ignore:No artists with labels")  # every job failed: empty plot
def test_command_runs_each_configuration_in_both_modes(monkeypatch, tmp_path, embedded_model):
    """The wiring, no engine: jobs per configuration and mode, the question-outside engines
    with room for every context's cache besides, the prompts each mode is given."""
    import json

    from benchmarks.quality import cli
    from benchmarks.specs import kv_bytes_per_token

    seen = {}

    def fake_run_jobs(module, jobs, **kwargs):
        seen["jobs"], seen["units"] = jobs, kwargs["units"]
        return {job["id"]: JobResult(job["id"], None, "not run here", 0.0) for job in jobs}

    monkeypatch.setattr(cli, "run_jobs", fake_run_jobs)
    out = tmp_path / "q.json"
    assert main(["--model", embedded_model, "--tasks", "passkey", "--samples", "2",
                 "--configs", "snapkv:64+scoring=window", "--question-position", "both",
                 "--output-json", str(out), "--plot", str(tmp_path / "q.png"),
                 "--no-progress"]) == 1  # every job failed
    jobs = seen["jobs"]
    assert [(job["id"], job["question"]) for job in jobs] == [
        ("vanilla", "inside"), ("vanilla (question outside)", "outside"),
        ("snapkv:64+scoring=window", "inside"),
        ("snapkv:64+scoring=window (question outside)", "outside")]
    inside, outside = jobs[2], jobs[3]
    prompts = json.loads(Path(outside["prompts_path"]).read_text())
    assert json.loads(Path(inside["prompts_path"]).read_text()) == prompts  # the same tokens
    room = sum(p["context_tokens"] for p in prompts) * kv_bytes_per_token(
        embedded_model, inside["settings"]["dtype"])
    assert (outside["settings"]["kv_cache_memory_bytes"]
            == inside["settings"]["kv_cache_memory_bytes"] + room)
    assert seen["units"][outside["id"]] == 2 * seen["units"][inside["id"]] == 4
    # vLLM's default in both modes, as a server runs (auto resolves to hybrid inside too)
    assert inside["settings"]["enable_prefix_caching"] is True
    assert outside["settings"]["enable_prefix_caching"] is True
    report = json.loads(out.read_text())
    assert report["workload"]["question_positions"] == ["inside", "outside"]
    assert [(r["label"], r["question"], r["ok"]) for r in report["configs"]] == [
        ("vanilla", "inside", False), ("snapkv:64+scoring=window", "inside", False),
        ("vanilla", "outside", False), ("snapkv:64+scoring=window", "outside", False)]


def test_no_prefix_caching_is_the_question_inside_modes_alone(tmp_path, embedded_model):
    """The question-outside mode adopts each context through the prefix cache: refused."""
    with pytest.raises(SystemExit, match="--no-prefix-caching"):
        main(["--model", embedded_model, "--tasks", "passkey", "--samples", "1",
              "--question-position", "both", "--no-prefix-caching",
              "--output-json", str(tmp_path / "q.json"), "--no-progress"])
