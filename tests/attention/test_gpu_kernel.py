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
from kvcompress.attention.layer import attend_layer
from kvcompress.attention.window_scores import accumulate_window_scores
from kvcompress.engine.worker.compaction import compact_completed_prompts
from kvcompress.paging.page_format import FP8_KV_CACHE_DTYPES, GPU_PAGE_FORMAT, PageFormat
from kvcompress.policies import aggregate_window_probs
from kvcompress.settings.config import KVCompressionConfig
from kvcompress.step import KVScales, PagedAttentionMetadata
from tests.attention.test_decode_scores import (
    SCORED,
    decode_case,
    dense_decode_scores,
    run_layers,
)
from tests.paged_cases import (
    MODEL_SOFTMAXES,
    build_case,
    dense_attention,
    dense_window_probs,
    model_softmax,
    run_kernel,
)

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
    softmax = model_softmax(kind, case.query.shape[1], dtype, device=case.query.device)
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
    softmax = model_softmax(kind, case.query.shape[1], device=case.query.device)
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


# fp8 pages: K/V representable at power-of-two scales (``build_case``), so the dense reference
# is exact and the tolerances are those of unquantized pages.
FP8_CACHE_DTYPES = ["fp8", "fp8_e5m2"]
FP8_SCALES = KVScales(0.5, 0.25)


def _fp8_format(cache_dtype: str) -> PageFormat:
    return PageFormat(GPU_PAGE_FORMAT.key_layout, FP8_KV_CACHE_DTYPES[cache_dtype])


def test_fp8_kernel_takes_the_page_format_of_its_cache_dtype():
    layout = _case([[4] * 4], [1]).layout
    assert TritonPagedKernel(layout, torch.float32).page_format == GPU_PAGE_FORMAT
    kernel = TritonPagedKernel(layout, torch.float32, kv_cache_dtype="fp8_e4m3")
    assert kernel.page_format == PageFormat("row", torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="--kv-cache-dtype int8"):
        TritonPagedKernel(layout, torch.float32, kv_cache_dtype="int8")


@pytest.mark.parametrize("cache_dtype", FP8_CACHE_DTYPES)
@pytest.mark.parametrize("dtype, use_triton", [(torch.float32, True), (torch.bfloat16, True),
                                               (torch.float32, False)],
                         ids=["triton-fp32", "triton-bf16", "torch-fp32"])
def test_fp8_pages_write_and_attend_match_dense_reference(cache_dtype, dtype, use_triton):
    case = build_case(_fp8_format(cache_dtype), *MIXED, num_layers=LAYERS, num_kv_heads=HEADS,
                      group=2, head_size=HEAD_SIZE, page_size=PAGE_SIZE, dtype=dtype,
                      kv_scales=FP8_SCALES)
    assert case.pool.dtype == torch.uint8
    kernel = TritonPagedKernel(case.layout, dtype, use_triton=use_triton,
                               kv_cache_dtype=cache_dtype)
    outputs = run_kernel(kernel, case, None, kv_scales=FP8_SCALES)
    for layer, output in enumerate(outputs):
        torch.testing.assert_close(output.double(), dense_attention(case, layer, HEAD_SIZE**-0.5),
                                   atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    # what the write stored is what the CPU path's page format reads: the values over scales
    rows = case.step.layer_rows(1)
    keys, values = kernel.page_format.read_tokens(case.pool,
                                                  case.step.slot_mapping[:, rows].reshape(-1))
    torch.testing.assert_close(kernel.page_format.decode(keys) * FP8_SCALES.key,
                               case.new_keys[:, rows].reshape(-1, HEAD_SIZE).float(),
                               rtol=0, atol=0)
    torch.testing.assert_close(kernel.page_format.decode(values) * FP8_SCALES.value,
                               case.new_values[:, rows].reshape(-1, HEAD_SIZE).float(),
                               rtol=0, atol=0)


@pytest.mark.parametrize("cache_dtype", FP8_CACHE_DTYPES)
def test_fp8_pages_attend_with_the_model_softmax_and_window(cache_dtype):
    case = build_case(_fp8_format(cache_dtype), *MIXED, num_layers=LAYERS, num_kv_heads=HEADS,
                      group=2, head_size=HEAD_SIZE, page_size=PAGE_SIZE, dtype=torch.float32,
                      kv_scales=FP8_SCALES)
    softmax = model_softmax("both", case.query.shape[1], device=case.query.device)
    kernel = TritonPagedKernel(case.layout, torch.float32, use_triton=True,
                               kv_cache_dtype=cache_dtype)
    for layer, output in enumerate(run_kernel(kernel, case, 16, kv_scales=FP8_SCALES,
                                              **softmax)):
        expected = dense_attention(case, layer, HEAD_SIZE**-0.5, window=16, **softmax)
        torch.testing.assert_close(output.double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cache_dtype", FP8_CACHE_DTYPES)
@pytest.mark.parametrize("group_reduce", ["mean", "max"])
def test_fp8_window_scores_read_the_stored_keys_through_the_layer(cache_dtype, group_reduce):
    """attend_layer on fp8 pages (as on CPU): the window scores are those of the stored keys,
    the K scale folded into the logit scale once; "mean" runs the Triton window kernel, "max"
    the torch path over the same page format."""
    prompt, window = 40, 5
    case = build_case(_fp8_format(cache_dtype), [[0] * 4], [prompt], num_layers=LAYERS,
                      num_kv_heads=HEADS, group=3, head_size=HEAD_SIZE, page_size=PAGE_SIZE,
                      dtype=torch.float32, prompt_lens=[prompt], window=window,
                      wants_compression=[True], kv_scales=FP8_SCALES)
    _set_group_reduce(case.step, group_reduce)
    kernel = TritonPagedKernel(case.layout, torch.float32, use_triton=True,
                               kv_cache_dtype=cache_dtype)
    metadata = PagedAttentionMetadata(case.step, prompt, kernel, kernel.prepare(case.step), {})
    # keys fp8 does not represent: the pages hold them rounded, the step's tensor not
    step_keys = case.new_keys + 0.01 * torch.randn(case.new_keys.shape,
                                                   generator=torch.Generator().manual_seed(9))
    for layer in range(LAYERS):
        rows = case.step.layer_rows(layer)
        attend_layer(metadata, layer, case.query, step_keys[:, rows],
                     case.new_values[:, rows], case.pool, torch.empty_like(case.query),
                     HEAD_SIZE**-0.5, kv_scales=FP8_SCALES)
    page_format = kernel.page_format
    for row in range(LAYERS * HEADS):  # the reference reads what the pages hold
        stored, _ = page_format.read_tokens(case.pool, case.step.slot_mapping[:, row])
        case.new_keys[:, row] = page_format.decode(stored) * FP8_SCALES.key
    assert not torch.equal(case.new_keys, step_keys)
    for layer in range(LAYERS):
        probs = dense_window_probs(case, layer, HEAD_SIZE**-0.5)
        torch.testing.assert_close(case.step.window_queries[0].scores[layer],
                                   aggregate_window_probs(probs, group_reduce).float(),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", FP8_CACHE_DTYPES)
def test_fp8_decode_scores_read_fp8_pages_through_the_layer(cache_dtype):
    case = decode_case(_fp8_format(cache_dtype), seed=3, kv_scales=FP8_SCALES)
    kernel = TritonPagedKernel(case.layout, torch.float32, use_triton=True,
                               kv_cache_dtype=cache_dtype)
    run_layers(case, kernel, kv_scales=FP8_SCALES)
    assert not case.step.failures
    for index in SCORED:
        torch.testing.assert_close(case.state.requests[f"req{index}"].decode_scores.double(),
                                   dense_decode_scores(case, index, "mean"),
                                   atol=1e-5, rtol=1e-5)
