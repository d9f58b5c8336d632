"""The worker's runtime without vLLM: per-request settings are resolved once, and settings
that reach the worker invalid (the front end's validation bypassed) fail their request instead
of being replaced by the engine's."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import torch

from kvcompress.attention.gpu_kernel import TritonPagedKernel
from kvcompress.attention.layer import attend_layer
from kvcompress.engine.messages import merge_rank_reports
from kvcompress.engine.worker import page_work
from kvcompress.engine.worker.runtime import PagedKVRuntime
from kvcompress.paging import PageLayout, PageManager, PageTableDelta
from kvcompress.settings.config import KVCompressionConfig

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_size=32, page_size=16, dtype_bytes=4,
                    total_pages=64)
ENGINE = KVCompressionConfig.from_mapping({"kv_compression": "snapkv", "kv_budget": 8})


def runtime_with(extra_args: dict[str, dict],
                 max_tokens: dict[str, int] | None = None) -> PagedKVRuntime:
    runtime = PagedKVRuntime(ENGINE, LAYOUT, ["layer0", "layer1"],
                             TritonPagedKernel(LAYOUT, torch.float32), torch.float32,
                             torch.device("cpu"))
    req_ids = list(extra_args)
    runtime.bind_runner(SimpleNamespace(
        requests={rid: SimpleNamespace(
            sampling_params=SimpleNamespace(extra_args=args,
                                            max_tokens=(max_tokens or {}).get(rid, 16)),
            output_token_ids=[]) for rid, args in extra_args.items()},
        input_batch=SimpleNamespace(
            req_ids=req_ids, num_computed_tokens_cpu=np.zeros(len(req_ids), dtype=np.int64),
            num_prompt_tokens=np.full(len(req_ids), 20, dtype=np.int64)),
    ))
    manager = PageManager(LAYOUT)
    for request_id in req_ids:
        manager.allocate(request_id, 20)
    runtime.begin_step(SimpleNamespace(finished_req_ids=set(), preempted_req_ids=set(),
                                       kvcompress_page_deltas=[manager.take_deltas()]))
    return runtime


def test_each_request_gets_its_own_settings_once():
    runtime = runtime_with({"a": {}, "b": {"kv_compression": "streamingllm", "kv_budget": 12}})
    assert runtime.request_config("a") is ENGINE
    own = runtime.request_config("b")
    assert (own.method, own.budget) == ("streamingllm", 12)
    assert runtime.request_config("b") is own


def test_invalid_settings_at_the_worker_fail_the_request_not_swap_its_settings():
    runtime = runtime_with({"good": {}, "bad": {"kv_budget": -3}})
    common = SimpleNamespace(num_reqs=2, query_start_loc_cpu=torch.tensor([0, 20, 40]))
    metadata = runtime.build_attention_metadata(common)
    assert set(metadata.step.failures) == {"bad"}
    assert "kv_budget" in metadata.step.failures["bad"]
    assert not runtime.request_config("bad").enabled  # not compressed meanwhile
    assert runtime.request_config("good") is ENGINE
    assert [w.batch_index for w in metadata.step.window_queries] == [0]  # only "good" scores


def test_a_request_ending_with_its_prefill_is_not_scored_or_compacted():
    runtime = runtime_with({"one_token": {}, "answer": {}}, max_tokens={"one_token": 1})
    common = SimpleNamespace(num_reqs=2, query_start_loc_cpu=torch.tensor([0, 20, 40]))
    step = runtime.build_attention_metadata(common).step
    assert [w.batch_index for w in step.window_queries] == [1]
    assert list(step.completing_prompt) == [1]


# ------------------------------------------------------------------ multi-turn reuse
def adoption(adopted: list[int], adopted_len: int, prompt_len: int, first_page: int,
             source_first_page: int) -> PageTableDelta:
    """The scheduler's delta for a request adopting a copy of a cached entry's pages
    (``source_first_page`` on) and growing by its new prompt tokens."""
    page = LAYOUT.page_size
    adopted_np = np.array(adopted, dtype=np.int64)
    first = (-(-adopted_np // page)).astype(np.int32)
    grown = (-(-(adopted_np + prompt_len - adopted_len) // page)).astype(np.int32) - first
    first_ids = np.arange(first_page, first_page + first.sum(), dtype=np.int32)
    grown_ids = np.arange(first_page + first.sum(), first_page + first.sum() + grown.sum(),
                          dtype=np.int32)
    source = np.arange(source_first_page, source_first_page + first.sum(), dtype=np.int32)
    return PageTableDelta(fresh=True, appends=[(first, first_ids), (grown, grown_ids)],
                          adopted_lengths=adopted_np, adopted_len=adopted_len,
                          copies=(source, first_ids.copy()))


# id -> (adopted rows, adopted logical tokens, prompt length)
ADOPTERS = {
    "short": ([20, 9, 30, 14], 30, 36),  # 6 new prompt tokens: within the budget of 8
    "long": ([5, 12, 3, 8], 12, 40),  # 28 new prompt tokens: compressed
}


def adopting_runtime(monkeypatch=None, failing_page: int | None = None):
    """A runtime whose step has the two adopters; its pool random, so copies are seen. With
    ``failing_page``, copying onto that page raises (as a device fault would)."""
    runtime = PagedKVRuntime(ENGINE, LAYOUT, ["layer0", "layer1"],
                             TritonPagedKernel(LAYOUT, torch.float32), torch.float32,
                             torch.device("cpu"))
    runtime.pool.copy_(torch.randn(runtime.pool.shape, generator=torch.Generator().manual_seed(0)))
    req_ids = list(ADOPTERS)
    runtime.bind_runner(SimpleNamespace(
        requests={rid: SimpleNamespace(sampling_params=SimpleNamespace(extra_args={},
                                                                       max_tokens=16),
                                       output_token_ids=[]) for rid in req_ids},
        input_batch=SimpleNamespace(
            req_ids=req_ids,
            num_computed_tokens_cpu=np.array([ADOPTERS[r][1] for r in req_ids]),
            num_prompt_tokens=np.array([ADOPTERS[r][2] for r in req_ids])),
    ))
    deltas = {"short": adoption(*ADOPTERS["short"], first_page=0, source_first_page=40),
              "long": adoption(*ADOPTERS["long"], first_page=20, source_first_page=50)}
    if failing_page is not None:

        real_copy = page_work.copy_pages

        def copy_pages(pool, src, dst):
            if failing_page in dst.tolist():
                raise RuntimeError("device fault")
            real_copy(pool, src, dst)

        monkeypatch.setattr(page_work, "copy_pages", copy_pages)
    before = runtime.pool.clone()
    runtime.begin_step(SimpleNamespace(finished_req_ids=set(), preempted_req_ids=set(),
                                       kvcompress_page_deltas=[deltas]))
    common = SimpleNamespace(num_reqs=2, query_start_loc_cpu=torch.tensor(
        [0, 36 - 30, 36 - 30 + 40 - 12]))
    return runtime, deltas, before, common


def test_adopted_pages_are_copied_before_the_forward():
    runtime, deltas, before, common = adopting_runtime()
    copied = set()
    for delta in deltas.values():
        src, dst = delta.copies
        assert torch.equal(runtime.pool[torch.as_tensor(dst, dtype=torch.long)],
                           before[torch.as_tensor(src, dtype=torch.long)])
        assert not torch.equal(before[torch.as_tensor(dst, dtype=torch.long)],
                               before[torch.as_tensor(src, dtype=torch.long)])
        copied |= set(dst.tolist())
    others = sorted(set(range(LAYOUT.total_pages)) - copied)
    assert torch.equal(runtime.pool[others], before[others])  # nothing else written
    step = runtime.build_attention_metadata(common).step
    assert step.failures == {}
    # Compression follows the new prompt tokens: "short" (6 <= budget 8) is neither scored
    # nor compacted although its prompt (36) is over the budget.
    assert [w.batch_index for w in step.window_queries] == [1]
    assert list(step.completing_prompt) == [1]
    (window,) = step.window_queries
    assert (window.first_query, window.num_queries) == (28 - 8, 8)  # last 8 new tokens
    assert window.scores.shape[-1] == 12 + 28  # longest adopted row + new tokens


def test_a_failed_copy_fails_only_its_adopter(monkeypatch):
    failing = int(adoption(*ADOPTERS["long"], first_page=20, source_first_page=50).copies[1][1])
    runtime, deltas, before, common = adopting_runtime(monkeypatch, failing_page=failing)
    src, dst = deltas["short"].copies
    assert torch.equal(runtime.pool[torch.as_tensor(dst, dtype=torch.long)],
                       before[torch.as_tensor(src, dtype=torch.long)])  # retried alone: done
    step = runtime.build_attention_metadata(common).step
    assert list(step.failures) == ["long"] and "device fault" in step.failures["long"]
    assert step.completing_prompt == [] and step.window_queries == []  # not compressed
    assert runtime.state.adoption_failures == {}  # reported once


def row_keys(runtime: PagedKVRuntime, request_id: str, row: int, count: int) -> torch.Tensor:
    request = runtime.state.requests[request_id]
    positions = torch.arange(count)
    pages = torch.as_tensor(request.table.pages[row], dtype=torch.long)
    slots = pages[positions // LAYOUT.page_size] * LAYOUT.page_size + positions % LAYOUT.page_size
    return runtime.kernel.page_format.read_tokens(runtime.pool, slots)[0]


def test_an_adopters_step_end_to_end_compacts_only_its_new_prompt_tokens():
    """begin_step (copies), the layers (write, attend, window scores), end_step (plan and
    moves): the long segment ends at its context plus the budget per head, its context
    untouched; the short one is left whole."""
    runtime, _, _, common = adopting_runtime()
    adopted = {rid: ADOPTERS[rid][0] for rid in ADOPTERS}
    context = {(rid, row): row_keys(runtime, rid, row, count).clone()
               for rid, rows in adopted.items() for row, count in enumerate(rows)}
    metadata = runtime.build_attention_metadata(common)
    generator = torch.Generator().manual_seed(4)
    tokens = metadata.num_actual_tokens
    for layer in range(LAYOUT.num_layers):
        query = torch.randn(tokens, 2 * LAYOUT.num_kv_heads, LAYOUT.head_size,
                            generator=generator)
        key, value = (torch.randn(tokens, LAYOUT.num_kv_heads, LAYOUT.head_size,
                                  generator=generator) for _ in range(2))
        attend_layer(metadata, layer, query, key, value, runtime.pool, torch.empty_like(query),
                     LAYOUT.head_size**-0.5)
    report = runtime.end_step()
    assert report.failures == {} and list(report.compactions) == ["long"]
    budget = ENGINE.budget
    long = report.compactions["long"]
    assert long.logical_len == 40
    assert long.physical_lengths.tolist() == [p + budget for p in adopted["long"]]
    short = runtime.state.requests["short"]
    assert short.lengths.tolist() == [p + 6 for p in adopted["short"]]
    assert short.prompt_kept.tolist() == short.lengths.tolist()
    assert runtime.state.requests["long"].prompt_kept.tolist() == long.physical_lengths.tolist()
    for (rid, row), keys in context.items():
        assert torch.equal(row_keys(runtime, rid, row, len(keys)), keys), (rid, row)


# ------------------------------------------------------- tensor parallelism: same passes
class TwoRanks:
    """What the tensor-parallel group does for ``agree_on_failures``: each rank hands in
    the requests that failed there, all get every rank's (two threads, one per rank)."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=10)
        self.handed: list[set[str]] = [set(), set()]

    def agree(self, rank: int):
        def failed_on_any_rank(failed):
            self.handed[rank] = set(failed)
            self.barrier.wait()
            agreed = self.handed[0] | self.handed[1]
            self.barrier.wait()
            return agreed
        return failed_on_any_rank


class RecordingReconstructor:
    """Records which requests each rank registers passes for (a pass holds all-reduces:
    ranks that run different ones hang)."""

    def __init__(self) -> None:
        self.requests: list[str] | None = None

    def register(self, step, requests, prompt_tokens):
        self.requests = list(requests)
        return {request_id: [1] for request_id in requests}

    def passes(self, grants):
        return iter(())

    def forget(self, request_ids):
        pass


def test_ranks_agree_on_failures_before_building_reconstruction_passes():
    """Rank 0 fails request "a" locally (e.g. copying its adopted pages): both ranks must
    leave it out of their passes, and rank 1 fails it too, naming rank 0's reason once
    the reports are merged."""
    group = TwoRanks()
    runtimes, reconstructors = [], []
    for rank in range(2):
        runtime = runtime_with({"a": {}, "b": {}})
        runtime.build_attention_metadata(
            SimpleNamespace(num_reqs=2, query_start_loc_cpu=torch.tensor([0, 20, 40])))
        runtime.reconstructor = RecordingReconstructor()
        runtime._reconstructing = ["a", "b"]
        runtime.agree_on_failures = group.agree(rank)
        runtimes.append(runtime)
        reconstructors.append(runtime.reconstructor)
    runtimes[0].step.fail(["a"], "copying the adopted pages failed: device fault")
    threads = [threading.Thread(target=runtime.reconstruct, args=(lambda *_: None,))
               for runtime in runtimes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert [r.requests for r in reconstructors] == [["b"], ["b"]]
    assert "a" in runtimes[1].step.failures
    merged = merge_rank_reports([runtime.end_step() for runtime in runtimes])
    assert merged.failures["a"] == "copying the adopted pages failed: device fault"


def test_one_rank_agrees_with_itself():
    runtime = runtime_with({"a": {}})
    assert runtime.agree_on_failures({"a"}) == {"a"}
