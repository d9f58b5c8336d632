"""benchmarks.studies.scheduler_cost at a small size: both schedulers run the same queue, the
kvcompress side shares its prefixes (segments made once each), and the report has every
figure."""

from __future__ import annotations

import json

import pytest

from benchmarks.studies.scheduler_cost import main

pytestmark = pytest.mark.slow


def test_scheduler_cost_runs_both_sides(embedded_model, tmp_path):
    out = tmp_path / "cost.json"
    main(["--model", embedded_model, "--cases", "12x1024", "--prefixes", "2", "--steps", "6",
          "--warmup", "2", "--output-json", str(out)])
    (result,) = json.loads(out.read_text())["results"]
    for side in ("vanilla", "kvcompress"):
        assert result[side]["median_ms"] > 0
        assert result[side]["waiting_at_end"] + result[side]["running_at_end"] > 0
    assert result["kvcompress"]["segments_made"] == 2  # one per shared prefix, not again
    assert result["limit_ms"] == pytest.approx(1.5 * result["vanilla"]["median_ms"] + 1)
