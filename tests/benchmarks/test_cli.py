"""``python -m kvcompress analyze`` is wired to benchmarks/attention_analysis.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvcompress.__main__ import build_parser, main


def test_analyze_subcommand_parses_the_script_flags():
    args = build_parser().parse_args(["analyze", "--length", "512", "--budgets", "64,128"])
    assert args.length == 512 and args.budgets == "64,128" and args.command == "analyze"


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--inputs", "bogus"], "bogus"), (["--methods", "h2o"], "h2o"),
     (["--window", "100", "--budgets", "64"], "--window"),
     (["--length", "9000"], "context")],
)
def test_analyze_rejects_bad_arguments_before_loading_anything(capsys, extra, message):
    with pytest.raises(SystemExit) as error:
        main(["analyze", *extra])
    assert error.value.code == 2
    assert message in capsys.readouterr().err


def test_help_stays_free_of_vllm():
    code = ("import sys; from kvcompress.__main__ import build_parser; build_parser(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
