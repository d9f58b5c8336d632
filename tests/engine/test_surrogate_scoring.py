"""``--kv-scoring surrogate`` on the worker, without vLLM: every prompt token's score is
written in the step that prefills it (chunked prefill too), equal to the surrogate's own
formula over the same K/V (the reference: ``ScoreSurrogate.log_scores``), at the token's
slot in every row (an adopter's rows of unequal length included); sliding-window layers
and tokens past the prompt stay unscored; no window scores; then the plan shares the budget
model-wide, keeps the exact total and the pages stay accounted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcompress.attention.gpu_kernel import TritonPagedKernel
from kvcompress.attention.layer import attend_layer
from kvcompress.engine.worker.compression import compress_step
from kvcompress.engine.worker.state import WorkerKVState
from kvcompress.paging import PageLayout, PageManager, PageTableDelta
from kvcompress.profile_model.surrogates import (
    NUM_POSITION_FEATURES,
    ScoreSurrogate,
    position_features,
)
from kvcompress.settings.config import KVCompressionConfig
from kvcompress.step import PagedAttentionMetadata

LAYERS, HEADS, GROUP, DIM, PAGE = 3, 2, 2, 16, 8
SCALE = DIM**-0.5


def make_surrogate(seed: int = 0) -> ScoreSurrogate:
    generator = torch.Generator().manual_seed(seed)
    return ScoreSurrogate(torch.randn(LAYERS, HEADS, DIM, generator=generator) * 0.3,
                          torch.randn(LAYERS, HEADS, DIM, generator=generator) * 0.3,
                          torch.randn(LAYERS, HEADS, NUM_POSITION_FEATURES,
                                      generator=generator),
                          torch.randn(LAYERS, HEADS, generator=generator) - 4, "test", 1)


class Worker:
    """A page manager, the worker's mirror and a pool, driven step by step."""

    def __init__(self, config: KVCompressionConfig, layer_windows: tuple[int, ...] = ()):
        self.layout = PageLayout(LAYERS, HEADS, DIM, PAGE, 4, total_pages=300,
                                 layer_windows=layer_windows)
        self.manager = PageManager(self.layout)
        self.state = WorkerKVState(self.layout, torch.device("cpu"))
        self.pool = torch.zeros(300, 2, PAGE, DIM)
        self.kernel = TritonPagedKernel(self.layout, torch.float32, torch.device("cpu"),
                                        use_triton=False)
        self.config = config
        self.surrogate = make_surrogate()
        self.generator = torch.Generator().manual_seed(3)
        # what each (request, layer) wrote, in logical order: [tokens, H, D]
        self.keys: dict[tuple[str, int], torch.Tensor] = {}
        self.values: dict[tuple[str, int], torch.Tensor] = {}

    def step(self, req_ids, num_new, computed, prompts):
        for request_id, new, done in zip(req_ids, num_new, computed):
            assert self.manager.allocate(request_id, done + new)
        self.state.apply_deltas(self.manager.take_deltas())
        for request_id in req_ids:
            self.state.requests[request_id].config = self.config
        step = self.state.prepare_step(
            req_ids, np.array(num_new), np.array(computed), np.array(prompts),
            observation_windows=[self.config.window] * len(req_ids),
            wants_compression=[self.config.compresses(q) for q in prompts],
            surrogate=self.surrogate, surrogate_scored=[True] * len(req_ids))
        total = sum(num_new)
        metadata = PagedAttentionMetadata(step, total, self.kernel, self.kernel.prepare(step),
                                          {})
        for layer in range(LAYERS):
            query = torch.randn(total, HEADS * GROUP, DIM, generator=self.generator)
            key, value = torch.randn(2, total, HEADS, DIM, generator=self.generator)
            for number, request_id in enumerate(req_ids):
                part = slice(step.query_start_loc[number], step.query_start_loc[number + 1])
                for store, new in ((self.keys, key), (self.values, value)):
                    old = store.get((request_id, layer), new[:0])
                    store[request_id, layer] = torch.cat([old, new[part]])
            attend_layer(metadata, layer, query, key, value, self.pool, torch.empty_like(query),
                         SCALE, sliding_window=self.layout.window_of(layer) or None)
        self.state.finish_step(step)
        return step

    def expected(self, request_id: str, layer: int, prompt_len: int):
        """``[H, n]``: the surrogate's scores of the request's first ``n`` written tokens
        (at most the prompt)."""
        keys = self.keys[request_id, layer][:prompt_len]
        values = self.values[request_id, layer][:prompt_len]
        positions = torch.arange(keys.shape[0])
        return self.surrogate.log_scores(layer, keys, values,
                                         position_features(positions, prompt_len)).exp().T


def config(**extra) -> KVCompressionConfig:
    return KVCompressionConfig.from_mapping({"kv_compression": "pyramidkv", "kv_budget": 16,
                                             "kv_window": 4, "kv_scoring": "surrogate",
                                             **extra})


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "middle-layer-slides"])
def test_chunked_prefill_scores_every_prompt_token_in_its_own_step(sliding):
    worker = Worker(config(), layer_windows=(0, 64, 0) if sliding else ())
    prompts = [61, 40, 9]  # 61 in three chunks; 9 is not compressed (budget 16)
    ids = ["a", "b", "c"]
    first = worker.step(ids, [25, 40, 9], [0, 0, 0], prompts)
    assert [entry.batch_index for entry in first.surrogate_plan.entries] == [0, 1]
    assert first.window_queries == [] and first.completing_prompt == [1]
    scores_a = worker.state.requests["a"].window_scores
    # what the first chunk wrote is there already, the rest still zero
    torch.testing.assert_close(scores_a[0, :, :25], worker.expected("a", 0, 61))
    assert (scores_a[:, :, 25:] == 0).all()
    worker.state.requests["b"].window_scores = None  # as its compaction would
    worker.step(["a"], [20], [25], [61])
    worker.step(["a"], [16], [45], [61])
    state = worker.state.requests["a"]
    assert state.query_agnostic
    for layer in range(LAYERS):
        got = state.window_scores[layer]
        if sliding and layer == 1:
            assert (got == 0).all()  # never compressed, so never scored
            continue
        torch.testing.assert_close(got, worker.expected("a", layer, 61), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("scoring", ["surrogate", "hybrid-surrogate"])
def test_an_adopters_new_segment_is_scored_at_each_rows_own_slots(scoring):
    """Beside a window (hybrid), by physical slot, as the window's scores; by the surrogate
    alone, by position in the new segment only: an adopter of a long context (a whole
    shared prefix) holds scores of its own tokens only."""
    worker = Worker(config(kv_scoring=scoring))
    adopted_rows = np.array([5, 9, 12, 7, 5, 10], dtype=np.int64)
    new_tokens, adopted_len = 30, 20
    needed = -(-(adopted_rows + new_tokens) // PAGE)
    ids = np.random.default_rng(0).permutation(300)[: needed.sum()].astype(np.int32)
    worker.state.apply_deltas({"r": PageTableDelta(fresh=True,
                                                   appends=[(needed.astype(np.int32), ids)])})
    request = worker.state.requests["r"]
    request.lengths = adopted_rows.copy()
    request.adopted_len, request.adopted_rows = adopted_len, adopted_rows.copy()
    request.config = worker.config
    prompt_len = adopted_len + new_tokens
    step = worker.state.prepare_step(
        ["r"], np.array([new_tokens]), np.array([adopted_len]), np.array([prompt_len]),
        observation_windows=[4], wants_compression=[True], surrogate=worker.surrogate,
        surrogate_scored=[True])
    entry = step.surrogate_plan.entries[0]
    alone = scoring == "surrogate"
    if alone:
        assert entry.first_slot == 0 and entry.slot_base is None
        width = new_tokens
    else:
        assert entry.first_slot is None and entry.slot_base.tolist() == adopted_rows.tolist()
        width = int(adopted_rows.max()) + new_tokens
    assert request.window_scores.shape == (LAYERS, HEADS, width)
    metadata = PagedAttentionMetadata(step, new_tokens, worker.kernel,
                                      worker.kernel.prepare(step), {})
    for layer in range(LAYERS):
        query = torch.randn(new_tokens, HEADS * GROUP, DIM)
        key, value = torch.randn(2, new_tokens, HEADS, DIM)
        attend_layer(metadata, layer, query, key, value, worker.pool, torch.empty_like(query),
                     SCALE)
        positions = torch.arange(adopted_len, prompt_len)
        want = worker.surrogate.log_scores(layer, key, value,
                                           position_features(positions, prompt_len)).exp().T
        for head in range(HEADS):
            first = 0 if alone else int(adopted_rows[layer * HEADS + head])
            got = request.window_scores[layer, head]
            torch.testing.assert_close(got[first : first + new_tokens], want[head])
            assert (got[:first] == 0).all() and (got[first + new_tokens :] == 0).all()


def test_a_segments_tokens_are_scored_at_their_readers_distance():
    """A shared prefix's segment request (``readers_after``: its median reader's own tokens
    after it): its tokens' place features count their distance from its readers' prompt end,
    as the surrogate learned them, not from the segment's own end."""
    prompt_len, readers_after = 40, 25
    scores = {}
    for after in (0, readers_after):
        worker = Worker(config())
        assert worker.manager.allocate("s", prompt_len)
        worker.state.apply_deltas(worker.manager.take_deltas())
        worker.state.requests["s"].readers_after = after
        worker.step(["s"], [prompt_len], [0], [prompt_len])
        scores[after] = worker.state.requests["s"].window_scores[..., :prompt_len].clone()
        keys = worker.keys["s", 0]
        values = worker.values["s", 0]
        positions = torch.arange(prompt_len)
        want = worker.surrogate.log_scores(
            0, keys, values, position_features(positions, prompt_len + after)).exp().T
        torch.testing.assert_close(scores[after][0], want)
    assert not torch.equal(scores[0], scores[readers_after])


def test_hybrid_surrogate_keeps_the_windows_scores_apart():
    """hybrid-surrogate: the surrogate fills the query-agnostic accumulator over the whole
    prompt, the observation window its own (``query_scores``), both in the prefill."""
    worker = Worker(config(kv_scoring="hybrid-surrogate"))
    worker.step(["a"], [30], [0], [50])
    request = worker.state.requests["a"]
    assert request.query_scores is not None and (request.query_scores == 0).all()
    step = worker.step(["a"], [20], [30], [50])
    assert [window.num_queries for window in step.window_queries] == [4]
    assert step.window_queries[0].scores is request.query_scores
    assert (request.query_scores[:, :, :50] > 0).any()
    for layer in range(LAYERS):
        torch.testing.assert_close(request.window_scores[layer],
                                   worker.expected("a", layer, 50), rtol=1e-5, atol=1e-7)
    compactions = compress_step(worker.state, step, worker.pool, worker.kernel, None,
                                worker.kernel.page_format)
    assert compactions["a"].physical_lengths.sum() == 16 * LAYERS * HEADS


def test_compaction_after_surrogate_scores_shares_the_budget_model_wide():
    worker = Worker(config())
    prompts = [64, 48]
    step = worker.step(["a", "b"], prompts, [0, 0], prompts)
    assert step.completing_prompt == [0, 1]
    compactions = compress_step(worker.state, step, worker.pool, worker.kernel, None,
                                worker.kernel.page_format)
    assert set(compactions) == {"a", "b"}
    for request_id in ("a", "b"):
        compaction = compactions[request_id]
        lengths = compaction.physical_lengths
        # the budget's total over every row, shared by score: rows differ
        assert lengths.sum() == 16 * LAYERS * HEADS
        assert len(set(lengths.tolist())) > 1
        assert (lengths >= 4).all()  # every row keeps its window
        worker.manager.release_after_compression(request_id, compaction.logical_len, lengths)
        assert worker.state.requests[request_id].window_scores is None
    worker.manager.check_invariants()
    for request_id in ("a", "b"):
        lengths = worker.manager.physical_lengths(request_id)
        assert worker.manager.owned_pages(request_id) == int((-(-lengths // PAGE)).sum())


def test_a_surrogate_that_extrapolates_wildly_gives_finite_scores():
    """Predicted log scores are clamped before their exp (issue 51): a surrogate whose
    weights blow up on these keys (exp of +-1e4, and NaN from inf - inf) still writes finite,
    positive scores, and the prompt is compacted to its budget."""
    worker = Worker(config())
    wild = make_surrogate()
    wild.key_weights[0] *= 1e4  # layer 0: log scores of +-1e4
    wild.bias[1] = float("inf")
    wild.position_weights[1, :, 0] = float("-inf")  # layer 1: inf - inf = NaN
    worker.surrogate = wild
    step = worker.step(["a"], [40], [0], [40])
    scores = worker.state.requests["a"].window_scores
    assert scores is not None and torch.isfinite(scores).all() and (scores > 0).all()
    layer0 = scores[0].flatten()
    assert layer0.max() > 1e15 and layer0.min() < 1e-10  # clamped, not flattened
    compactions = compress_step(worker.state, step, worker.pool, worker.kernel, None,
                                worker.kernel.page_format)
    assert compactions["a"].physical_lengths.sum() == 16 * LAYERS * HEADS
