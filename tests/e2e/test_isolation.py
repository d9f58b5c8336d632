"""One request's compression failure stays its own: injected faults in scoring, planning and
the moves (KVCOMPRESS_FAULT_INJECTION, inherited by the worker process) end that request with
an error, free its pages, and leave the engine and every other request running; compaction
reports the scheduler cannot apply end their request the same way."""

from __future__ import annotations

import numpy as np
import pytest

from kvcompress.faults import ENV
from kvcompress.paging import PageManager
from tests.e2e.harness import EngineHarness, greedy, random_prompts

TINY = dict(dtype="float32", max_model_len=1024, max_num_batched_tokens=1024, max_num_seqs=8,
            kv_cache_memory_bytes=8192 * 4 * 2 * 2 * 32 * 4)
COMPRESSION = {"kv_compression": "pyramidkv", "kv_budget": 32}
FAULTY_LEN = 300  # the injected fault hits requests of this prompt length only


def run(tiny_llama, prompts, max_tokens=8, compression=COMPRESSION):
    harness = EngineHarness(tiny_llama, compression, **TINY)
    try:
        outputs = harness.generate(prompts, greedy(max_tokens))
        reasons = dict(harness.finish_reasons)
        manager = harness.page_manager
        # Every page back (free, or cached for a continuation), failed ones too.
        assert not manager.request_ids() and manager.num_available == manager.total_pages
        # the engine still serves a new request afterwards
        after = harness.generate(random_prompts([200], seed=9), greedy(4))
        assert len(after["p0"]) == 4
        return outputs, reasons
    finally:
        harness.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "scoring"), [
    ("score", "window"), ("score", "expected"), ("reconstruct", "reconstruct"),
    ("plan", "reconstruct"), ("moves", "reconstruct")])
def test_an_injected_fault_ends_only_its_request(tiny_llama, monkeypatch, stage, scoring,
                                                 request):
    """``score``: observation-window scoring, or the query profile's after the forward
    (--kv-scoring expected); ``reconstruct``: a reconstruction pass, whose other requests
    share its forward."""
    if scoring == "expected":
        request.getfixturevalue("profiled_tiny_llama")
    prompts = random_prompts([200, FAULTY_LEN, 250], seed=3)
    compression = dict(COMPRESSION, kv_scoring=scoring)
    monkeypatch.setenv(ENV, f"{stage}:{FAULTY_LEN}")
    outputs, reasons = run(tiny_llama, prompts, compression=compression)
    assert reasons["p1"] == "error"
    assert reasons["p0"] == reasons["p2"] == "length"
    assert len(outputs["p0"]) == len(outputs["p2"]) == 8
    # the healthy requests produced what they produce without any fault
    monkeypatch.delenv(ENV)
    clean, _ = run(tiny_llama, {"p0": prompts["p0"], "p2": prompts["p2"]},
                   compression=compression)
    assert outputs["p0"] == clean["p0"] and outputs["p2"] == clean["p2"]


@pytest.mark.slow
def test_a_compaction_report_the_scheduler_rejects_ends_only_its_request(tiny_llama,
                                                                         monkeypatch):
    real = PageManager.release_after_compression

    def reject_one(self, request_id, logical_len, physical_lengths, *args, **kwargs):
        if logical_len == FAULTY_LEN:
            physical_lengths = np.full_like(physical_lengths, logical_len + 1)  # impossible
        return real(self, request_id, logical_len, physical_lengths, *args, **kwargs)

    monkeypatch.setattr(PageManager, "release_after_compression", reject_one)
    outputs, reasons = run(tiny_llama, random_prompts([200, FAULTY_LEN, 250], seed=3))
    assert reasons == {"p0": "length", "p1": "error", "p2": "length"}
