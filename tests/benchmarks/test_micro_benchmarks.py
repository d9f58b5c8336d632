"""Smoke runs of the micro benchmarks: benchmarks.studies.kernels (Triton interpreter) and
benchmarks.studies.compression_cost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_script(args: list[str], env: dict[str, str] | None = None,
               timeout: int = 600) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=timeout, env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_kernels_smoke_checks_every_kernel_against_its_reference(tmp_path):
    out = tmp_path / "kernels.json"
    run_script(["-m", "benchmarks.studies.kernels", "--smoke", "--json", str(out)],
               env={"TRITON_INTERPRET": "1"})
    report = json.loads(out.read_text())
    assert report["meta"]["checks_failed"] == 0 and report["meta"]["mode"] == "smoke"
    sections = {row["section"] for row in report["rows"]}
    assert {"check", "decode", "prefill", "window_scores", "move", "compression_step"} <= sections
    checks = [row for row in report["rows"] if row["section"] == "check"]
    assert len(checks) >= 2 and all(row["extra"]["ok"] for row in checks)
    # the move section times every implementation on one and the same non-empty set of moves
    moves = [row for row in report["rows"] if row["section"] == "move"]
    assert {row["impl"] for row in moves} >= {
        "triton (padded -1 list)", "triton (compacted list)", "torch advanced indexing",
        "torch index_copy_"}
    assert moves[0]["extra"]["moves"] > 0
    assert all(row["case"] == moves[0]["case"] and row["extra"] == moves[0]["extra"]
               for row in moves)


@pytest.mark.slow
def test_compression_cost_smoke(tmp_path, embedded_model):
    out = tmp_path / "cost.json"
    result = run_script([
        "-m", "benchmarks.studies.compression_cost", "--model", embedded_model,
        "--prompt-lens", "256",
        "--num-prompts", "2", "--budget", "32", "--kv-cache-bytes", str(256 << 20),
        "--json", str(out),
    ], env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert "% of prefill" in result.stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert row["prompt_len"] == 256 and row["num_prompts"] == 2
    # 30 layers x 3 KV heads x 2 prompts lose all but ~32 of 256 tokens each
    assert row["tokens_evicted"] > 0.7 * 2 * 30 * 3 * 256
    assert row["score_seconds"] > 0 and row["compaction_seconds"] > 0
    assert 0 < row["compression_fraction"] < 1 and row["uncompressed_seconds"] > 0


@pytest.mark.slow
def test_hybrid_memory_smoke(tmp_path, tiny_gemma3):
    """On tiny Gemma 3 (window 32, 2 of 8 layers full attention) a 600-token prompt at budget
    32: while decoding, kvcompress holds less than vanilla's hybrid manager."""
    out = tmp_path / "hybrid.json"
    run_script(["-m", "benchmarks.studies.hybrid_memory", "--model", tiny_gemma3, "--prompt-lens",
                "600", "--budget", "32", "--max-num-batched-tokens", "256",
                "--kv-cache-bytes", str(16 << 20), "--json", str(out)])
    row = json.loads(out.read_text())["rows"][0]
    assert row["prompt_len"] == 600
    assert 0 < row["kvcompress_decode_bytes"] < row["vanilla_decode_bytes"]
    assert row["x_vanilla"] > 1.5
