"""The benchmarks' command lines: every ``python -m benchmarks...`` that benchmarks/README.md
names is a module that runs (its ``--help``), and the installed ``kvcompress`` package loads
no benchmark (it must not load scripts from a checkout).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "benchmarks" / "README.md"
# `-m benchmarks.throughput`, `-m benchmarks.studies.kernels` (a line break allowed after -m;
# not the `benchmarks.NAME` placeholder)
COMMAND = re.compile(r"-m\s+(benchmarks(?:\.[a-z_]+)+)(?![.\w])")


def readme_modules() -> list[str]:
    return sorted(set(COMMAND.findall(README.read_text())))


def run_python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         check=True)
    return out.stdout.strip()


def test_the_readme_names_every_benchmark_and_study():
    modules = readme_modules()
    assert {"benchmarks.throughput", "benchmarks.quality", "benchmarks.multi_turn",
            "benchmarks.shared_context", "benchmarks.shared_prefix",
            "benchmarks.streaming_latency", "benchmarks.serve_prefix",
            "benchmarks.results_doc"} <= set(modules)
    studies = {path.stem for path in (ROOT / "benchmarks" / "studies").glob("*.py")}
    studies -= {"__init__", "decode_recall"}  # decode_recall: decode_fidelity's --recall task
    assert {f"benchmarks.studies.{name}" for name in studies} <= set(modules)


def test_every_module_the_readme_names_runs():
    # one interpreter for every --help run (each would otherwise import torch again)
    modules = readme_modules()
    code = (
        "import contextlib, io, runpy, sys\n"
        f"for name in {modules!r}:\n"
        "    sys.argv = [name, '--help']\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "        runpy.run_module(name, run_name='__main__', alter_sys=True)\n"
        "    print(name, out.getvalue().startswith('usage: python -m ' + name))\n"
    )
    assert run_python(code).splitlines() == [f"{name} True" for name in modules]


def test_benchmarks_import_without_vllm():
    code = ("import sys, benchmarks.throughput, benchmarks.quality.cli, "
            "benchmarks.shared_prefix, benchmarks.studies.compression_cost; "
            "print(any(m.startswith('vllm') for m in sys.modules))")
    assert run_python(code) == "False"


def test_kvcompress_cli_has_no_analyze_and_loads_no_benchmark():
    # (torch is fine: the budgets command takes its method names from the policy registry)
    code = ("import sys; from kvcompress.__main__ import COMMANDS, build_parser; build_parser(); "
            "print('analyze' in COMMANDS, "
            "sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'benchmarks'}))")
    assert run_python(code) == "False []"
