"""``python -m kvcompress budgets``: table, totals and argument errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvcompress.__main__ import main
from kvcompress.policies import METHODS

ANCHOR = ["budgets", "--layers", "32", "--prompt-len", "4000", "--kv-budget", "128",
          "--kv-pyramid-beta", "20"]


def test_budgets_table_and_exact_total(capsys):
    assert main(ANCHOR) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out if line.split() and line.split()[0].isdigit()]
    assert len(rows) == 32
    assert [int(row[0]) for row in rows] == list(range(32))
    kept = [int(row[1]) for row in rows]
    assert sum(kept) == 4096 and kept[0] == 242 and kept[-1] == 14
    assert "total kept per head: 4096 = 32 x 128" in "\n".join(out)


def test_ratio_and_method_flags(capsys):
    args = ["budgets", "--layers", "4", "--prompt-len", "1000", "--kv-compression-ratio", "0.9"]
    assert main([*args, "--method", "snapkv", "--kv-window", "16"]) == 0
    out = capsys.readouterr().out
    assert "total kept per head: 400 = 4 x 100" in out


def test_adakv_totals_flag(capsys):
    def kept(*extra):
        assert main([*ANCHOR, "--method", "adakv", *extra]) == 0
        out = capsys.readouterr().out.splitlines()
        return [int(line.split()[1]) for line in out if line.split() and line.split()[0].isdigit()]

    assert kept()[0] == 242 and kept("--kv-adakv-totals", "uniform") == [128] * 32


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--kv-window", "200"], "--kv-budget"),
        (["--kv-pyramid-beta", "0.5"], "--kv-pyramid-beta"),
        (["--method", "h2o"], "--method"),
        (["--layers", "0"], "--layers"),
    ],
)
def test_bad_flags_exit_with_a_message_naming_the_flag(capsys, extra, flag):
    with pytest.raises(SystemExit) as exited:
        main([*ANCHOR, *extra])
    assert exited.value.code == 2
    assert flag in capsys.readouterr().err


def test_method_choices_are_the_registered_methods(capsys):
    with pytest.raises(SystemExit):
        main([*ANCHOR, "--method", "h2o"])
    error = capsys.readouterr().err
    assert all(name in error for name in METHODS)


def test_budget_and_ratio_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        main([*ANCHOR, "--kv-compression-ratio", "0.5"])
    assert "not allowed with" in capsys.readouterr().err


def test_module_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "kvcompress", *ANCHOR, "--method", "adakv"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "4096 = 32 x 128" in result.stdout
