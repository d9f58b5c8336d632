"""One tiny end-to-end run per script (real engines / real model): JSON keys and sane values."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def run_script(args: list[str], timeout: int = 400) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_throughput_end_to_end(tmp_path, embedded_model):
    out = tmp_path / "throughput.json"
    run_script([
        "-m", "benchmarks.throughput", "--model", embedded_model, "--workload", "random",
        "--configs", "vanilla,pyramidkv:r=0.75", "--num-prompts", "3", "--input-len", "96",
        "--output-len", "6", "--kv-cache-tokens", "512", "--max-num-batched-tokens", "512",
        "--output-json", str(out), "--no-progress",
    ])
    report = json.loads(out.read_text())
    assert {"command", "machine", "settings", "workload", "configs", "runtime_s",
            "kv_tokens_per_request_derivation"} <= set(report)
    vanilla, compressed = report["configs"]
    assert [vanilla["label"], compressed["label"]] == ["vanilla", "pyramidkv:r=0.75"]
    for row in (vanilla, compressed):
        assert row["ok"] and row["all_outputs_full_length"]
        assert row["output_tokens"] == 18 and row["prompt_tokens"] == 3 * 96
        assert row["output_tok_s"] > 0 and row["total_tok_s"] > row["output_tok_s"]
        assert row["peak_running"] >= 1 and row["steps"] >= 6
        assert row["mean_kv_tokens_per_running"] > 0
        assert row["cached_tokens"] == 0  # random prompts share no prefix
        # the prefill-only pass ran, and decoding is not free
        assert 0 < row["prefill_only_s"] < row["elapsed_s"]
        assert 0 < row["cap"]["reached"] < 1
    assert compressed["preempted_tokens"] == 0 and vanilla["preempted_tokens"] is None
    assert compressed["vs_vanilla"]["output_tok_s"] == pytest.approx(
        compressed["output_tok_s"] / vanilla["output_tok_s"])
    assert compressed["prompt_compression"] == pytest.approx(4.0)
    # pages of 16 tokens holding a quarter of each prompt vs vLLM's 128-token blocks
    assert compressed["mean_kv_tokens_per_running"] < vanilla["mean_kv_tokens_per_running"]
    assert compressed["vs_vanilla"]["mean_kv_tokens_per_running"] < 1.0


def test_memory_sweep_end_to_end(tmp_path, embedded_model):
    out = tmp_path / "sweep.json"
    run_script([
        "-m", "benchmarks.throughput", "--model", embedded_model, "--sweep-kv-memory",
        "--sweep-points", "4,12", "--num-prompts", "4", "--input-len", "64",
        "--output-len", "4", "--max-num-batched-tokens", "128", "--output-json", str(out),
        "--no-progress",
    ])
    rows = json.loads(out.read_text())["configs"]
    assert [(row["kv_cache_tokens"], row["label"]) for row in rows] == [
        (272, "vanilla"), (272, "pyramidkv:r=0.875"), (816, "vanilla"),
        (816, "pyramidkv:r=0.875")]
    assert all(row["ok"] and row["all_outputs_full_length"] for row in rows)
    # each point's compressed run over the vanilla run on the same memory
    for vanilla, compressed in (rows[:2], rows[2:]):
        assert compressed["vs_vanilla"]["output_tok_s"] == pytest.approx(
            compressed["output_tok_s"] / vanilla["output_tok_s"])
    # a tight pool runs fewer requests at once than an ample one
    assert rows[0]["peak_running"] < rows[2]["peak_running"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_quality_end_to_end(tmp_path, embedded_model):
    out, png = tmp_path / "quality.json", tmp_path / "quality.png"
    result = run_script([
        "-m", "benchmarks.quality", "--model", embedded_model, "--tasks", "niah_single,qa",
        "--lengths", "256", "--samples", "2", "--methods", "pyramidkv", "--budgets", "32,4096",
        "--output-json", str(out), "--plot", str(png), "--no-progress",
    ])
    assert "2 engine runs (1 budgets >= every prompt not run)" in result.stdout
    report = json.loads(out.read_text())
    assert {"command", "machine", "settings", "workload", "configs", "samples"} <= set(report)
    rows = {row["label"]: row for row in report["configs"]}
    assert list(rows) == ["vanilla", "pyramidkv:32", "pyramidkv:4096"]
    full, small, skipped = rows["vanilla"], rows["pyramidkv:32"], rows["pyramidkv:4096"]
    assert all(row["ok"] for row in rows.values())
    assert full["fidelity"] == 1.0 and full["exact_match_full"] == 1.0
    assert full["accuracy"] > 0 and full["retained"] == 1.0  # the model finds needles at 256
    assert set(full["per_task"]) == {"niah_single", "qa"} and len(full["scores"]) == 4
    assert 0.0 <= small["fidelity"] <= 1.0 and small["kept_fraction"] < 0.2
    assert skipped["not_run"] and skipped["accuracy"] == full["accuracy"]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_quality_question_outside_end_to_end(tmp_path, embedded_model):
    """kvpress's evaluation: each context compressed alone, its question asked from the
    compressed cache (an adoption through the prefix cache), checked by the plugin's figures
    and vLLM's cached tokens."""
    out = tmp_path / "quality.json"
    run_script([
        "-m", "benchmarks.quality", "--model", embedded_model, "--tasks", "passkey",
        "--lengths", "256", "--samples", "2", "--configs", "snapkv:32+scoring=window",
        "--question-position", "outside", "--output-json", str(out),
        "--plot", str(tmp_path / "quality.png"), "--no-progress",
    ])
    rows = {row["label"]: row for row in json.loads(out.read_text())["configs"]}
    assert list(rows) == ["vanilla", "snapkv:32+scoring=window"]
    full, compressed = rows["vanilla"], rows["snapkv:32+scoring=window"]
    assert all(row["ok"] and row["question"] == "outside" for row in rows.values())
    adoption = compressed["adoption"]
    assert adoption["contexts_compressed"] == 2 and adoption["hits"] == 2
    assert adoption["misses"] == [] and adoption["cached_tokens_mean"] >= 200
    assert adoption["question_figures"]["adopted_tokens"] >= 400
    assert not full["adoption"]["applies"] and full["fidelity"] == 1.0


def test_decode_fidelity_end_to_end(tmp_path, embedded_model):
    out = tmp_path / "fidelity.json"
    # 80 tokens: the window policy (budget 8, interval 64) evicts once, h2o (budget 40) never
    run_script([
        "-m", "benchmarks.studies.decode_fidelity", "--model", embedded_model, "--num-prompts", "2",
        "--output-len", "80", "--configs", "pyramidkv:100000@window:8,pyramidkv:100000@h2o:40",
        "--output-json", str(out), "--no-progress",
    ])
    report = json.loads(out.read_text())
    rows = {row["label"]: row for row in report["configs"]}
    assert list(rows) == ["vanilla", "pyramidkv:100000@window:8", "pyramidkv:100000@h2o:40"]
    assert all(row["ok"] for row in rows.values())
    # nothing evicted in 80 tokens: the full cache's output exactly (vanilla is the reference:
    # its own figures are 1 by construction)
    assert rows["pyramidkv:100000@h2o:40"]["prefix@80"] == 1.0
    window = rows["pyramidkv:100000@window:8"]
    assert 0.0 <= window["prefix@80"] <= window["match@80"] <= 1.0


def test_shared_prefix_system_prompt_end_to_end(tmp_path, embedded_model):
    out = tmp_path / "shared_prefix.json"
    run_script([
        "-m", "benchmarks.shared_prefix", "--model", embedded_model, "--workload",
        "system-prompt", "--configs", "vanilla,pyramidkv:r=0.75", "--requests", "3",
        "--arrivals", "concurrent,staggered", "--doc-tokens", "300", "--question-tokens", "40",
        "--answer-tokens", "4", "--kv-pools", "2,20M", "--output-json", str(out),
        "--no-progress",
    ], timeout=900)
    report = json.loads(out.read_text())
    assert report["workload"]["kind"] == "system-prompt"
    assert "kv_held_derivation" in report and set(report["settings"]["kv_pools"]) == {"2x", "20M"}
    rows = report["configs"]
    assert [(r["pool"], r["label"]) for r in rows] == [
        ("2x", "vanilla"), ("2x", "pyramidkv:r=0.75"), ("20M", "vanilla"),
        ("20M", "pyramidkv:r=0.75")]
    for row in rows:
        assert row["ok"], row.get("error")
        assert [s["scenario"] for s in row["scenarios"]] == ["n3-concurrent", "n3-staggered"]
        for figures in row["scenarios"]:
            assert figures["output_tokens"] == 12 and figures["kv_held_per_request"] > 0
            assert figures["peak_kv_held"] <= row["kv_cache_memory_bytes"]
            assert figures["vs_vanilla"]["kv_held_per_request"] is not None
    # vanilla reads the running first request's prefix blocks: the staggered readers find
    # it cached
    staggered = rows[0]["scenarios"][1]
    assert staggered["requests_with_cache_hit"] >= 2
