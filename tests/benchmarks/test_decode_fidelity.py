"""Decode fidelity scoring: prefix and positional agreement with the full cache."""

from __future__ import annotations

import pytest

from benchmarks.decode_fidelity import agreement, score
from benchmarks.jobs import JobResult
from benchmarks.specs import CompressionSpec


def test_agreement_counts_the_common_prefix_and_positional_matches():
    reference = [1, 2, 3, 4, 5, 6, 7, 8]
    assert agreement(reference, reference, 8) == (1.0, 1.0)
    assert agreement(reference, [1, 2, 9, 4, 5, 6, 7, 8], 8) == (2 / 8, 7 / 8)
    assert agreement(reference, [1, 2, 9, 4], 4) == (2 / 4, 3 / 4)
    assert agreement(reference, [0] * 8, 8) == (0.0, 0.0)


def test_score_averages_over_prompts_and_reports_failures():
    specs = [CompressionSpec(), CompressionSpec.parse("pyramidkv:999@h2o:4"),
             CompressionSpec.parse("pyramidkv:999@window:4")]
    results = {
        "vanilla": JobResult("vanilla", {"token_ids": [[1, 2, 3, 4], [5, 6, 7, 8]],
                                         "generate_s": 1.0}, None, 1.0),
        "pyramidkv:999@h2o:4": JobResult("x", {"token_ids": [[1, 2, 3, 4], [5, 0, 7, 8]],
                                               "generate_s": 1.0}, None, 1.0),
        "pyramidkv:999@window:4": JobResult("y", None, "boom", 1.0),
    }
    vanilla, h2o, window = score(specs, results, [2, 4])
    assert vanilla["prefix@4"] == 1.0
    assert h2o["prefix@2"] == pytest.approx(0.75) and h2o["prefix@4"] == pytest.approx(0.625)
    assert h2o["match@4"] == pytest.approx(7 / 8)
    assert not window["ok"] and window["error"] == "boom" and "prefix@4" not in window
