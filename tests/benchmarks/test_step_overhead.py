"""benchmarks.studies.step_overhead at tiny shapes: both cases run and report every part."""

from __future__ import annotations

import json

from benchmarks.studies.step_overhead import main


def test_step_overhead_reports_every_case(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["--num-decoding", "4", "--decode-len", "40", "--prefill-len", "4096",
                 "--chunk", "128", "--layers", "2", "--kv-heads", "2", "--steps", "3",
                 "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    decoding, with_prefill, churn = report["cases"]
    for case in (decoding, with_prefill, churn):
        parts = [case[k] for k in ("scheduler_ms", "admission_ms", "worker_prepare_ms",
                                   "worker_finish_ms")]
        assert all(part > 0 for part in parts)
    # the timed steps ran over the batch each case describes: 4 decoding requests of 43
    # tokens (3 pages in each of 4 rows), plus a 4096-token prompt (256 pages a row)
    assert [case["pages_in_batch"] for case in (decoding, with_prefill, churn)] == [
        48, 48 + 4 * 256, 48]
    # the long prompt gets its own class: the decoding requests' table stays narrow
    assert decoding["table_widths"] == [4]  # ceil(43 / 16) = 3 pages, rounded to 16 / 8
    assert with_prefill["table_widths"] == [4, 4096 // 16]
    # the median step copies no table (rows cross pages rarely); churn copies the joiner
    assert decoding["tables_copied_per_step"] == 0
    assert churn["tables_copied_per_step"] == 1
    assert "target" in capsys.readouterr().out
