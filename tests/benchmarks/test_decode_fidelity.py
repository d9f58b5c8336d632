"""Decode fidelity scoring (prefix and positional agreement with the full cache) and the
--recall task: script building, answer parsing, the forcing logits processor, scoring."""

from __future__ import annotations

import json

import pytest

from benchmarks.jobs import JobResult
from benchmarks.specs import CompressionSpec
from benchmarks.studies.decode_fidelity import agreement, score


def test_agreement_counts_the_common_prefix_and_positional_matches():
    reference = [1, 2, 3, 4, 5, 6, 7, 8]
    assert agreement(reference, reference, 8) == (1.0, 1.0)
    assert agreement(reference, [1, 2, 9, 4, 5, 6, 7, 8], 8) == (2 / 8, 7 / 8)
    assert agreement(reference, [1, 2, 9, 4], 4) == (2 / 4, 3 / 4)
    assert agreement(reference, [0] * 8, 8) == (0.0, 0.0)


def test_score_averages_over_prompts_and_reports_failures():
    specs = [CompressionSpec(), CompressionSpec.parse("pyramidkv:999@h2o:4"),
             CompressionSpec.parse("pyramidkv:999@window:4")]
    results = {
        "vanilla": JobResult("vanilla", {"token_ids": [[1, 2, 3, 4], [5, 6, 7, 8]],
                                         "generate_s": 1.0}, None, 1.0),
        "pyramidkv:999@h2o:4": JobResult("x", {"token_ids": [[1, 2, 3, 4], [5, 0, 7, 8]],
                                               "generate_s": 1.0}, None, 1.0),
        "pyramidkv:999@window:4": JobResult("y", None, "boom", 1.0),
    }
    vanilla, h2o, window = score(specs, results, [2, 4])
    assert vanilla["prefix@4"] == 1.0
    assert h2o["prefix@2"] == pytest.approx(0.75) and h2o["prefix@4"] == pytest.approx(0.625)
    assert h2o["match@4"] == pytest.approx(7 / 8)
    assert not window["ok"] and window["error"] == "boom" and "prefix@4" not in window


# ----------------------------------------------------------------------------- --recall
def test_recall_prompts_put_the_code_only_in_the_generated_script(smollm_tokenizer):
    from benchmarks.studies.decode_recall import QUESTION, recall_prompts

    prompts = recall_prompts(smollm_tokenizer, 3, filler_tokens=200, seed=1)
    assert len({p.code for p in prompts}) == 3  # a code of its own per prompt
    assert [p.code for p in recall_prompts(smollm_tokenizer, 3, 200, seed=1)] == [
        p.code for p in prompts]  # seeded
    for prompt in prompts:
        asked = smollm_tokenizer.decode(prompt.prompt_token_ids)
        script = smollm_tokenizer.decode(prompt.forced_tokens)
        assert len(prompt.code) == 5 and prompt.code not in asked
        assert "secret code" in asked and asked.rstrip().endswith("assistant")
        # the code early, once, digits nowhere else; the question last
        assert script.index(prompt.code) < 60 and script.count(prompt.code) == 1
        assert sum(c.isdigit() for c in script) == 5
        assert script.endswith(QUESTION)
        assert 200 <= len(prompt.forced_tokens) <= 200 + 40
        assert prompt.max_tokens > len(prompt.forced_tokens)
    assert len({tuple(p.forced_tokens[20:]) for p in prompts}) == 3  # fillers differ


@pytest.mark.parametrize(("answer", "number", "recalled"), [
    (" 48213. The secret code", "48213", True),
    (" 48213", "48213", True),
    ("48213, I said.", "48213", True),
    (" 482130.", "482130", False),   # a longer number holding the code is wrong
    (" 4821.", "4821", False),
    (" 12345, not 48213", "12345", False),  # only the first number counts
    (" I forgot.", None, False),
])
def test_recall_answer_parsing(answer, number, recalled):
    from benchmarks.studies.decode_recall import first_number, is_recalled

    assert first_number(answer) == number
    assert is_recalled(answer, "48213") is recalled


@pytest.mark.parametrize(("answer", "share"), [
    (" 48213.", 1.0), (" 482.", 0.6), (" 4888888", 0.4), (" 4111", 0.2), (" 482130", 1.0),
    (" 58213", 0.0), (" I forgot.", 0.0),
])
def test_leading_digits_give_partial_credit(answer, share):
    from benchmarks.studies.decode_recall import leading_digits_recalled

    assert leading_digits_recalled(answer, "48213") == pytest.approx(share)


def batch_update(added=(), removed=(), moved=()):
    from vllm.v1.sample.logits_processor import BatchUpdate

    return BatchUpdate(batch_size=4, removed=list(removed), added=list(added), moved=list(moved))


def scripted(script):
    from vllm import SamplingParams

    return SamplingParams(extra_args={"forced_tokens": script} if script is not None else None)


def test_forced_script_processor_forces_the_script_then_lets_go():
    import torch

    from benchmarks.studies.decode_recall import ForcedScriptProcessor

    processor = ForcedScriptProcessor(None, torch.device("cpu"), False)
    assert not processor.is_argmax_invariant()
    first_output, other_output = [], []
    processor.update_state(batch_update(added=[(0, scripted([3, 1]), [9], first_output),
                                               (1, scripted(None), [9], other_output)]))
    free = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    for forced in (3, 1):
        logits = processor.apply(free.clone())
        assert logits[0].argmax().item() == forced
        assert torch.isinf(logits[0]).sum().item() == 5  # every other token is impossible
        assert torch.equal(logits[1], free[1])  # an unscripted request is left alone
        first_output.append(forced)  # vLLM appends the sampled token to the live list
        processor.update_state(None)
    assert torch.equal(processor.apply(free.clone()), free)  # past the script: free


def test_forced_script_processor_follows_moves_swaps_and_removals():
    import torch
    from vllm.v1.sample.logits_processor import MoveDirectionality

    from benchmarks.studies.decode_recall import ForcedScriptProcessor

    processor = ForcedScriptProcessor(None, torch.device("cpu"), False)
    processor.update_state(batch_update(added=[(0, scripted([2]), None, []),
                                               (1, scripted([4]), None, [])]))
    processor.update_state(batch_update(moved=[(0, 1, MoveDirectionality.SWAP)]))
    logits = processor.apply(torch.zeros(2, 6))
    assert logits.argmax(dim=1).tolist() == [4, 2]
    # the batch is condensed: row 0 finishes, row 1 moves into it
    processor.update_state(batch_update(removed=[0],
                                        moved=[(1, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    logits = processor.apply(torch.zeros(2, 6))
    assert logits[0].argmax().item() == 2 and torch.equal(logits[1], torch.zeros(6))
    # a new request without a script takes over a scripted row
    processor.update_state(batch_update(added=[(0, scripted(None), None, [])]))
    assert torch.equal(processor.apply(torch.zeros(2, 6)), torch.zeros(2, 6))


def test_forced_script_processor_rejects_a_malformed_script():
    from benchmarks.studies.decode_recall import ForcedScriptProcessor

    ForcedScriptProcessor.validate_params(scripted([1, 2]))
    ForcedScriptProcessor.validate_params(scripted(None))
    for bad in ("12", [1, "2"], [-1]):
        with pytest.raises(ValueError, match="forced_tokens"):
            ForcedScriptProcessor.validate_params(scripted(bad))


class CharTokenizer:
    """Token id = character code (enough for scoring)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def test_recall_scoring_accuracy_interval_and_paired_difference():
    from benchmarks.studies.decode_fidelity import score_recall_runs
    from benchmarks.studies.decode_recall import RecallPrompt

    script = [ord(c) for c in "code 123? "]
    recall = [RecallPrompt([0], script, code) for code in ("11111", "22222")]
    right = [script + [ord(c) for c in code + "."] for code in ("11111", "22222")]
    specs = [CompressionSpec(), CompressionSpec.parse("pyramidkv:999@h2o:4"),
             CompressionSpec.parse("pyramidkv:999@window:4")]
    results = {
        "vanilla": JobResult("vanilla", {"token_ids": right, "generate_s": 1.0}, None, 1.0),
        "pyramidkv:999@h2o:4": JobResult("x", {"token_ids": [
            right[0], [ord(c) for c in "code 999? 12345"]], "generate_s": 2.0}, None, 1.0),
        "pyramidkv:999@window:4": JobResult("y", None, "boom", 1.0),
    }
    full, h2o, window = score_recall_runs(specs, results, recall, CharTokenizer())
    assert full["accuracy"] == 1.0 and full["script_followed"] == 1.0
    assert full["answers"] == ["11111.", "22222."]
    assert full["interval"][1] == 1.0 and 0.0 < full["interval"][0] < 1.0
    assert full["vs_full"]["mean"] == 0.0
    # the second left the script (reported) and answered wrong: scored on what follows it
    assert h2o["scores"] == [1.0, 0.0] and h2o["script_followed"] == 0.5
    assert h2o["vs_full"]["mean"] == -0.5
    assert h2o["leading_digits"] == pytest.approx(0.5)  # "12345" shares no digit with 22222
    assert not window["ok"] and "accuracy" not in window and "vs_full" not in window


@pytest.mark.slow
def test_decode_recall_end_to_end(tmp_path, embedded_model):
    from tests.benchmarks.test_end_to_end import run_script

    out = tmp_path / "recall.json"
    run_script([
        "-m", "benchmarks.studies.decode_fidelity", "--recall", "--model", embedded_model,
        "--num-prompts", "2", "--recall-filler-tokens", "200",
        "--configs", "pyramidkv:100000@window:64", "--output-json", str(out), "--no-progress",
    ])
    report = json.loads(out.read_text())
    rows = {row["label"]: row for row in report["configs"]}
    assert list(rows) == ["vanilla", "pyramidkv:100000@window:64"]
    for row in rows.values():
        assert row["ok"] and 0.0 <= row["accuracy"] <= 1.0 and row["n"] == 2
        assert row["script_followed"] == 1.0  # the forcing holds under eviction too
    assert rows["vanilla"]["accuracy"] > 0.0
    assert report["workload"]["filler_tokens"] == 200
