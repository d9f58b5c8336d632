"""A stand-in benchmark worker for the job-runner tests: ``python -m tests.benchmarks.fake_worker
--worker JOBS RESULTS``, spawned by ``run_jobs`` from the repository root like the real ones.

Jobs ask for misbehaviour by key: "crash" (hard exit), "raise", "sleep" (seconds).
FAKE_WORKER_EXIT=N in the environment makes it exit with N before any job (a broken worker).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from benchmarks.jobs import Reporter, worker_main


def run_job(job: dict[str, Any], reporter: Reporter) -> dict[str, Any]:
    reporter.progress(1)
    if job.get("crash"):
        os._exit(9)
    if job.get("raise"):
        raise RuntimeError("boom " + job["id"])
    if job.get("sleep"):
        time.sleep(job["sleep"])
    return {"double": 2 * job["value"], "pid": os.getpid()}


if __name__ == "__main__":
    if os.environ.get("FAKE_WORKER_EXIT"):
        sys.exit(int(os.environ["FAKE_WORKER_EXIT"]))
    sys.exit(worker_main(sys.argv[2:], run_job))
