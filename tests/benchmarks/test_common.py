"""Shared helpers: configuration specs, tables, JSON, and the worker-process job runner."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from common import (
    CompressionSpec,
    format_table,
    parse_kv_options,
    parse_specs,
    read_results,
    run_jobs,
    worker_env,
    write_json,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("vanilla", CompressionSpec()),
        ("none", CompressionSpec()),
        ("pyramidkv:128", CompressionSpec("pyramidkv", budget=128)),
        ("snapkv:budget=64", CompressionSpec("snapkv", budget=64)),
        ("AdaKV:r=0.875", CompressionSpec("adakv", ratio=0.875)),
    ],
)
def test_spec_parse(text, expected):
    assert CompressionSpec.parse(text) == expected


@pytest.mark.parametrize("text", ["h2o:128", "snapkv", "snapkv:r=1.5", "snapkv:0", "snapkv:x=3"])
def test_spec_parse_rejects(text):
    with pytest.raises(ValueError):
        CompressionSpec.parse(text)


def test_spec_labels_and_additional_config():
    ratio = CompressionSpec("pyramidkv", ratio=0.875)
    assert ratio.label == "pyramidkv:r=0.875"
    assert ratio.compression_factor == pytest.approx(8.0)
    assert ratio.additional_config({"kv_window": 16}) == {
        "kv_compression": "pyramidkv", "kv_window": 16, "kv_compression_ratio": 0.875}
    budget = CompressionSpec("snapkv", budget=64)
    assert budget.additional_config() == {"kv_compression": "snapkv", "kv_budget": 64}
    assert budget.compression_factor is None
    assert CompressionSpec().additional_config({"kv_window": 16}) == {}
    assert CompressionSpec().label == "vanilla"


def test_parse_specs_rejects_duplicates():
    assert [s.label for s in parse_specs("vanilla, snapkv:64")] == ["vanilla", "snapkv:64"]
    with pytest.raises(ValueError, match="duplicate"):
        parse_specs("snapkv:64,snapkv:budget=64")


def test_parse_kv_options():
    assert parse_kv_options(["kv_window=16", "kv_pooling=avg", "kv_pyramid_beta=2.5"]) == {
        "kv_window": 16, "kv_pooling": "avg", "kv_pyramid_beta": 2.5}
    for bad in ("kv_windw=16", "window=16", "kv_budget=64", "kv_window"):
        with pytest.raises(SystemExit, match="--kv-option"):
            parse_kv_options([bad])


def test_format_table_aligns_numbers_right_text_left():
    rows = [{"name": "a", "x": 1.5, "n": None}, {"name": "long-name", "x": 12.25, "n": 3}]
    lines = format_table(rows, [("name", "config"), ("x", "x"), ("n", "n")]).splitlines()
    assert lines[0].split() == ["config", "x", "n"]
    assert lines[2] == "a           1.50  -"
    assert lines[3] == "long-name  12.25  3"


def test_write_json_round_trip(tmp_path):
    path = write_json(tmp_path / "sub" / "r.json", {"p": Path("/x"), "v": [1.0, None]})
    assert json.loads(path.read_text()) == {"p": "/x", "v": [1.0, None]}


def test_worker_env_threads_and_inprocess():
    env = worker_env(verbose=False, multiprocess=False, threads=1)
    assert env["OMP_NUM_THREADS"] == "1" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert worker_env(verbose=False, multiprocess=True, threads=1)[
        "VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


FAKE_WORKER = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {bench!r})
    from common import worker_main

    def run_job(job, reporter):
        reporter.progress(1)
        if job.get("crash"):
            os._exit(9)
        if job.get("raise"):
            raise RuntimeError("boom " + job["id"])
        if job.get("sleep"):
            time.sleep(job["sleep"])
        return {{"double": 2 * job["value"], "pid": os.getpid()}}

    if __name__ == "__main__":
        sys.exit(worker_main(sys.argv[2:], run_job))
    """
)


def run_fake(tmp_path, jobs, timeout=60.0):
    script = tmp_path / "fake_worker.py"
    bench = str(Path(__file__).resolve().parents[2] / "benchmarks")
    script.write_text(FAKE_WORKER.format(bench=bench))
    return run_jobs(
        script, jobs, workdir=tmp_path / "work", log_path=tmp_path / "log.txt",
        units={job["id"]: 1 for job in jobs}, job_timeout=timeout,
        env={**worker_env(False, False), "PYTHONPATH": ""}, desc="t", show_progress=False,
    )


def test_run_jobs_survives_crash_error_and_timeout(tmp_path):
    jobs = [
        {"id": "a", "value": 1},
        {"id": "crash", "value": 0, "crash": True},
        {"id": "b", "value": 2},
        {"id": "raise", "value": 0, "raise": True},
        {"id": "hang", "value": 0, "sleep": 60},
        {"id": "c", "value": 3},
    ]
    results = run_fake(tmp_path, jobs, timeout=3.0)
    assert [results[k].result["double"] for k in "abc"] == [2, 4, 6]
    assert "status 9" in results["crash"].error
    assert "boom raise" in results["raise"].error
    assert "timed out" in results["hang"].error
    # a shared worker runs consecutive jobs; each failure starts a fresh one
    assert results["a"].result["pid"] != results["b"].result["pid"]
    assert results["b"].result["pid"] != results["c"].result["pid"]


def test_run_jobs_isolate_uses_one_process_per_job(tmp_path):
    jobs = [{"id": str(i), "value": i, "isolate": True} for i in range(3)]
    results = run_fake(tmp_path, jobs)
    assert len({results[str(i)].result["pid"] for i in range(3)}) == 3
    assert [r.job_id for r in read_results(tmp_path / "work" / "results.jsonl")] == ["0", "1", "2"]


def test_run_jobs_reports_a_worker_that_cannot_start(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("import sys\nsys.exit(5)\n")
    results = run_jobs(
        script, [{"id": "x"}, {"id": "y"}], workdir=tmp_path / "w", log_path=tmp_path / "l",
        units={"x": 1, "y": 1}, job_timeout=10, env=worker_env(False, False), desc="t",
        show_progress=False,
    )
    assert set(results) == {"x", "y"}
    assert all("status 5" in r.error for r in results.values())


def test_scripts_import_without_vllm():
    code = ("import sys; sys.path.insert(0, 'benchmarks'); "
            "import throughput, quality, attention_analysis; "
            "print(any(m.startswith('vllm') for m in sys.modules))")
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], check=True)
    assert out.stdout.strip() == "False"
