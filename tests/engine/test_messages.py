"""Merging the tensor-parallel ranks' worker reports into the one the scheduler reads."""

import numpy as np

from kvcompress.engine.messages import Compaction, WorkerReport, merge_rank_reports


def report(compactions, failures=None, score=0.0, compaction=0.0):
    return WorkerReport(dict(compactions), dict(failures or {}), score, compaction)


def test_compactions_join_their_rows_rank_major_and_times_are_the_slowest_rank():
    rank0 = report({"a": Compaction(90, np.array([10, 11])),
                    "d": Compaction(70, np.array([5, 5]), "decode")}, score=0.2, compaction=0.5)
    rank1 = report({"a": Compaction(90, np.array([12, 13])),
                    "d": Compaction(70, np.array([6, 6]), "decode")}, score=0.3, compaction=0.1)
    merged = merge_rank_reports([rank0, rank1])
    assert merged.compactions["a"].physical_lengths.tolist() == [10, 11, 12, 13]
    assert merged.compactions["d"].kind == "decode"
    assert merged.compactions["d"].physical_lengths.tolist() == [5, 5, 6, 6]
    assert (merged.score_seconds, merged.compaction_seconds) == (0.3, 0.5)
    assert not merged.failures


def test_a_request_failed_or_compacted_differently_on_one_rank_fails():
    rank0 = report({"a": Compaction(90, np.array([10])), "b": Compaction(50, np.array([4])),
                    "c": Compaction(40, np.array([3]))})
    rank1 = report({"b": Compaction(51, np.array([4])), "c": Compaction(40, np.array([3])),
                    "e": Compaction(30, np.array([2]))}, failures={"a": "boom"})
    merged = merge_rank_reports([rank0, rank1])
    assert set(merged.compactions) == {"c"}
    assert merged.failures["a"] == "boom"
    assert "disagree" in merged.failures["b"] and "disagree" in merged.failures["e"]


def test_one_rank_is_passed_through():
    single = report({"a": Compaction(9, np.array([1]))})
    assert merge_rank_reports([single]) is single


def test_a_decode_eviction_after_a_prompt_compaction_carries_the_prompts_eviction():
    merged = report({"a": Compaction(60, np.array([48, 40]))})  # prompt of 20: 8 and 0 gone
    merged.merge(report({"a": Compaction(61, np.array([16, 16]), "decode"),
                         "b": Compaction(30, np.array([9, 9]), "decode")}))
    assert merged.compactions["a"].kind == "decode"
    assert merged.compactions["a"].prompt_evicted.tolist() == [12, 20]
    assert merged.compactions["b"].prompt_evicted is None
    ranks = merge_rank_reports([merged, merged])
    assert ranks.compactions["a"].prompt_evicted.tolist() == [12, 20, 12, 20]
    assert ranks.compactions["b"].prompt_evicted is None


def test_a_segment_compaction_failed_on_another_rank_reaches_the_scheduler():
    """A shared segment's in-place compaction failed on rank 1 only (issue 51): the merged
    report names the segment (the scheduler drops the entries holding it) and fails its
    reader on every rank, though rank 0 compacted the reader's prompt."""
    rank0 = report({"r": Compaction(90, np.array([10]))})
    rank1 = report({}, failures={
        "kvcompress-segment-3": "compacting the shared prefix in place failed: fault",
        "r": "compacting the shared prefix it reads failed: fault"})
    merged = merge_rank_reports([rank0, rank1])
    assert set(merged.failures) == {"kvcompress-segment-3", "r"} and not merged.compactions


def test_a_tier_load_failed_on_one_rank_reloads_on_every_rank():
    """Rank 0's load failed (its adopter ran on an empty context, uncompacted); rank 1's
    worked and compacted: the request prefills again, neither failed nor compacted. Lost
    entries and chunks are every rank's."""
    rank0 = WorkerReport(reload=["a"], lost_entries=[7], lost_chunks=[(0, 12)])
    rank1 = report({"a": Compaction(90, np.array([10])), "b": Compaction(40, np.array([3]))})
    rank0.compactions["b"] = Compaction(40, np.array([4]))
    merged = merge_rank_reports([rank0, rank1])
    assert merged.reload == ["a"] and "a" not in merged.failures
    assert set(merged.compactions) == {"b"}
    assert merged.compactions["b"].physical_lengths.tolist() == [4, 3]
    assert (merged.lost_entries, merged.lost_chunks) == ([7], [(0, 12)])
