"""CPU attention over per-head pages (vLLM's C++ kernel, re-indexed) vs a dense reference."""

import numpy as np
import pytest
import torch

from kvcompress.attention.cpu_kernel import CpuPagedKernel, cpu_isa, page_format_for
from kvcompress.attention.window_scores import accumulate_window_scores
from kvcompress.paging import PageTableDelta
from kvcompress.paging.page_format import AMX_PAGE_FORMAT, CPU_PAGE_FORMAT, GPU_PAGE_FORMAT
from kvcompress.policies import aggregate_window_probs
from tests.paged_cases import (
    MODEL_SOFTMAXES,
    build_case,
    dense_attention,
    dense_window_probs,
    model_softmax,
    run_kernel,
)

LAYOUTS = {
    # unequal head lengths (a compressed request), decode, chunked prefill on context
    "mixed": ([[5, 9, 33, 1], [40, 40, 40, 40], [3, 17, 2, 60], [0, 0, 0, 0]], [1, 7, 1, 20]),
    "decode_only": ([[70, 12, 5, 44], [1, 2, 3, 4]], [1, 1]),
}


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_cpu_kernel_matches_dense_reference(page_size, head_size, group, dtype, layout_name):
    lengths, num_new = LAYOUTS[layout_name]
    # the kernel's own pick: bf16 with 32-token pages runs the amx ISA where the CPU has it
    page_format = page_format_for(cpu_isa(page_size, head_size, dtype))
    case = build_case(page_format, lengths, num_new, num_layers=2, num_kv_heads=2,
                      group=group, head_size=head_size, page_size=page_size, dtype=dtype)
    kernel = CpuPagedKernel(case.layout, dtype)
    assert kernel.page_format == page_format
    args = kernel.prepare(case.step)
    scale = head_size**-0.5
    for layer in range(2):
        rows = case.step.layer_rows(layer)
        kernel.write(case.pool, case.new_keys[:, rows], case.new_values[:, rows],
                     case.step.slot_mapping[:, rows])
        output = torch.empty_like(case.query)
        kernel.attend(args, layer, case.query, case.pool, output, scale)
        expected = dense_attention(case, layer, scale)
        tolerance = 2e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(output.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("group", [1, 4])
def test_cpu_kernel_with_one_kv_head(group):
    """One KV head (MQA; Gemma 3 270M): a layer's column of the step's slot mapping is then a
    strided view that must still be written where it points (a prefill chunk's keys went to
    the wrong slots before)."""
    case = build_case(CPU_PAGE_FORMAT, [[40, 40], [5, 33], [0, 0]], [7, 1, 12], num_layers=2,
                      num_kv_heads=1, group=group, head_size=256, page_size=16,
                      dtype=torch.float32)
    kernel = CpuPagedKernel(case.layout, torch.float32)
    args = kernel.prepare(case.step)
    for layer in range(2):
        rows = case.step.layer_rows(layer)
        kernel.write(case.pool, case.new_keys[:, rows], case.new_values[:, rows],
                     case.step.slot_mapping[:, rows])
        output = torch.empty_like(case.query)
        kernel.attend(args, layer, case.query, case.pool, output, 256**-0.5)
        expected = dense_attention(case, layer, 256**-0.5)
        torch.testing.assert_close(output.double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", MODEL_SOFTMAXES)
@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_cpu_kernel_applies_the_model_softmax(kind, dtype, layout_name):
    """vLLM's kernel soft-caps and takes sinks; sinks differ per KV head, so one call per head
    (fp16 sinks go in as fp32, as vLLM's own CPU backend passes them)."""
    lengths, num_new = LAYOUTS[layout_name]
    case = build_case(CPU_PAGE_FORMAT, lengths, num_new, num_layers=2, num_kv_heads=2,
                      group=3, head_size=64, page_size=16, dtype=dtype)
    softmax = model_softmax(kind, case.query.shape[1], dtype, device=case.query.device)
    kernel = CpuPagedKernel(case.layout, dtype)
    args = kernel.prepare(case.step)
    scale = 64**-0.5
    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
    for layer in range(2):
        rows = case.step.layer_rows(layer)
        kernel.write(case.pool, case.new_keys[:, rows], case.new_values[:, rows],
                     case.step.slot_mapping[:, rows])
        output = torch.empty_like(case.query)
        kernel.attend(args, layer, case.query, case.pool, output, scale, **softmax)
        expected = dense_attention(case, layer, scale, **softmax)
        assert (expected - dense_attention(case, layer, scale)).abs().max() > 0.05
        torch.testing.assert_close(output.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("keys_from", ["step", "pool"])
@pytest.mark.parametrize("group_reduce", ["mean", "max", "sum"])
@pytest.mark.parametrize("kind", MODEL_SOFTMAXES)
def test_window_scores_use_the_model_softmax(kind, group_reduce, keys_from):
    """Soft-capped logits; with sinks each query's mass on the prompt is below 1."""
    heads, group, head_size, window = 2, 3, 32, 5
    case = build_case(CPU_PAGE_FORMAT, [[0] * 2], [40], num_layers=1, num_kv_heads=heads,
                      group=group, head_size=head_size, page_size=16, dtype=torch.float32,
                      prompt_lens=[40], window=window, wants_compression=[True])
    softmax = model_softmax(kind, heads * group)
    case.step.window_queries[0].group_reduce = group_reduce
    kernel = CpuPagedKernel(case.layout, torch.float32)
    kernel.write(case.pool, case.new_keys, case.new_values, case.step.slot_mapping)
    if keys_from == "step":
        kernel.accumulate_window_scores(kernel.prepare(case.step), 0, case.query,
                                        case.new_keys, case.pool, case.step, 0.3, **softmax)
    else:
        accumulate_window_scores(case.query, case.pool, CPU_PAGE_FORMAT, case.step, 0, 0.3,
                                 **softmax)
    probs = dense_window_probs(case, 0, 0.3, **softmax)
    expected = aggregate_window_probs(probs, group_reduce).float()
    torch.testing.assert_close(case.step.window_queries[0].scores[0], expected, atol=1e-5,
                               rtol=1e-5)
    if "sinks" in softmax and group_reduce == "sum":
        assert float(expected.sum()) < window * heads * group - 1


def test_kernel_write_matches_page_format_read():
    lengths, num_new = LAYOUTS["mixed"]
    case = build_case(CPU_PAGE_FORMAT, lengths, num_new, 2, 2, 3, 64, 16, torch.float32)
    kernel = CpuPagedKernel(case.layout, torch.float32)
    rows = case.step.layer_rows(1)
    slots = case.step.slot_mapping[:, rows]
    kernel.write(case.pool, case.new_keys[:, rows], case.new_values[:, rows], slots)
    keys, values = CPU_PAGE_FORMAT.read_tokens(case.pool, slots.reshape(-1))
    assert torch.equal(keys, case.new_keys[:, rows].reshape(-1, 64))
    assert torch.equal(values, case.new_values[:, rows].reshape(-1, 64))


needs_amx = pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                               reason="this CPU has no AMX tiles (vLLM's amx ISA)")


@needs_amx
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("page_size", [32, 64])
def test_amx_kernel_writes_what_the_amx_page_format_reads(head_size, page_size):
    """Our amx layout (kvcompress.paging.page_format) against vLLM's own amx cache write."""
    lengths, num_new = LAYOUTS["mixed"]
    case = build_case(AMX_PAGE_FORMAT, lengths, num_new, 2, 2, 3, head_size, page_size,
                      torch.bfloat16)
    kernel = CpuPagedKernel(case.layout, torch.bfloat16)
    assert kernel.isa == "amx" and kernel.page_format == AMX_PAGE_FORMAT
    rows = case.step.layer_rows(1)
    slots = case.step.slot_mapping[:, rows]
    kernel.write(case.pool, case.new_keys[:, rows], case.new_values[:, rows], slots)
    keys, values = AMX_PAGE_FORMAT.read_tokens(case.pool, slots.reshape(-1))
    assert torch.equal(keys, case.new_keys[:, rows].reshape(-1, head_size))
    assert torch.equal(values, case.new_values[:, rows].reshape(-1, head_size))


@needs_amx
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("kind", MODEL_SOFTMAXES)
def test_amx_kernel_matches_dense_reference_with_the_model_softmax(kind, window):
    lengths, num_new = LAYOUTS["mixed"]
    case = build_case(AMX_PAGE_FORMAT, lengths, num_new, num_layers=2, num_kv_heads=2,
                      group=3, head_size=64, page_size=32, dtype=torch.bfloat16)
    softmax = model_softmax(kind, case.query.shape[1], torch.bfloat16, device=case.query.device)
    outputs = run_kernel(CpuPagedKernel(case.layout, torch.bfloat16), case, window, **softmax)
    for layer, output in enumerate(outputs):  # scale head_size ** -0.5 = 0.125
        expected = dense_attention(case, layer, 0.125, window=window, **softmax)
        torch.testing.assert_close(output.double(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("page_format", [CPU_PAGE_FORMAT, AMX_PAGE_FORMAT, GPU_PAGE_FORMAT])
def test_moves_copy_k_and_v_and_read_before_write(page_format):
    pool = torch.randn(6, 2, 32, 32)  # amx needs pages and heads of multiples of 16
    original = pool.clone()
    src = torch.tensor([3, 47, 130])
    dst = torch.tensor([47, 130, 5])  # chained: every read must see the old contents
    page_format.move(pool, src, dst)
    old_keys, old_values = page_format.read_tokens(original, src)
    new_keys, new_values = page_format.read_tokens(pool, dst)
    assert torch.equal(new_keys, old_keys) and torch.equal(new_values, old_values)


@pytest.mark.parametrize("group_reduce", ["mean", "max", "sum"])
def test_window_scores_split_across_chunks_equal_one_shot_probabilities(group_reduce):
    prompt_len, window, heads, group, head_size = 30, 6, 2, 3, 32
    # Chunk 1 covers positions 0..26 (3 window queries), chunk 2 covers 27..29.
    first = build_case(CPU_PAGE_FORMAT, [[0] * 2], [27], num_layers=1, num_kv_heads=heads,
                       group=group, head_size=head_size, page_size=16, dtype=torch.float32,
                       prompt_lens=[prompt_len], window=window, wants_compression=[True])
    kernel = CpuPagedKernel(first.layout, torch.float32)
    slots = first.step.slot_mapping
    kernel.write(first.pool, first.new_keys, first.new_values, slots)
    first.step.window_queries[0].group_reduce = group_reduce
    accumulate_window_scores(first.query, first.pool, CPU_PAGE_FORMAT, first.step, 0,
                             head_size**-0.5)
    request = first.state.requests["req0"]
    assert first.step.window_queries[0].num_queries == 3
    first.state.finish_step(first.step)
    # second chunk on the same state and pool
    extra_pages = np.array([1, 1], dtype=np.int32)  # 27 -> 30 tokens crosses page 2
    free = sorted(set(range(first.layout.total_pages)) - set(request.table.all_pages().tolist()))
    first.state.apply_deltas({"req0": PageTableDelta(False, [(extra_pages,
                                                               np.array(free[:2]))])})
    step2 = first.state.prepare_step(["req0"], np.array([3]), np.array([27]),
                                     np.array([prompt_len]), [window], [True])
    query2 = torch.randn(3, heads * group, head_size)
    keys2, values2 = torch.randn(3, heads, head_size), torch.randn(3, heads, head_size)
    kernel.write(first.pool, keys2, values2, step2.slot_mapping)
    step2.window_queries[0].group_reduce = group_reduce
    accumulate_window_scores(query2, first.pool, CPU_PAGE_FORMAT, step2, 0, head_size**-0.5)
    assert step2.completing_prompt == [0]
    # one-shot reference from dense tensors
    all_keys = torch.stack([torch.cat([first.new_keys[:, h], keys2[:, h]]) for h in range(heads)])
    window_queries = torch.cat([first.query[24:27], query2])  # positions 24..29
    logits = torch.einsum("whgd,hsd->hgws",
                          window_queries.view(window, heads, group, head_size),
                          all_keys) * head_size**-0.5
    positions = torch.arange(prompt_len - window, prompt_len)
    logits = logits.masked_fill(torch.arange(prompt_len)[None, :] > positions[:, None],
                                float("-inf"))
    expected = aggregate_window_probs(torch.softmax(logits, -1), group_reduce)
    torch.testing.assert_close(request.window_scores[0], expected, atol=1e-5, rtol=1e-5)


def test_window_scores_from_step_keys_equal_scores_from_the_pool():
    case = build_case(CPU_PAGE_FORMAT, [[0] * 2], [40], num_layers=1, num_kv_heads=2, group=3,
                      head_size=32, page_size=16, dtype=torch.float32, prompt_lens=[40],
                      window=5, wants_compression=[True])
    CpuPagedKernel(case.layout, torch.float32).write(case.pool, case.new_keys,
                                                     case.new_values, case.step.slot_mapping)
    scores = case.step.window_queries[0].scores
    accumulate_window_scores(case.query, case.pool, CPU_PAGE_FORMAT, case.step, 0, 0.2)
    from_pool = scores.clone()
    scores.zero_()
    accumulate_window_scores(case.query, case.pool, CPU_PAGE_FORMAT, case.step, 0, 0.2,
                             key=case.new_keys)
    torch.testing.assert_close(scores, from_pool)
    assert from_pool.sum() > 0
