"""Reconstruction passes (``--kv-scoring reconstruct``) on the worker, without vLLM: the pass's
batch (where its K/V go, what it attends to) and its scores against a dense reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcompress.attention.reconstruction_scores import accumulate_reconstruction_scores
from kvcompress.engine.worker.reconstruction import Reconstructor
from kvcompress.engine.worker.state import WorkerKVState
from kvcompress.kernels.logits import attention_probs
from kvcompress.paging import PageLayout, PageTableDelta
from kvcompress.paging.page_format import CPU_PAGE_FORMAT, GPU_PAGE_FORMAT
from tests.paged_cases import model_softmax

LAYERS, HEADS, GROUP, DIM, PAGE = 3, 2, 3, 16, 8


def all_passes(reconstructor: Reconstructor, step, request_ids, prompt_tokens):
    """Register the requests' passes and run every chunk at once (one grant)."""
    registered = reconstructor.register(step, request_ids, prompt_tokens)
    return reconstructor.passes({r: len(chunks) for r, chunks in registered.items()})


def make_state(lengths: list[int], chunk: int, repeat: int, spare_pages: int = 5):
    """One request whose rows hold ``lengths`` prompt slots, pages in a shuffled pool with
    scratch pages for ``chunk + repeat`` tokens per row after them."""
    rows = LAYERS * HEADS
    needed = [-(-length // PAGE) for length in lengths]
    total = sum(needed) + spare_pages
    scratch = rows * (-(-(chunk + repeat) // PAGE))
    layout = PageLayout(LAYERS, HEADS, DIM, PAGE, 4, total, scratch_pages=scratch)
    state = WorkerKVState(layout, torch.device("cpu"))
    ids = np.random.default_rng(0).permutation(total).astype(np.int32)[: sum(needed)]
    state.apply_deltas({"r": PageTableDelta(fresh=True,
                                            appends=[(np.array(needed, np.int32), ids)])})
    request = state.requests["r"]
    request.lengths = np.array(lengths, dtype=np.int64)
    request.prompt_len = max(lengths)
    return layout, state


def dense_reference(queries, keys, context, scale, soft_cap=None, sinks=None):
    """Loop reference for one row: queries [T, G, D] at slots context + i, keys [context + T,
    D] -> [context] max probability over the queries and the group."""
    best = torch.zeros(context, dtype=torch.float64)
    for i in range(queries.shape[0]):
        for g in range(queries.shape[1]):
            logits = keys[: context + i + 1].double() @ queries[i, g].double() * scale
            sink = None if sinks is None else sinks[g].view(1)
            probs = attention_probs(logits[None], soft_cap, sink)[0].double()
            best = torch.maximum(best, probs[:context])
    return best


@pytest.mark.parametrize("page_format", [CPU_PAGE_FORMAT, GPU_PAGE_FORMAT],
                         ids=["transposed", "row"])
@pytest.mark.parametrize("softmax", [None, "soft_cap", "sinks"])
@pytest.mark.parametrize("max_elements", [None, 64], ids=["one-block", "page-chunks"])
def test_scores_match_dense_reference(page_format, softmax, max_elements):
    """Rows of unequal length (an adopter's), two chunks combined by max, GQA, soft-cap and
    sinks: every stored score equals the loop reference's, nothing past a row's prompt; so
    does a scoring walking the keys a page and the queries one at a time."""
    lengths = [21, 21, 17, 30, 9, 21]
    layout, state = make_state(lengths, chunk=7, repeat=3)
    request = state.requests["r"]
    request.window_scores = torch.zeros(LAYERS, HEADS, max(lengths))
    pool = torch.full((layout.total_pages + layout.scratch_pages, 2, PAGE, DIM), 50.0)
    generator = torch.Generator().manual_seed(1)
    dense = {}
    for row, length in enumerate(lengths):
        keys, values = torch.randn(2, length, DIM, generator=generator)
        positions = torch.arange(length)
        slots = torch.as_tensor(request.table.pages[row])[positions // PAGE].long() * PAGE
        page_format.write_tokens(pool, keys, values, slots + positions % PAGE)
        dense[row] = keys
    kwargs = {} if softmax is None else model_softmax(softmax, HEADS * GROUP)
    chunking = {} if max_elements is None else {"max_elements": max_elements}
    reconstructor = Reconstructor(state, [101, 102, 103], chunk=7)
    step = _completed_step(state, lengths)
    prompt = list(range(max(lengths)))
    expected = torch.zeros(LAYERS, HEADS, max(lengths), dtype=torch.float64)
    scale = DIM**-0.5
    passes = 0
    # One at a time, as the runtime runs them: a pass's tables hold until the next is built.
    for one in all_passes(reconstructor, step, ["r"], lambda _: prompt):
        passes += 1
        batch = one.step
        tokens = len(one.input_ids)
        assert one.positions.tolist() == list(range(max(lengths), max(lengths) + tokens))
        keys = torch.randn(tokens, layout.num_rows, DIM, generator=generator)
        query = torch.randn(tokens, HEADS * GROUP, DIM, generator=generator)
        for layer in range(LAYERS):
            rows = batch.layer_rows(layer)
            page_format.write_tokens(pool, keys[:, rows].reshape(-1, DIM),
                                     keys[:, rows].reshape(-1, DIM),
                                     batch.slot_mapping[:, rows].reshape(-1))
            (window,) = batch.window_queries
            accumulate_reconstruction_scores(query, pool, page_format, batch, window, layer,
                                             scale, **kwargs, **chunking)
            for head in range(HEADS):
                row = layer * HEADS + head
                context = lengths[row]
                sinks = kwargs.get("sinks")
                reference = dense_reference(
                    query[:, head * GROUP : (head + 1) * GROUP],
                    torch.cat([dense[row], keys[:, row]]), context, scale,
                    kwargs.get("soft_cap"),
                    None if sinks is None else sinks[head * GROUP : (head + 1) * GROUP].float())
                expected[layer, head, :context] = torch.maximum(
                    expected[layer, head, :context], reference)
    assert passes == -(-max(lengths) // 7)
    torch.testing.assert_close(request.window_scores.double(), expected, atol=1e-5, rtol=1e-4)


def test_pass_writes_only_its_rows_tails_and_scratch():
    """The pass's K/V go after each row's prompt: into the tail of the row's last page, then
    into that row's own scratch pages; no other page of the pool is written."""
    lengths = [13, 13, 16, 5, 13, 13]
    layout, state = make_state(lengths, chunk=13, repeat=4)
    request = state.requests["r"]
    reconstructor = Reconstructor(state, [1, 2, 3, 4], chunk=13)
    step = _completed_step(state, lengths)
    (one,) = all_passes(reconstructor, step, ["r"], lambda _: list(range(13)))
    slots = one.step.slot_mapping.numpy()  # [T, rows]
    assert slots.shape == (4 + 13, layout.num_rows)
    tokens = slots.shape[0]
    pages = slots // PAGE
    scratch = np.arange(layout.total_pages, layout.total_pages + layout.scratch_pages)
    for row, length in enumerate(lengths):
        own = request.table.pages[row, : request.table.num_pages[row]]
        allowed = set(own.tolist()) | set(scratch.tolist())
        assert set(pages[:, row].tolist()) <= allowed
        # consecutive slots of the row after its prompt
        scratch_used = [page for page in dict.fromkeys(pages[:, row].tolist()) if page not in own]
        table = np.concatenate([own, np.array(scratch_used, dtype=own.dtype)])
        positions = [int(np.flatnonzero(table == page)[0]) * PAGE + slot % PAGE
                     for page, slot in zip(pages[:, row], slots[:, row])]
        assert positions == list(range(length, length + tokens))
    scratch_rows = {row: set(pages[:, row].tolist()) & set(scratch.tolist())
                    for row in range(layout.num_rows)}
    for a in range(layout.num_rows):  # rows never share a scratch page
        for b in range(a + 1, layout.num_rows):
            assert not scratch_rows[a] & scratch_rows[b]
    assert one.step.reconstruction and one.step.window_queries[0].group_reduce == "max"


def test_short_prompts_share_one_pass_without_sharing_slots():
    """Two requests whose chunks fit one pass together: one forward, each request's queries
    at its own positions, its K/V in its own rows' tails and scratch pages, scores like the
    reference of each alone."""
    rows = LAYERS * HEADS
    lengths = {"a": [11] * rows, "b": [6] * rows}
    needed = {name: [-(-n // PAGE) for n in rows_] for name, rows_ in lengths.items()}
    total = sum(map(sum, needed.values())) + 3
    scratch = rows * (-(-(24 + 2) // PAGE))
    layout = PageLayout(LAYERS, HEADS, DIM, PAGE, 4, total, scratch_pages=scratch)
    state = WorkerKVState(layout, torch.device("cpu"))
    ids = iter(np.random.default_rng(3).permutation(total).astype(np.int32).tolist())
    pool = torch.zeros(total + scratch, 2, PAGE, DIM)
    generator = torch.Generator().manual_seed(5)
    dense = {}
    for name, row_lengths in lengths.items():
        counts = np.array(needed[name], np.int32)
        state.apply_deltas({name: PageTableDelta(
            fresh=True, appends=[(counts, np.array([next(ids) for _ in range(counts.sum())],
                                                   np.int32))])})
        request = state.requests[name]
        request.lengths = np.array(row_lengths, dtype=np.int64)
        request.prompt_len = row_lengths[0]
        request.window_scores = torch.zeros(LAYERS, HEADS, row_lengths[0])
        for row, length in enumerate(row_lengths):
            keys = torch.randn(length, DIM, generator=generator)
            positions = torch.arange(length)
            slots = torch.as_tensor(request.table.pages[row])[positions // PAGE].long() * PAGE
            CPU_PAGE_FORMAT.write_tokens(pool, keys, keys, slots + positions % PAGE)
            dense[name, row] = keys
    from kvcompress.step import StepBatch

    after = np.array([lengths["a"], lengths["b"]], dtype=np.int64)
    step = StepBatch(
        layout=layout, req_ids=["a", "b"], query_start_loc=[0, 1, 2],
        num_new_tokens=torch.tensor([1, 1]), lengths_before=torch.as_tensor(after - 1),
        tables=None, slot_mapping=torch.zeros(2, rows, dtype=torch.long),
        logical_after=np.array([11, 6]), host_lengths_before=after - 1,
        host_lengths_after=after, completing_prompt=[0, 1])
    reconstructor = Reconstructor(state, [7, 8], chunk=24)
    (one,) = list(all_passes(reconstructor, step, ["a", "b"], lambda name: list(range(100, 111))))
    assert one.request_ids == ["a", "b"]
    assert one.step.query_start_loc == [0, 13, 21]
    assert one.positions.tolist() == list(range(11, 24)) + list(range(6, 14))
    assert one.input_ids.tolist()[:3] == [7, 8, 100]
    slots = one.step.slot_mapping.numpy()
    for row in range(rows):  # no slot written twice, none inside a prompt
        assert len(set(slots[:, row].tolist())) == 21
    pages_a, pages_b = set((slots[:13] // PAGE).ravel()), set((slots[13:] // PAGE).ravel())
    assert not pages_a & pages_b
    query = torch.randn(21, HEADS * GROUP, DIM, generator=generator)
    keys = torch.randn(21, rows, DIM, generator=generator)
    scale = DIM**-0.5
    for layer in range(LAYERS):
        layer_rows = one.step.layer_rows(layer)
        CPU_PAGE_FORMAT.write_tokens(pool, keys[:, layer_rows].reshape(-1, DIM),
                                     keys[:, layer_rows].reshape(-1, DIM),
                                     one.step.slot_mapping[:, layer_rows].reshape(-1))
        for window in one.step.window_queries:
            accumulate_reconstruction_scores(query, pool, CPU_PAGE_FORMAT, one.step, window,
                                             layer, scale)
    for name, first, last in (("a", 0, 13), ("b", 13, 21)):
        for row in range(rows):
            layer, head = divmod(row, HEADS)
            reference = dense_reference(
                query[first:last, head * GROUP : (head + 1) * GROUP],
                torch.cat([dense[name, row], keys[first:last, row]]), lengths[name][row], scale)
            torch.testing.assert_close(state.requests[name].window_scores[layer, head].double(),
                                       reference, atol=1e-5, rtol=1e-4)


def test_hybrid_keeps_the_window_scores_apart_from_the_passes():
    """Hybrid scoring: the window's accumulator (filled in the forward) moves aside and the
    passes fill a fresh one; the plan ranks by both."""
    lengths = [12] * (LAYERS * HEADS)
    layout, state = make_state(lengths, chunk=16, repeat=2)
    request = state.requests["r"]
    window = torch.rand(LAYERS, HEADS, 12)
    request.window_scores = window
    step = _completed_step(state, lengths)
    passes = all_passes(Reconstructor(state, [1, 2], chunk=16), step, ["r"],
                        lambda _: list(range(12)))
    one = next(passes)
    assert request.query_scores is window
    assert request.window_scores is not window and float(request.window_scores.abs().sum()) == 0
    assert one.step.window_queries[0].scores is request.window_scores


def test_a_small_scratch_runs_shorter_passes_and_none_is_refused():
    layout, state = make_state([10] * 6, chunk=8, repeat=0)  # one page of 8 per row
    assert Reconstructor(state, [1] * 3, chunk=64).chunk == 5
    with pytest.raises(ValueError, match="scratch pages"):
        Reconstructor(state, [1] * 8, chunk=64)


def _completed_step(state: WorkerKVState, lengths: list[int]):
    """A step whose forward wrote the whole prompt (lengths after = ``lengths``)."""
    from kvcompress.step import StepBatch

    request = state.requests["r"]
    after = np.array([lengths], dtype=np.int64)
    return StepBatch(
        layout=state.layout, req_ids=["r"], query_start_loc=[0, 1],
        num_new_tokens=torch.tensor([1]), lengths_before=torch.as_tensor(after - 1),
        tables=None, slot_mapping=torch.zeros(1, state.layout.num_rows, dtype=torch.long),
        logical_after=np.array([request.prompt_len]), host_lengths_before=after - 1,
        host_lengths_after=after, completing_prompt=[0])


def test_granted_chunks_run_step_by_step_as_they_would_at_once():
    """Passes are scheduled work: chunks granted one step at a time are the same passes as
    all granted at once; the request is done after its last, and a forgotten request's
    grant runs nothing."""
    lengths = [21] * 6
    prompt = list(range(500, 521))
    layout, state = make_state(lengths, chunk=7, repeat=3)
    reconstructor = Reconstructor(state, [101, 102, 103], chunk=7)
    step = _completed_step(state, lengths)
    at_once = [(one.input_ids.tolist(), one.positions.tolist())
               for one in all_passes(reconstructor, step, ["r"], lambda _: prompt)]
    assert len(at_once) == 3
    registered = reconstructor.register(step, ["r"], lambda _: prompt)
    assert registered == {"r": [10, 10, 10]}
    assert reconstructor.logical_len["r"] == int(step.logical_after[0])
    one_by_one = []
    for _ in range(3):
        assert not reconstructor.done("r")
        (one,) = reconstructor.passes({"r": 1})
        one_by_one.append((one.input_ids.tolist(), one.positions.tolist()))
    assert one_by_one == at_once
    assert reconstructor.done("r")
    completed = reconstructor.completed(["r"])
    assert completed.completing_prompt == [0] and completed.logical_after.tolist() == [21]
    reconstructor.forget(["r"])
    assert not reconstructor.done("r") and list(reconstructor.passes({"r": 2})) == []
