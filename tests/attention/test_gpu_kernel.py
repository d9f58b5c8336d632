"""TritonPagedKernel (the GPU attention kernel adapter) on CPU tensors, Triton interpreted.

Same random per-head layouts as the CPU kernel's tests (tests/paged_cases.py), same
dense reference; plus window scores against the torch path, the move hook, and compaction
through the hook.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from kvcompress.attention.gpu_kernel import TritonPagedKernel
from kvcompress.attention.window_scores import accumulate_window_scores
from kvcompress.config import KVCompressionConfig
from kvcompress.engine.worker_compaction import compact_completed_prompts
from kvcompress.paging.page_format import GPU_PAGE_FORMAT
from tests.paged_cases import MODEL_SOFTMAXES, build_case, dense_attention, model_softmax

pytestmark = pytest.mark.usefixtures("interpreter")

LAYERS, HEADS, HEAD_SIZE, PAGE_SIZE = 2, 2, 32, 16
# Unequal head lengths (a compressed request), decode, chunked prefill on context, fresh prompt.
MIXED = ([[5, 9, 33, 1], [40, 40, 40, 40], [3, 17, 2, 60], [0, 0, 0, 0]], [1, 7, 1, 20])
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _case(lengths, num_new, dtype=torch.float32, group=2, **kwargs):
    return build_case(GPU_PAGE_FORMAT, lengths, num_new, num_layers=LAYERS, num_kv_heads=HEADS,
                      group=group, head_size=HEAD_SIZE, page_size=PAGE_SIZE, dtype=dtype,
                      **kwargs)


def _write_all_layers(kernel, case):
    for layer in range(LAYERS):
        rows = case.step.layer_rows(layer)
        kernel.write(case.pool, case.new_keys[:, rows], case.new_values[:, rows],
                     case.step.slot_mapping[:, rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_and_attend_match_dense_reference(dtype):
    case = _case(*MIXED, dtype=dtype)
    kernel = TritonPagedKernel(case.layout, dtype, use_triton=True)
    args = kernel.prepare(case.step)
    scale = HEAD_SIZE**-0.5
    for layer in range(LAYERS):
        rows = case.step.layer_rows(layer)
        kernel.write(case.pool, case.new_keys[:, rows], case.new_values[:, rows],
                     case.step.slot_mapping[:, rows])
        output = torch.full_like(case.query, float("nan"))
        kernel.attend(args, layer, case.query, case.pool, output, scale)
        tolerance = TOLERANCE[dtype]
        torch.testing.assert_close(output.double(), dense_attention(case, layer, scale),
                                   atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", MODEL_SOFTMAXES)
def test_attend_applies_the_model_softmax(kind, dtype):
    case = _case(*MIXED, dtype=dtype)
    softmax = model_softmax(kind, case.query.shape[1], dtype)
    kernel = TritonPagedKernel(case.layout, dtype, use_triton=True)
    args = kernel.prepare(case.step)
    scale = HEAD_SIZE**-0.5
    _write_all_layers(kernel, case)
    for layer in range(LAYERS):
        output = torch.full_like(case.query, float("nan"))
        kernel.attend(args, layer, case.query, case.pool, output, scale, **softmax)
        tolerance = TOLERANCE[dtype]
        torch.testing.assert_close(output.double(),
                                   dense_attention(case, layer, scale, **softmax),
                                   atol=tolerance, rtol=tolerance)


def test_attend_accepts_flat_output_rows():
    """vLLM may hand the output as [T, H_q * D]."""
    case = _case([[12, 12, 12, 12]], [1])
    kernel = TritonPagedKernel(case.layout, torch.float32, use_triton=True)
    _write_all_layers(kernel, case)
    output = torch.empty(case.query.shape[0], case.query.shape[1] * HEAD_SIZE)
    kernel.attend(kernel.prepare(case.step), 1, case.query, case.pool, output, 0.25)
    torch.testing.assert_close(output.view(case.query.shape).double(),
                               dense_attention(case, 1, 0.25), atol=2e-5, rtol=2e-5)


def test_prepare_casts_once_and_gives_host_hints():
    case = _case(*MIXED)
    args = TritonPagedKernel(case.layout, torch.float32).prepare(case.step)
    lengths_after = [[a + n for a in row] for row, n in zip(MIXED[0], MIXED[1])]
    seen = []
    for part, table in zip(args.classes, case.step.tables.classes, strict=True):
        assert part.page_tables.dtype == part.kv_lens.dtype == part.query_start_loc.dtype
        assert part.page_tables.dtype == torch.int32
        members = table.batch_indices.tolist()
        seen += members
        query_lens = [MIXED[1][i] for i in members]
        assert part.query_start_loc.tolist() == [0, *np.cumsum(query_lens).tolist()]
        assert part.max_query_len == max(query_lens)
        assert part.max_kv_len == [max(max(lengths_after[i][:2]) for i in members),
                                   max(max(lengths_after[i][2:]) for i in members)]
    assert sorted(seen) == [0, 1, 2, 3] and len(args.classes) > 1
    assert args.windows is None


def test_write_lands_where_the_page_format_reads():
    case = _case(*MIXED)
    kernel = TritonPagedKernel(case.layout, torch.float32, use_triton=True)
    rows = case.step.layer_rows(1)
    slots = case.step.slot_mapping[:, rows]
    kernel.write(case.pool, case.new_keys[:, rows], case.new_values[:, rows], slots)
    keys, values = GPU_PAGE_FORMAT.read_tokens(case.pool, slots.reshape(-1))
    assert torch.equal(keys, case.new_keys[:, rows].reshape(-1, HEAD_SIZE))
    assert torch.equal(values, case.new_values[:, rows].reshape(-1, HEAD_SIZE))


def _set_group_reduce(step, group_reduce: str) -> None:
    """Every window combines its query heads this way; "mixed": mean, max, sum in turn."""
    cycle = ["mean", "max", "sum"]
    for number, window in enumerate(step.window_queries):
        window.group_reduce = cycle[number % 3] if group_reduce == "mixed" else group_reduce


@pytest.mark.parametrize("group_reduce", ["mean", "sum", "max", "mixed"])
def test_window_scores_match_the_torch_path(group_reduce):
    # req0: prompt completes here; req1: decode, no window; req2: first chunk reaching the
    # window; req3: resumed prompt recomputed with outputs (window ends before the chunk).
    lengths = [[10] * 4, [30] * 4, [0] * 4, [0] * 4]
    num_new, prompt_lens = [6, 1, 27, 15], [16, 20, 30, 12]
    case = _case(lengths, num_new, group=3, prompt_lens=prompt_lens, window=4,
                 wants_compression=[True, False, True, True])
    assert [w.num_queries for w in case.step.window_queries] == [4, 1, 4]
    _set_group_reduce(case.step, group_reduce)
    kernel = TritonPagedKernel(case.layout, torch.float32, use_triton=True)
    args = kernel.prepare(case.step)
    _write_all_layers(kernel, case)
    scale = HEAD_SIZE**-0.5
    for layer in range(LAYERS):
        accumulate_window_scores(case.query, case.pool, GPU_PAGE_FORMAT, case.step, layer,
                                 scale)
    expected = [window.scores.clone() for window in case.step.window_queries]
    for window in case.step.window_queries:
        window.scores.zero_()
    for layer in range(LAYERS):
        keys = case.new_keys[:, case.step.layer_rows(layer)]
        kernel.accumulate_window_scores(args, layer, case.query, keys, case.pool, case.step,
                                        scale)
    for window, want in zip(case.step.window_queries, expected):
        assert want.abs().sum() > 0
        torch.testing.assert_close(window.scores, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group_reduce", ["mean", "max", "mixed"])
@pytest.mark.parametrize("kind", MODEL_SOFTMAXES)
def test_window_scores_with_the_model_softmax_match_the_torch_path(kind, group_reduce):
    """The Triton window scores ("mean") and the torch fallback ("max") both take the model's
    softmax, and give what the torch path gives with it."""
    lengths, num_new, prompt_lens = [[10] * 4, [0] * 4], [6, 27], [16, 30]
    case = _case(lengths, num_new, group=3, prompt_lens=prompt_lens, window=4,
                 wants_compression=[True, True])
    _set_group_reduce(case.step, group_reduce)
    softmax = model_softmax(kind, case.query.shape[1])
    kernel = TritonPagedKernel(case.layout, torch.float32, use_triton=True)
    args = kernel.prepare(case.step)
    _write_all_layers(kernel, case)
    scale = HEAD_SIZE**-0.5
    for layer in range(LAYERS):
        accumulate_window_scores(case.query, case.pool, GPU_PAGE_FORMAT, case.step, layer,
                                 scale, **softmax)
    expected = [window.scores.clone() for window in case.step.window_queries]
    for window in case.step.window_queries:
        window.scores.zero_()
    for layer in range(LAYERS):
        keys = case.new_keys[:, case.step.layer_rows(layer)]
        kernel.accumulate_window_scores(args, layer, case.query, keys, case.pool, case.step,
                                        scale, **softmax)
    for window, want in zip(case.step.window_queries, expected):
        assert want.abs().sum() > 0
        torch.testing.assert_close(window.scores, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_triton", [None, True], ids=["torch", "triton"])
def test_move_hook_matches_the_page_format_move(use_triton):
    generator = torch.Generator().manual_seed(3)
    pool = torch.randn(8, 2, PAGE_SIZE, HEAD_SIZE, generator=generator)
    expected = pool.clone()
    slots = torch.randperm(8 * PAGE_SIZE, generator=generator)
    src, dst = slots[:40], slots[40:80]  # disjoint: no destination is a pending source
    GPU_PAGE_FORMAT.move(expected, src, dst)
    layout = _case([[4] * 4], [1]).layout
    TritonPagedKernel(layout, torch.float32, use_triton=use_triton).move(pool, src, dst,
                                                                         disjoint=True)
    assert torch.equal(pool, expected)


def test_compaction_moves_through_the_kernel_hook():
    prompt = 40
    case = _case([[0] * 4], [prompt], prompt_lens=[prompt], window=4, wants_compression=[True])
    kernel = TritonPagedKernel(case.layout, torch.float32, use_triton=True)
    _write_all_layers(kernel, case)
    for layer in range(LAYERS):
        accumulate_window_scores(case.query, case.pool, GPU_PAGE_FORMAT, case.step, layer,
                                 HEAD_SIZE**-0.5)
    case.state.finish_step(case.step)
    case.state.requests["req0"].config = KVCompressionConfig.from_mapping(
        {"kv_compression": "pyramidkv", "kv_budget": 12, "kv_window": 4}
    )
    state, pool = copy.deepcopy(case.state), case.pool.clone()
    expected = compact_completed_prompts(state, case.step, pool, GPU_PAGE_FORMAT)

    calls = []
    move = kernel.move
    kernel.move = lambda *args, **kwargs: (calls.append((args[1].numel(), kwargs)),
                                           move(*args, **kwargs))
    result = compact_completed_prompts(case.state, case.step, case.pool, kernel)
    # hole filling never overlaps: the kernel's in-place fast path may run
    assert len(calls) == 1 and calls[0][0] > 0 and calls[0][1] == {"disjoint": True}
    assert torch.equal(case.pool, pool)
    assert result.keys() == expected.keys()
    for request_id, compaction in result.items():
        assert (compaction.physical_lengths == expected[request_id].physical_lengths).all()
