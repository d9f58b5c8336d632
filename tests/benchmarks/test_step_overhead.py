"""benchmarks.step_overhead at tiny shapes: both cases run and report every part."""

from __future__ import annotations

import json

from benchmarks.step_overhead import main


def test_step_overhead_reports_both_cases(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["--num-decoding", "4", "--decode-len", "40", "--prefill-len", "512",
                 "--chunk", "128", "--layers", "2", "--kv-heads", "2", "--steps", "3",
                 "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    decoding, with_prefill = report["cases"]
    for case in (decoding, with_prefill):
        parts = [case[k] for k in ("scheduler_ms", "admission_ms", "worker_prepare_ms",
                                   "worker_finish_ms")]
        assert all(part > 0 for part in parts)
        assert abs(case["total_ms"] - sum(parts)) < 1e-9
    # the long prompt's rows set the width of the whole step's page table
    assert decoding["page_table_width"] == 3  # ceil(43 / 16)
    assert with_prefill["page_table_width"] == 512 // 16
    assert "target" in capsys.readouterr().out
