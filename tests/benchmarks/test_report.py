"""Tables, JSON and run metadata."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from benchmarks.report import command_string, format_table, write_json


def test_format_table_aligns_numbers_right_text_left():
    rows = [{"name": "a", "x": 1.5, "n": None}, {"name": "long-name", "x": 12.25, "n": 3}]
    lines = format_table(rows, [("name", "config"), ("x", "x"), ("n", "n")]).splitlines()
    assert lines[0].split() == ["config", "x", "n"]
    assert lines[2] == "a           1.50  -"
    assert lines[3] == "long-name  12.25  3"


def test_write_json_round_trip(tmp_path):
    path = write_json(tmp_path / "sub" / "r.json", {"p": Path("/x"), "v": [1.0, None]})
    assert json.loads(path.read_text()) == {"p": "/x", "v": [1.0, None]}


def test_command_string_names_the_module_it_ran_as(monkeypatch):
    python = Path(sys.executable).name
    main = SimpleNamespace(__spec__=SimpleNamespace(name="benchmarks.quality.__main__"))
    monkeypatch.setitem(sys.modules, "__main__", main)
    argv = ["/repo/benchmarks/quality/__main__.py", "--samples", "2", "--tasks", "a b"]
    assert command_string(argv) == f"{python} -m benchmarks.quality --samples 2 --tasks 'a b'"
    monkeypatch.setitem(sys.modules, "__main__", SimpleNamespace(__spec__=None))
    assert command_string(["tool.py", "-x"]) == f"{python} tool.py -x"
