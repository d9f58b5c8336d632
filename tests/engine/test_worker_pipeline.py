"""The worker-side pipeline end to end, with torch + Triton alone (no vLLM): the scheduler's
page manager, the worker's mirror, K/V write, attention, window scores, every policy and the
compaction with every mover, then a decode step over the kept tokens; pages accounted.

Runs on CPU with the torch references and under Triton's interpreter, and on CUDA with the real
kernels (scripts/gpu_check.sh runs it there, in a process where vLLM cannot be imported).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvcompress.attention.gpu_kernel import TritonPagedKernel
from kvcompress.attention.layer import attend_layer
from kvcompress.engine.worker.compaction import compact_completed_prompts
from kvcompress.engine.worker.compression import compress_step
from kvcompress.engine.worker.state import WorkerKVState
from kvcompress.kernels import has_triton
from kvcompress.paging import PageLayout, PageManager
from kvcompress.paging.page_format import GPU_PAGE_FORMAT
from kvcompress.policies import METHODS, get_method, observation_window_scores, plan_keep
from kvcompress.settings.config import KVCompressionConfig
from kvcompress.step import PagedAttentionMetadata
from tests import sync_debug
from tests.sync_debug import no_sync_region
from tests.triton_interpreter import use_interpreter

LAYERS, KV_HEADS, GROUP, HEAD_SIZE, PAGE_SIZE = 2, 2, 2, 32, 16
PROMPTS = [50, 23, 77, 12]  # three compress at budget 16, the last keeps everything
BUDGET, WINDOW = 16, 4
SCALE = HEAD_SIZE**-0.5
ROWS = LAYERS * KV_HEADS

TARGETS = {
    "torch": ("cpu", False),
    "interpreter": ("cpu", True),
    "cuda": ("cuda", None),
}


def target_params():
    params = []
    for name, (device, use_triton) in TARGETS.items():
        marks = []
        if name == "interpreter" and not has_triton():
            marks.append(pytest.mark.skip(reason="triton is not installed"))
        if name == "cuda" and not torch.cuda.is_available():
            marks.append(pytest.mark.skip(reason="needs a CUDA device"))
        params.append(pytest.param(device, use_triton, id=name, marks=marks))
    return params


def dense_attention(query, keys, values, first_position, window=0):
    """query [n, G, D] at positions first_position.. against keys/values [m, D], causal (and
    within the ``window`` newest positions, if set)."""
    logits = torch.einsum("ngd,md->ngm", query.double(), keys.double()) * SCALE
    position = first_position + torch.arange(query.shape[0], device=query.device)
    key_position = torch.arange(keys.shape[0], device=query.device)[None, :]
    hidden = key_position > position[:, None]
    if window:
        hidden |= key_position < position[:, None] - (window - 1)
    logits = logits.masked_fill(hidden[:, None, :], -math.inf)
    return torch.einsum("ngm,md->ngd", torch.softmax(logits, -1), values.double())


class Pipeline:
    def __init__(self, device: str, use_triton: bool | None, mover: str, method: str,
                 layer_windows: tuple[int, ...] = (), sharing: str | None = None):
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(7)
        self.layout = PageLayout(LAYERS, KV_HEADS, HEAD_SIZE, PAGE_SIZE, 4, total_pages=200,
                                 layer_windows=layer_windows)
        self.manager = PageManager(self.layout)
        self.state = WorkerKVState(self.layout, self.device)
        self.pool = torch.zeros(200, 2, PAGE_SIZE, HEAD_SIZE, device=self.device)
        self.kernel = TritonPagedKernel(self.layout, torch.float32, self.device,
                                        use_triton=use_triton)
        if mover == "native" and self.kernel.native_move is None:
            pytest.skip("the native CUDA move is not available")
        if mover != "native":
            self.kernel.native_move = None
        # "torch": compaction through the page format's gather-then-scatter instead
        self.mover = GPU_PAGE_FORMAT if mover == "torch" else self.kernel
        if sharing is None:  # model-wide where the method scores: the plan's harder case
            sharing = "model" if get_method(method).needs_scores else "layer"
        self.config = KVCompressionConfig.from_mapping(
            {"kv_compression": method, "kv_budget": BUDGET, "kv_window": WINDOW,
             "kv_budget_sharing": sharing})
        self.req_ids = [f"r{index}" for index in range(len(PROMPTS))]
        # Dense history per (request, row): what the cache must hold, in logical positions.
        self.keys: dict[tuple[int, int], torch.Tensor] = {}
        self.values: dict[tuple[int, int], torch.Tensor] = {}

    def random(self, *shape):
        return torch.randn(*shape, generator=self.generator).to(self.device)

    def step(self, num_new: list[int], computed: list[int]):
        """One step: pages, mirror, batch, then every layer written and attended; returns the
        batch, this step's queries and the attention outputs per layer."""
        for request_id, new, done in zip(self.req_ids, num_new, computed):
            self.manager.drop_outside_window(request_id, done)  # as the scheduler does
            assert self.manager.allocate(request_id, done + new)
        self.state.apply_deltas(self.manager.take_deltas())
        for request_id in self.req_ids:
            self.state.requests[request_id].config = self.config
        step = self.state.prepare_step(
            self.req_ids, np.array(num_new), np.array(computed), np.array(PROMPTS),
            observation_windows=[WINDOW] * len(PROMPTS),
            wants_compression=[self.config.compresses(q) for q in PROMPTS],
        )
        total = sum(num_new)
        metadata = PagedAttentionMetadata(step, total, self.kernel, self.kernel.prepare(step),
                                          {})
        queries, outputs = [], []
        for layer in range(LAYERS):
            query = self.random(total, KV_HEADS * GROUP, HEAD_SIZE)
            key, value = (self.random(total, KV_HEADS, HEAD_SIZE) for _ in range(2))
            for r, (start, stop) in enumerate(zip(step.query_start_loc, step.query_start_loc[1:])):
                for head in range(KV_HEADS):
                    row = layer * KV_HEADS + head
                    old_k = self.keys.get((r, row), key[:0, 0])
                    old_v = self.values.get((r, row), value[:0, 0])
                    self.keys[r, row] = torch.cat([old_k, key[start:stop, head]])
                    self.values[r, row] = torch.cat([old_v, value[start:stop, head]])
            output = torch.empty_like(query)
            # A layer's write, attention and scores never wait for the device (checked on
            # CUDA by scripts/gpu_check.sh: KVCOMPRESS_SYNC_DEBUG=error).
            with no_sync_region(self.device):
                attend_layer(metadata, layer, query, key, value, self.pool, output, SCALE,
                             sliding_window=self.layout.window_of(layer) or None)
            queries.append(query)
            outputs.append(output)
        self.state.finish_step(step)
        return step, queries, outputs

    def check_attention(self, step, queries, outputs, kept: dict | None = None):
        """Each head's output against dense attention over what it should hold (all tokens,
        or after compaction the kept prompt positions plus what came after)."""
        for layer in range(LAYERS):
            for r, (start, stop) in enumerate(zip(step.query_start_loc, step.query_start_loc[1:])):
                for head in range(KV_HEADS):
                    row = layer * KV_HEADS + head
                    keys, values = self.keys[r, row], self.values[r, row]
                    first = keys.shape[0] - (stop - start)
                    if kept is not None and (r, row) in kept:
                        positions = kept[r, row] + list(range(PROMPTS[r], keys.shape[0]))
                        keys, values = keys[positions], values[positions]
                        first = keys.shape[0] - (stop - start)
                    query = queries[layer][start:stop, head * GROUP:(head + 1) * GROUP]
                    want = dense_attention(query, keys, values, first,
                                           self.layout.window_of(layer))
                    got = outputs[layer][start:stop, head * GROUP:(head + 1) * GROUP]
                    torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=2e-4)

    def check_pages(self):
        self.manager.check_invariants()
        for request_id in self.req_ids:
            lengths = self.manager.physical_lengths(request_id)
            assert (lengths == self.state.requests[request_id].lengths).all()
            held = self.manager.owned_pages(request_id)
            assert held == int((-(-lengths // PAGE_SIZE)).sum())


@pytest.mark.parametrize(("device", "use_triton"), target_params())
@pytest.mark.parametrize("mover", ["torch", "kernel", "native"])
@pytest.mark.parametrize("method", METHODS)
def test_prefill_compact_decode(monkeypatch, device, use_triton, mover, method):
    if use_triton and device == "cpu":
        use_interpreter(monkeypatch)
    if mover == "native" and device != "cuda":
        pytest.skip("the native move runs on CUDA only")
    pipeline = Pipeline(device, use_triton, mover, method)

    # Prefill every prompt in one step: attention, and the window scores of those to compress.
    step, queries, outputs = pipeline.step(PROMPTS, [0] * len(PROMPTS))
    pipeline.check_attention(step, queries, outputs)
    scores = {}
    for r, request_id in enumerate(pipeline.req_ids):
        request = pipeline.state.requests[request_id]
        if request.window_scores is None:
            continue
        window_queries = torch.stack([
            queries[layer][step.query_start_loc[r] + PROMPTS[r] - WINDOW:
                           step.query_start_loc[r] + PROMPTS[r]].transpose(0, 1)
            for layer in range(LAYERS)])  # [L, Hq, W, D]
        keys = torch.stack([torch.stack([pipeline.keys[r, layer * KV_HEADS + head]
                                         for head in range(KV_HEADS)])
                            for layer in range(LAYERS)])  # [L, H, S, D]
        want = observation_window_scores(window_queries.float(), keys.float(), scale=SCALE)
        torch.testing.assert_close(request.window_scores, want, atol=1e-4, rtol=1e-4)
        scores[r] = request.window_scores.clone()

    # Compact: exactly the policy's tokens stay, the scheduler frees the rest.
    step.completing_prompt = [r for r in range(len(PROMPTS)) if PROMPTS[r] > BUDGET]
    free_before = pipeline.manager.num_free
    # The runtime's step-level entry (one device->host transfer for the step).
    compactions = compress_step(pipeline.state, step, pipeline.pool, pipeline.mover)
    for request_id, compaction in compactions.items():
        pipeline.manager.release_after_compression(request_id, compaction.logical_len,
                                                   compaction.physical_lengths)
    assert pipeline.manager.num_free > free_before
    kept = {}
    for r in step.completing_prompt:
        plan = plan_keep(pipeline.config.policy, [PROMPTS[r]], [scores.get(r)],
                         num_layers=LAYERS, num_kv_heads=KV_HEADS).to("cpu")
        for row in range(ROWS):
            count = int(plan.counts[0].reshape(ROWS)[row])
            kept[r, row] = plan.indices[0].reshape(ROWS, -1)[row, :count].tolist()
            request = pipeline.state.requests[pipeline.req_ids[r]]
            assert request.lengths[row] == count
            slots = torch.as_tensor(request.table.pages[row].astype(np.int64))
            positions = torch.arange(count)
            slots = (slots[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE)
            stored, _ = GPU_PAGE_FORMAT.read_tokens(pipeline.pool, slots.to(pipeline.device))
            want = pipeline.keys[r, row][kept[r, row]]
            # hole filling keeps the set, not the order
            assert sorted(stored[:, 0].tolist()) == sorted(want[:, 0].tolist())
    pipeline.check_pages()

    # Decode one token each: attention over the kept tokens (order inside a row is free).
    step, queries, outputs = pipeline.step([1] * len(PROMPTS), PROMPTS)
    pipeline.check_attention(step, queries, outputs, kept)
    pipeline.check_pages()
    for request_id in pipeline.req_ids:
        pipeline.manager.free(request_id)
    assert pipeline.manager.num_free == pipeline.layout.total_pages


@pytest.mark.parametrize(("device", "use_triton"), target_params())
def test_sliding_window_layer_drops_pages_and_is_never_compacted(monkeypatch, device,
                                                                   use_triton):
    """Layer 0 slides (window 8), layer 1 is full attention. Prompts prefill in chunks of 20,
    the scheduler side drops the sliding rows' dead leading pages before each step, and
    attention stays the dense windowed one; a completed prompt is compacted by the policy on
    the full-attention rows only, then decodes; pages accounted every step."""
    if use_triton and device == "cpu":
        use_interpreter(monkeypatch)
    sliding = 8
    # The method's own split, so each full-attention row keeps exactly BUDGET.
    pipeline = Pipeline(device, use_triton, "kernel", "pyramidkv", layer_windows=(sliding, 0),
                        sharing="layer")
    computed, kept = [0] * len(PROMPTS), {}
    dropped = 0
    for _ in range(8):
        num_new = [min(20, prompt - done) if done < prompt else 1
                   for prompt, done in zip(PROMPTS, computed)]
        free_before = pipeline.manager.num_free
        step, queries, outputs = pipeline.step(num_new, computed)
        dropped += pipeline.manager.num_free < free_before
        pipeline.check_attention(step, queries, outputs, kept)
        # The runtime compacts completed prompts after the forward; the scheduler frees.
        for request_id, compaction in compact_completed_prompts(
                pipeline.state, step, pipeline.pool, pipeline.mover).items():
            pipeline.manager.release_after_compression(request_id, compaction.logical_len,
                                                       compaction.physical_lengths)
            r = pipeline.req_ids.index(request_id)
            request = pipeline.state.requests[request_id]
            assert request.window_scores is None and request.compressed
            for row in range(KV_HEADS, ROWS):  # full-attention rows: the policy's budget
                assert request.lengths[row] == BUDGET
            # Kept prompt positions per full-attention row, read back from the pool.
            for row in range(KV_HEADS, ROWS):
                slots = torch.as_tensor(request.table.pages[row].astype(np.int64))
                positions = torch.arange(BUDGET)
                slots = slots[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
                stored, _ = GPU_PAGE_FORMAT.read_tokens(pipeline.pool, slots.to(pipeline.device))
                history = pipeline.keys[r, row][:PROMPTS[r], 0]
                kept[r, row] = sorted(int((history == value).nonzero()[0, 0])
                                      for value in stored[:, 0])
        pipeline.check_pages()
        computed = [done + new for done, new in zip(computed, num_new)]
        for request_id in pipeline.req_ids:
            lengths = pipeline.manager.physical_lengths(request_id)
            # A sliding row: its window, less than a page of dead slack, this step's chunk.
            assert (lengths[:KV_HEADS] <= sliding - 1 + PAGE_SIZE - 1 + 20).all()
    assert dropped and {r for r, _ in kept} == {0, 1, 2}  # the 12-token prompt fits
    for request_id in pipeline.req_ids:
        pipeline.manager.free(request_id)
    assert pipeline.manager.num_free == pipeline.layout.total_pages


def test_the_layers_run_in_the_no_sync_region(monkeypatch):
    """What scripts/gpu_check.sh checks on CUDA (KVCOMPRESS_SYNC_DEBUG=error: a sync in a
    layer raises) is wrapped around every layer; on CPU the region is entered, nothing else."""
    monkeypatch.setenv(sync_debug.ENV, "error")
    pipeline = Pipeline("cpu", False, "torch", "snapkv")
    entered = sync_debug.counter.entered
    pipeline.step(PROMPTS, [0] * len(PROMPTS))
    assert sync_debug.counter.entered - entered == LAYERS
