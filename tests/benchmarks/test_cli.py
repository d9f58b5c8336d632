"""The benchmarks' command lines: ``python -m benchmarks.NAME`` from the repository root.

The attention analysis runs as ``python -m benchmarks.attention_analysis``; the installed
``kvcompress`` package has no ``analyze`` command (it must not load scripts from a checkout).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import attention_analysis

ROOT = Path(__file__).resolve().parents[2]
MODULES = ("throughput", "quality", "attention_analysis", "compression_cost", "kernels",
           "decode_fidelity", "retention_analysis")


def run_python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         check=True)
    return out.stdout.strip()


def test_attention_analysis_parses_its_flags():
    args = attention_analysis.build_parser().parse_args(
        ["--length", "512", "--budgets", "64,128", "--methods", "snapkv"])
    assert (args.length, args.budgets, args.methods) == (512, "64,128", "snapkv")


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--inputs", "bogus"], "bogus"), (["--methods", "h2o"], "h2o"),
     (["--window", "100", "--budgets", "64"], "--window"),
     (["--length", "9000"], "context")],
)
def test_attention_analysis_rejects_bad_arguments_before_loading_anything(monkeypatch, extra,
                                                                          message):
    def no_model(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(attention_analysis, "load_model", no_model)
    monkeypatch.setattr(attention_analysis, "install_attention", no_model)
    with pytest.raises(SystemExit) as error:
        attention_analysis.main(extra)
    assert isinstance(error.value.code, str) and error.value.code.startswith("error: ")
    assert message in error.value.code


def test_every_benchmark_runs_as_a_module():
    # one interpreter for all five --help runs (each would otherwise import torch again)
    code = (
        "import contextlib, io, runpy, sys\n"
        f"for name in {MODULES!r}:\n"
        "    sys.argv = [name, '--help']\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "        runpy.run_module('benchmarks.' + name, run_name='__main__', alter_sys=True)\n"
        "    print(name, out.getvalue().startswith('usage:'))\n"
    )
    assert run_python(code).splitlines() == [f"{name} True" for name in MODULES]


def test_benchmarks_import_without_vllm():
    code = ("import sys, benchmarks.throughput, benchmarks.quality.cli, "
            "benchmarks.attention_analysis, benchmarks.compression_cost; "
            "print(any(m.startswith('vllm') for m in sys.modules))")
    assert run_python(code) == "False"


def test_kvcompress_cli_has_no_analyze_and_loads_no_benchmark():
    # (torch is fine: the budgets command takes its method names from the policy registry)
    code = ("import sys; from kvcompress.__main__ import COMMANDS, build_parser; build_parser(); "
            "print('analyze' in COMMANDS, "
            "sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'benchmarks'}))")
    assert run_python(code) == "False []"
