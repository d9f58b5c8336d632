"""docs/results.md: generated from benchmarks/results and current (the README's headline table
too), every result shown once, provenance as recorded or "not recorded", the stale rule."""

from __future__ import annotations

import datetime

import pytest

from benchmarks.report import format_table, machine_info, markdown_tables
from benchmarks.results_doc import document, provenance
from benchmarks.results_doc.document import (
    NOTES_DIR,
    build_doc,
    result_block,
    section_files,
    stale_outputs,
    unassigned_results,
)
from benchmarks.results_doc.provenance import CHANGES, Change, Provenance, stale_reasons
from benchmarks.results_doc.sections import HEADLINES, SECTIONS, Section


def test_results_doc_and_readme_headline_are_current():
    diffs = stale_outputs()
    assert not diffs, ("run `python -m benchmarks.results_doc`:\n"
                       + "\n".join(diff[:3000] for diff in diffs.values()))


def test_every_result_is_shown_by_exactly_one_section():
    assert unassigned_results() == []
    names = [name for section in SECTIONS for name in section_files(section)]
    assert len(names) == len(set(names))
    assert len({section.key for section in SECTIONS}) == len(SECTIONS)


def test_notes_and_ledger_name_real_sections():
    keys = {section.key for section in SECTIONS}
    assert {path.stem for path in NOTES_DIR.glob("*.md")} <= keys | {"intro"}
    for change in CHANGES:
        assert set(change.sections) <= keys, change.commit
    assert [c.time for c in CHANGES] == sorted(c.time for c in CHANGES)
    for row in HEADLINES:
        section = next(s for s in SECTIONS if s.key == row.section)
        assert row.file in section_files(section)


def _report(date: str | None = "2026-12-01T12:00:00+00:00", **machine) -> dict:
    report = {"command": "python -m benchmarks.throughput", "settings": {"dtype": "float32"},
              "configs": []}
    if date is not None:
        report["machine"] = {"date": date, "cpu_model": "CPU X", "cpu_count": 2, **machine}
    return report


def test_stale_rule(monkeypatch):
    change = Change("abc1234", "2026-12-02T00:00:00+00:00", "a default changed",
                    ("throughput",), measured_by=("measured.json",))
    bf16_only = Change("def5678", "2026-12-03T00:00:00+00:00", "bf16 pages",
                       ("throughput",), dtypes=("bfloat16",))
    monkeypatch.setattr(provenance, "CHANGES", (change, bf16_only))
    before = _report("2026-12-01T12:00:00+00:00")
    after = _report("2026-12-02T12:00:00+00:00")
    reasons = stale_reasons("throughput", "old.json", before)
    assert len(reasons) == 1 and "abc1234" in reasons[0] and "a default changed" in reasons[0]
    assert stale_reasons("quality", "old.json", before) == []  # another section's change
    assert stale_reasons("throughput", "measured.json", before) == []  # ran on the change
    assert stale_reasons("throughput", "new.json", after) == []  # float32: not bf16's change
    after["settings"]["dtype"] = "bfloat16"
    assert [r[:18] for r in stale_reasons("throughput", "new.json", after)] == [
        "ran before def5678"]
    no_date = _report(None)
    assert any("no date" in r for r in stale_reasons("throughput", "x.json", no_date))
    del no_date["command"]
    assert any("no command" in r for r in stale_reasons("throughput", "x.json", no_date))


def test_provenance_says_not_recorded_and_never_invents(monkeypatch):
    section = Section("throughput", "T", ("x.json",), lambda report: "| a |\n|---|")
    block = result_block(section, "x.json", {"rows": []})
    assert "- command: not recorded" in block and "- commit: not recorded" in block
    assert "- machine: not recorded" in block and "- started: not recorded" in block
    assert "**(stale)**" in block
    recorded = _report("2026-12-05T00:00:00+00:00", commit="0123456789ab", isa=["avx2"],
                       torch="2.13.0+cpu")
    run = Provenance.of(recorded)
    assert run.commit == "0123456789ab" and run.isa == ("avx2",)
    assert run.started == datetime.datetime(2026, 12, 5, tzinfo=datetime.timezone.utc)
    assert run.machine == "CPU X (2 CPUs), ISA avx2, float32, torch 2.13.0+cpu"
    assert "ISA not recorded" in Provenance.of(_report()).machine
    assert "- commit: `0123456789ab`" in result_block(section, "x.json", recorded)


def test_notes_place_results_and_reject_unknown_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(document, "NOTES_DIR", tmp_path)
    monkeypatch.setattr(document, "load", lambda name: _report("2026-12-09T00:00:00+00:00"))
    section = Section("demo", "Demo", ("a.json", "b.json"), lambda report: "TABLE")
    (tmp_path / "demo.md").write_text("before\n\n<!-- result: b.json -->\n\nafter\n")
    text = document.render_section(section)
    assert text.index("before") < text.index("b.json") < text.index("after") < text.index(
        "a.json")  # b placed by the marker, a after the prose
    (tmp_path / "demo.md").write_text("<!-- result: c.json -->\n")
    with pytest.raises(ValueError, match="c.json"):
        document.render_section(section)


def test_every_section_renders_markdown_tables():
    text = build_doc()
    for section in SECTIONS:
        assert f"## {section.title}\n" in text
    assert "\n| config | out tok/s |" in text  # a benchmark's own table, as Markdown


def test_markdown_tables_only_inside_the_context():
    rows, columns = [{"a": "x|y", "b": 1.5}], [("a", "A"), ("b", "B")]
    with markdown_tables():
        assert format_table(rows, columns).strip() == "| A | B |\n|---|---:|\n| x\\|y | 1.50 |"
    assert format_table(rows, columns) == "A       B\n---  ----\nx|y  1.50"


def test_runs_record_their_commit_and_isa():
    info = machine_info("cpu")
    assert "commit" in info and "isa" in info
    if info["commit"] is not None:  # a git checkout
        assert len(info["commit"].removesuffix("+dirty")) == 12


def test_a_retired_studys_result_keeps_its_frozen_table_and_says_where_its_code_is():
    from benchmarks.results_doc.sections import RETIRED

    section = next(s for s in SECTIONS if s.key == "fp8_selection")
    assert section.render is None  # the study is gone: nothing renders its result
    block = result_block(section, "fp8_selection.json", document.load("fp8_selection.json"))
    frozen = document.frozen_table_path("fp8_selection.json").read_text().strip()
    assert frozen in block
    study = next(s for s in RETIRED if "fp8_selection.json" in s.produced_by)
    assert f"git show {study.last_commit}:benchmarks/fp8_selection.py" in block
    for study in RETIRED:  # deleted, and every result of it assigned to a section
        assert not (document.REPO_ROOT / study.path).exists()
        assert set(study.produced_by) <= {n for s in SECTIONS for n in section_files(s)}


def test_every_frozen_table_belongs_to_a_retired_result(tmp_path, monkeypatch):
    document.check_frozen_tables()
    monkeypatch.setattr(document, "FROZEN_DIR", tmp_path)
    (tmp_path / "stray.md").write_text("| a |\n")
    with pytest.raises(ValueError, match="stray.md"):
        document.check_frozen_tables()
