"""The worker-process job runner: crashes, errors, hangs and broken workers cost one job."""

from __future__ import annotations

import pytest

from benchmarks.jobs import cpu_binding, read_results, run_jobs, worker_env

FAKE_WORKER = "tests.benchmarks.fake_worker"


def run_fake(tmp_path, jobs, timeout=60.0, **env):
    return run_jobs(
        FAKE_WORKER, jobs, workdir=tmp_path / "work", log_path=tmp_path / "log.txt",
        units={job["id"]: 1 for job in jobs}, job_timeout=timeout,
        env={**worker_env(False, False), **env}, desc="t", show_progress=False,
    )


def test_worker_env_threads_and_inprocess():
    env = worker_env(verbose=False, multiprocess=False, threads=1)
    assert env["OMP_NUM_THREADS"] == "1" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert worker_env(verbose=False, multiprocess=True, threads=1)[
        "VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


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
    results = run_fake(tmp_path, [{"id": "x"}, {"id": "y"}], timeout=10, FAKE_WORKER_EXIT="5")
    assert set(results) == {"x", "y"}
    assert all("status 5" in r.error for r in results.values())


def test_tensor_parallel_ranks_get_their_own_cores(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1, 2, 3, 5})
    assert cpu_binding(2) == "0,1|2,3"
    assert worker_env(False, False, ranks=2)["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in worker_env(False, False)
    with pytest.raises(SystemExit, match="6 tensor-parallel ranks need at least 6"):
        cpu_binding(6)
