"""Issue 30, items 1-5: holes in the prefix cache (multi-turn reuse), each shown on the
pieces that make it, without an engine: the scheduler's page manager, KV-cache manager and
update, the worker runtime and its mirror.

1. a prompt compacted and generated tokens evicted in one step (a resumed request) must
   still reach the scheduler as a compacted prompt;
2. one adoption's page copies must never write another adoption's source pages of the
   same step (nor may any page of the step be allocated onto them);
3. a request whose compaction failed is never filed as a cache entry;
4. an adopter is admitted by what it holds once it has adopted;
5. an adoption never evicts another conversation's entry for its own pages (it hands over).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from kvcompress.attention.gpu_kernel import TritonPagedKernel
from kvcompress.engine.messages import REPORT_ATTR, WorkerReport
from kvcompress.engine.sched.admission import AdmissionPlanner, peak_pages
from kvcompress.engine.sched.kv_cache_manager import PagedKVCacheManager
from kvcompress.engine.sched.prefix_cache import PrefixCachePolicy
from kvcompress.engine.sched.scheduler import KVCompressScheduler
from kvcompress.engine.worker import page_work
from kvcompress.engine.worker.runtime import PagedKVRuntime
from kvcompress.paging import PageLayout, ShardedPageManager
from kvcompress.settings.config import KVCompressionConfig
from tests.engine.scheduler_stand_in import stand_in_scheduler


class Request(SimpleNamespace):
    """What the scheduler-side code reads of a vLLM request."""

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)


def request(request_id: str, tokens, prompt_len: int, computed: int = 0, max_tokens: int = 64,
            status=RequestStatus.WAITING) -> Request:
    tokens = list(tokens)
    return Request(request_id=request_id, all_token_ids=tokens, num_tokens=len(tokens),
                   num_prompt_tokens=prompt_len, num_output_tokens=len(tokens) - prompt_len,
                   num_computed_tokens=computed, max_tokens=max_tokens, status=status,
                   sampling_params=None, lora_request=None, has_encoder_inputs=False,
                   prompt_embeds=None, cache_salt=None, skip_reading_prefix_cache=False)


def release(pages: ShardedPageManager, report: WorkerReport) -> None:
    """The scheduler's handling of a worker report's compactions (its own code)."""
    scheduler = SimpleNamespace(page_manager=pages, num_pages_freed_by_compression=0,
                                log_stats=False)
    for request_id, compaction in report.compactions.items():
        KVCompressScheduler._release(scheduler, request_id, compaction)


def fake_runner(requests: dict[str, tuple[int, int, int]], max_tokens: int = 1000):
    """A vLLM model runner as the runtime reads it: id -> (computed, prompt, outputs)."""
    req_ids = list(requests)
    return SimpleNamespace(
        requests={rid: SimpleNamespace(
            sampling_params=SimpleNamespace(extra_args={}, max_tokens=max_tokens),
            output_token_ids=[0] * outputs) for rid, (_, _, outputs) in requests.items()},
        input_batch=SimpleNamespace(
            req_ids=req_ids,
            num_computed_tokens_cpu=np.array([c for c, _, _ in requests.values()]),
            num_prompt_tokens=np.array([p for _, p, _ in requests.values()])))


def runtime_for(config: KVCompressionConfig, layout: PageLayout) -> PagedKVRuntime:
    return PagedKVRuntime(config, layout, [f"layer{i}" for i in range(layout.num_layers)],
                          TritonPagedKernel(layout, torch.float32), torch.float32,
                          torch.device("cpu"))


def step_output(pages: ShardedPageManager, finished=(), preempted=()) -> SimpleNamespace:
    return SimpleNamespace(finished_req_ids=set(finished), preempted_req_ids=set(preempted),
                           kvcompress_page_deltas=pages.take_deltas())


# --------------------------------------------------------------------------- claim 1
RESUMED = KVCompressionConfig.from_mapping({
    "kv_compression": "streamingllm", "kv_budget": 8, "kv_decode_budget": 8,
    "kv_decode_policy": "window", "kv_decode_interval": 4})
SMALL = PageLayout(num_layers=2, num_kv_heads=2, head_size=32, page_size=16, dtype_bytes=4,
                   total_pages=64)


def test_a_resumed_requests_prompt_compaction_reaches_the_scheduler_with_its_decode_eviction():
    """A request resumed after preemption recomputes its 20-token prompt and its 40 earlier
    outputs in one step: the worker compacts the prompt (to 8 per row) and evicts generated
    tokens (to 8) in that step. The entry filed when it ends must know its prompt kept 8
    tokens per row: it is not exact, and its prompt's end is 8 slots into every row."""
    pages = ShardedPageManager(SMALL)
    assert pages.allocate("r", 60)
    runtime = runtime_for(RESUMED, SMALL)
    runtime.bind_runner(fake_runner({"r": (0, 20, 40)}))
    runtime.begin_step(step_output(pages))
    runtime.build_attention_metadata(SimpleNamespace(
        num_reqs=1, query_start_loc_cpu=torch.tensor([0, 60])))
    report = runtime.end_step()
    worker = runtime.state.requests["r"]
    assert worker.prompt_kept.tolist() == [8] * 4 and worker.lengths.tolist() == [16] * 4
    release(pages, report)
    assert pages.physical_lengths("r").tolist() == [16] * 4
    assert pages.retire("r", 1, 60, prompt_len=20)
    entry = pages.shards[0].entry(1)
    assert not entry.exact_prompt, "a compacted prompt filed as exact"
    assert entry.lengths_at(20).tolist() == worker.prompt_kept.tolist()
    assert entry.lengths_at(12) is None  # inside a compacted prompt: no cut
    # A handover at the prompt's end takes the rows as they are.
    assert pages.adopt("b", 1, 20, share=False)
    assert pages.physical_lengths("b").tolist() == [8] * 4
    pages.check_invariants()


def test_merged_reports_keep_a_prompt_compaction_followed_by_a_decode_eviction():
    """Reports of two steps merged before the scheduler reads them (``WorkerReport.merge``):
    the first compacted the prompt, the second evicted generated tokens."""
    from kvcompress.engine.messages import Compaction

    pages = ShardedPageManager(SMALL)
    assert pages.allocate("r", 60)
    merged = WorkerReport({"r": Compaction(60, np.full(4, 48))})  # 20 -> 8, tail of 40 kept
    merged.merge(WorkerReport({"r": Compaction(61, np.full(4, 16), "decode")}))
    assert pages.allocate("r", 61)
    release(pages, merged)
    assert pages.retire("r", 1, 61, prompt_len=20)
    entry = pages.shards[0].entry(1)
    assert not entry.exact_prompt and entry.lengths_at(20).tolist() == [8] * 4


# --------------------------------------------------------------------------- claim 2
TINY = PageLayout(num_layers=2, num_kv_heads=2, head_size=8, page_size=4, dtype_bytes=4,
                  total_pages=32)


def test_a_copy_source_is_never_another_pages_destination_in_the_same_step(monkeypatch):
    """Entries 1 and 2 hold 8 pages each, 16 are free. Adopter a1 shares entry 1's first 6
    tokens: it reads each row's first page in place and copies the partial second one. Then
    a request takes 20 pages: the 12 free ones and what evicting entries frees. Entry 2 goes;
    entry 1 is kept (a1 reads its first pages, the copy pins the others: dropping it would
    free nothing), and even dropped it would not free the copy's sources before the worker
    copied them. The batched copy reads first, but if it fails after writing, the retry
    request by request reads them again."""
    pages = ShardedPageManager(TINY)
    for name, entry_id in (("e1", 1), ("e2", 2)):
        assert pages.allocate(name, 8)
        assert pages.retire(name, entry_id, 8, prompt_len=8)
    runtime = runtime_for(KVCompressionConfig(), TINY)
    runtime.pool.copy_(torch.arange(runtime.pool.numel(), dtype=torch.float32)
                       .view_as(runtime.pool))  # every slot its own value
    entry_pages = pages.shards[0].entry(1).table.all_pages()
    expected = runtime.pool[torch.as_tensor(entry_pages, dtype=torch.long)].clone()
    pages.take_deltas()

    assert pages.can_adopt(1, 6, 6, share=True) and pages.adopt("a1", 1, 6, share=True)
    assert pages.allocate("x", 20)
    assert pages.take_evicted_entries() == [2] and pages.entry_ids() == [1]
    assert not pages.allocate("y", 4)  # nothing left that an eviction would free
    sources = pages.shards[0].cache._pins[0]
    pages.drop_entry(1)  # as a reset would: the sources stay held until the deltas go
    assert pages.shards[0].pool.counts(sources).all()
    deltas = pages.shards[0].take_deltas()
    assert deltas["a1"].copies[0].tolist() == sources.tolist()
    assert not set(sources.tolist()) & set(deltas["x"].appends[0][1].tolist())

    real_copy = page_work.copy_pages
    calls = []

    def copy_then_fail_the_batch(pool, src, dst):
        real_copy(pool, src, dst)  # the device wrote, then reported an error
        calls.append(len(src))
        if len(calls) == 1:
            raise RuntimeError("device fault")

    monkeypatch.setattr(page_work, "copy_pages", copy_then_fail_the_batch)
    runtime.begin_step(SimpleNamespace(finished_req_ids=set(), preempted_req_ids=set(),
                                       kvcompress_page_deltas=[deltas]))
    table = runtime.state.requests["a1"].table
    held = runtime.pool[torch.as_tensor(table.pages[:, :2].reshape(-1), dtype=torch.long)]
    assert torch.equal(held, expected), "a1 holds other K/V than entry 1's"
    assert pages.shards[0].pool.counts(sources).sum() == 0  # unpinned: free now
    pages.check_invariants()


# --------------------------------------------------------------------------- claim 3
REUSE = KVCompressionConfig.from_mapping({"kv_compression": "snapkv", "kv_budget": 16,
                                          "kv_reuse": "on"})


def paged_manager(layout: PageLayout, config: KVCompressionConfig, running=(),
                  max_model_len: int = 4096, waiting=()) -> PagedKVCacheManager:
    pages = ShardedPageManager(layout)
    inner = SimpleNamespace(empty_kv_cache_blocks=(), max_model_len=max_model_len,
                            allocate_slots=lambda *args, **kwargs: ("blocks",),
                            free=lambda request: None)
    admission = AdmissionPlanner(pages, config, max_model_len=max_model_len,
                                 max_num_batched_tokens=512,
                                 lookahead=config.admission_lookahead,
                                 running=lambda: list(running))
    return PagedKVCacheManager(inner, pages, 0.0, admission, 512,
                               PrefixCachePolicy(pages, config), waiting=lambda: waiting)


def test_a_request_whose_compaction_failed_is_not_filed_when_it_finishes_in_that_step(
        monkeypatch):
    """The worker's moves for ``a`` failed halfway in the step where ``a`` also sampled its
    last token: vLLM's update frees (files) finished requests before kvcompress ends the
    failed ones, so the half-moved rows must be kept out of the cache before that."""
    layout = PageLayout(2, 2, head_size=8, page_size=4, dtype_bytes=4, total_pages=64)
    manager = paged_manager(layout, REUSE)
    done = request("a", range(100, 141), prompt_len=36, computed=40,
                   status=RequestStatus.RUNNING)
    assert manager.pages.allocate("a", 40)
    scheduler = stand_in_scheduler(
        kv_cache_manager=manager, page_manager=manager.pages, reuse=manager.reuse,
        requests={"a": done})

    def vllm_update(self, scheduler_output, model_runner_output):
        # vLLM: "a" hit its stop condition in this step, so it is finished and freed.
        for finished in list(self.requests.values()):
            finished.status = RequestStatus.FINISHED_STOPPED
            self.kv_cache_manager.free(finished)
            del self.requests[finished.request_id]
        return {}

    monkeypatch.setattr(Scheduler, "update_from_output", vllm_update)
    output = SimpleNamespace(**{REPORT_ATTR: WorkerReport(
        failures={"a": "moving the kept tokens failed: device fault"})})
    scheduler.update_from_output(SimpleNamespace(), output)
    assert manager.pages.entry_ids() == [], "half-moved rows filed as a cache entry"
    assert manager.pages.num_free == layout.total_pages


# --------------------------------------------------------------------------- claim 4
LOOKAHEAD = KVCompressionConfig.from_mapping({
    "kv_compression": "snapkv", "kv_budget": 16, "kv_reuse": "on",
    "kv_admission_lookahead": 200})


def adoption_case(total_pages: int):
    """A running request decoding for a long while, an entry (a 100-token prompt compacted
    to 40 per row plus 10 generated: 50 per row) and a waiting continuation of it."""
    layout = PageLayout(2, 2, head_size=8, page_size=4, dtype_bytes=4, total_pages=total_pages)
    running = request("run", range(5000, 5021), prompt_len=20, computed=20, max_tokens=400,
                      status=RequestStatus.RUNNING)
    manager = paged_manager(layout, LOOKAHEAD, running=[running])
    pages = manager.pages
    assert pages.allocate("run", 21)
    first = list(range(100, 210))
    assert pages.allocate("e", 100)
    pages.release_after_compression("e", 100, np.full(4, 40))
    assert pages.allocate("e", 110)
    assert manager.reuse.retire(request("e", first, prompt_len=100, computed=110,
                                        status=RequestStatus.FINISHED_STOPPED))
    pages.take_deltas()
    follow = request("b", [*first, *range(300, 340)], prompt_len=150, max_tokens=200)
    return manager, running, follow


def test_an_adopter_is_admitted_by_what_it_holds_once_adopted():
    """Admission plans the continuation as if it prefilled its 150 tokens and kept a budget
    of 16 per row; it adopts 50 per row and keeps 16 of its 40 new tokens: 66. With a pool
    just too small for the plan made from what it really holds, it must wait."""
    # The pool the adopter's real trajectory needs beside the running request's.
    probe, running, follow = adoption_case(total_pages=10_000)
    assert probe.pages.can_adopt(1, 110, 150, share=True)
    assert probe.pages.adopt("b", 1, 110, share=True) and probe.pages.allocate("b", 150)
    assert probe.pages.adoption("b")[1].tolist() == [50] * 4
    follow.num_computed_tokens = 0  # as planned at admission: its prefill to come
    # Its trajectory counts its own pages; the entry's pages it reads are counted apart.
    read = probe.pages.num_read
    assert read == 4 * 12  # 50 tokens a row: 12 whole pages read, the partial one copied
    needed = peak_pages(probe.admission.trajectories([running, follow])) + read
    # The share keeps the entry cached: what it does not read is evictable, available.
    manager, _, follow = adoption_case(total_pages=needed - 1)
    blocks, hit, _ = manager.get_computed_blocks(follow)
    assert hit == 110
    assert manager.allocate_slots(follow, 150 - hit, num_new_computed_tokens=hit) is None, (
        f"admitted although it needs {needed} pages of {needed - 1}")
    manager, _, follow = adoption_case(total_pages=needed)
    assert manager.get_computed_blocks(follow)[1] == 110
    assert manager.allocate_slots(follow, 40, num_new_computed_tokens=110) is not None
    assert manager.pages.adoption("b")[1].tolist() == [50] * 4


# --------------------------------------------------------------------------- claim 5
# A budget above the turns' prompts: they are kept whole, and so adopted whole.
REUSE_WHOLE = KVCompressionConfig.from_mapping({"kv_compression": "snapkv", "kv_budget": 64,
                                                "kv_reuse": "on"})


def two_conversations(total_pages: int, waiting=()):
    """Conversations a and b each ended a turn of 40 tokens, kept whole (10 pages per row,
    40 pages per entry), and a's next turn (48 tokens, the first 38 cached: 9 whole pages a
    row read in place and a partial one) is waiting."""
    layout = PageLayout(2, 2, head_size=8, page_size=4, dtype_bytes=4, total_pages=total_pages)
    manager = paged_manager(layout, REUSE_WHOLE, waiting=waiting)
    for name, first in (("a", 100), ("b", 200)):
        assert manager.pages.allocate(name, 40)
        assert manager.reuse.retire(request(name, range(first, first + 40), prompt_len=36,
                                            computed=40, status=RequestStatus.FINISHED_STOPPED))
    manager.pages.take_deltas()
    return manager, request("a2", [*range(100, 138), *range(500, 510)], prompt_len=48)


def test_an_adoption_evicts_no_other_conversations_entry():
    """90 pages: both entries (80) and 10 free. Sharing a's entry for its next turn takes 12
    of a2's own pages (a copy of each row's partial page, and 2 a row to grow by), which only
    evicting b's entry frees; handing it over takes the partial pages as they are and 8 free
    ones. b's next turn must still find its cache."""
    manager, follow = two_conversations(total_pages=90)
    assert manager.get_computed_blocks(follow)[1] == 38
    assert manager.allocate_slots(follow, 10, num_new_computed_tokens=38) is not None
    assert manager.pages.entry_ids() == [2], "a's adoption evicted b's entry"
    assert manager.reuse.totals.handovers == 1 and manager.reuse.totals.evicted_entries == 0
    b2 = request("b2", [*range(200, 240), *range(600, 608)], prompt_len=48)
    assert manager.get_computed_blocks(b2)[1] == 40
    manager.pages.check_invariants()


def test_an_adoption_shares_when_the_free_pages_take_its_own():
    """With 12 free pages beside the entries a share evicts nothing: a's entry stays cached,
    a2 reading 36 of its pages."""
    manager, follow = two_conversations(total_pages=92)
    assert manager.get_computed_blocks(follow)[1] == 38
    assert manager.allocate_slots(follow, 10, num_new_computed_tokens=38) is not None
    assert manager.pages.entry_ids() == [2, 1]  # a's entry shared: used most recently
    assert manager.reuse.totals.shares == 1 and manager.reuse.totals.evicted_entries == 0
    assert manager.pages.num_read == 36 and manager.pages.num_free == 0
    manager.pages.check_invariants()


def test_an_entry_is_shared_for_a_waiting_branch_of_the_same_context():
    """Two samples of a's next turn wait (parallel sampling): a share serves both, so it is
    made although it evicts b's entry."""
    waiting = []
    manager, follow = two_conversations(total_pages=90, waiting=waiting)
    sibling = request("a2-1", follow.all_token_ids, prompt_len=48)
    waiting += [follow, sibling]
    assert manager.get_computed_blocks(follow)[1] == 38
    assert manager.allocate_slots(follow, 10, num_new_computed_tokens=38) is not None
    assert manager.pages.entry_ids() == [1] and manager.reuse.totals.shares == 1
    manager.pages.check_invariants()


# ------------------------------------------------------------ claim 4, the full-sequence check
def test_an_adopters_full_sequence_check_counts_the_prefix_it_adopts_as_cached():
    """vLLM admits a waiting request only when its whole sequence fits
    (``full_sequence_must_fit``), a prefix-cache hit counted as held. a's 40 tokens are an
    entry (40 pages), a2 reads 36 of them (38 cached tokens) and holds 12 of its own; 12 are
    free. a3, another question on a's 38 tokens, needs 16 pages to adopt by share (a copy of
    each row's partial page, 2 a row to grow by, the entry's 4 pages nobody reads kept):
    it fits, although its 48 tokens as new pages (48) would not. Resumed after 8 generated
    tokens (56: 4 a row more) it does not fit: the check still holds for adopters."""
    waiting = []
    layout = PageLayout(2, 2, head_size=8, page_size=4, dtype_bytes=4, total_pages=64)
    manager = paged_manager(layout, REUSE_WHOLE, waiting=waiting)
    assert manager.pages.allocate("a", 40)
    assert manager.reuse.retire(request("a", range(100, 140), prompt_len=36, computed=40,
                                        status=RequestStatus.FINISHED_STOPPED))
    manager.pages.take_deltas()
    a2 = request("a2", [*range(100, 138), *range(500, 510)], prompt_len=48)
    a3 = request("a3", [*range(100, 138), *range(700, 710)], prompt_len=48)
    waiting += [a2, a3]
    for reader in (a2, a3):
        assert manager.get_computed_blocks(reader)[1] == 38
    assert manager.allocate_slots(a2, 10, num_new_computed_tokens=38,
                                  full_sequence_must_fit=True) is not None
    waiting.remove(a2)
    assert manager.pages.num_read == 36 and manager.pages.num_free == 12
    resumed = request("a3", [*a3.all_token_ids, *range(900, 908)], prompt_len=48,
                      status=RequestStatus.PREEMPTED)
    assert manager.get_computed_blocks(resumed)[1] == 38
    assert manager.allocate_slots(resumed, 10, num_new_computed_tokens=38,
                                  full_sequence_must_fit=True) is None
    assert manager.get_computed_blocks(a3)[1] == 38
    assert manager.allocate_slots(a3, 10, num_new_computed_tokens=38,
                                  full_sequence_must_fit=True) is not None
    assert manager.reuse.totals.shares == 2 and manager.pages.num_free == 0
    manager.pages.check_invariants()
