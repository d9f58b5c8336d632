"""fp8 pages on CPU: vLLM's own fp8 cache write against our page format (known values), its
fp8 attention over per-head pages against the dense reference, and every score read from
fp8 pages (window, decode, reconstruction through ``attend_layer``) against its reference.
K/V are exactly representable at power-of-two scales (``tests.paged_cases.build_case``), so
the references are exact and the tolerances those of the unquantized tests."""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as ops

from kvcompress.attention.cpu_kernel import (
    CpuPagedKernel,
    cpu_isa,
    cpu_supports_fp8_pages,
    page_format_for,
)
from kvcompress.attention.layer import attend_layer
from kvcompress.paging.page_format import FP8_KV_CACHE_DTYPES, PageFormat
from kvcompress.policies import aggregate_window_probs
from kvcompress.step import KVScales, PagedAttentionMetadata
from tests.attention.test_decode_scores import (
    HEAD_SIZE,
    HEADS,
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
    fp8_representable,
    model_softmax,
    run_kernel,
)

pytestmark = pytest.mark.skipif(not cpu_supports_fp8_pages(),
                                reason="vLLM's fp8 CPU attention needs x86 with AVX-512 or AMX")

CACHE_DTYPES = ["fp8", "fp8_e5m2"]
SCALES = KVScales(0.5, 0.25)  # powers of two: representable values stay exact
LAYOUTS = {
    # unequal head lengths (a compressed request), decode, chunked prefill on context
    "mixed": ([[5, 9, 33, 1], [40, 40, 40, 40], [3, 17, 2, 60], [0, 0, 0, 0]], [1, 7, 1, 20]),
    "decode_only": ([[70, 12, 5, 44], [1, 2, 3, 4]], [1, 1]),
}


def fp8_format(cache_dtype: str) -> PageFormat:
    return page_format_for(cpu_isa(32, HEAD_SIZE, torch.float32, cache_dtype), cache_dtype)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_our_page_format_reads_vllm_fp8_cache_write(cache_dtype):
    """vLLM's CPU write (vec ISA, fp8, scales) of known values, read through our format:
    every token where its slot says, K and V decoded times their scale equal to the input."""
    fp8 = FP8_KV_CACHE_DTYPES[cache_dtype]
    page_format = fp8_format(cache_dtype)
    assert page_format.key_layout == "transposed" and page_format.fp8_dtype == fp8
    pages, page_size, head_size, tokens = 5, 32, 64, 70
    generator = torch.Generator().manual_seed(0)
    keys = fp8_representable(torch.randn(tokens, 1, head_size, generator=generator), fp8, 0.5)
    values = fp8_representable(torch.randn(tokens, 1, head_size, generator=generator), fp8,
                               0.25)
    slots = torch.randperm(pages * page_size, generator=generator)[:tokens]
    pool = torch.zeros(pages, 2, page_size, head_size, dtype=torch.uint8)
    key_cache, value_cache = pool.view(pages, 1, 2 * page_size, head_size).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, "vec",
                                   k_scale=0.5, v_scale=0.25, kv_cache_dtype=cache_dtype)
    read_keys, read_values = page_format.read_tokens(pool, slots)
    assert read_keys.dtype == torch.uint8
    torch.testing.assert_close(page_format.decode(read_keys) * 0.5, keys[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(page_format.decode(read_values) * 0.25, values[:, 0], rtol=0,
                               atol=0)
    # the score read: K of whole pages, dimension-major, decoded unscaled
    table = (slots[:3] // page_size).long()
    gathered = page_format.gather_key_pages(pool, table)  # [3, D, page]
    for index in range(3):
        column = gathered[index, :, int(slots[index] % page_size)]
        torch.testing.assert_close(column * 0.5, keys[index, 0], rtol=0, atol=0)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_vllm_fp8_write_rounds_toward_zero_within_one_step(cache_dtype):
    """What the page bytes hold for arbitrary inputs (vLLM's CPU write truncates): never
    above the input in magnitude, less than one fp8 step below it; the move copies them."""
    fp8 = FP8_KV_CACHE_DTYPES[cache_dtype]
    page_format = fp8_format(cache_dtype)
    generator = torch.Generator().manual_seed(1)
    keys = torch.randn(64, 1, 32, generator=generator)
    pool = torch.zeros(2, 2, 32, 32, dtype=torch.uint8)
    key_cache, value_cache = pool.view(2, 1, 64, 32).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, keys, key_cache, value_cache, torch.arange(64), "vec",
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype=cache_dtype)
    stored = page_format.decode(page_format.read_tokens(pool, torch.arange(64))[0])
    exact = keys[:, 0]
    assert (stored.abs() <= exact.abs()).all()
    mantissa_bits = 3 if fp8 == torch.float8_e4m3fn else 2
    # one step: 2^(exponent - mantissa bits), the subnormals' below the smallest normal
    subnormal_step = torch.finfo(fp8).tiny * 2.0**-mantissa_bits
    step = (2.0 ** (torch.floor(torch.log2(exact.abs())) - mantissa_bits)).clamp(
        min=subnormal_step)
    assert ((exact - stored).abs() < step).all()
    assert (stored != exact.to(fp8).float()).any(), "some inputs round differently than RNE"
    before = pool.clone()
    page_format.move(pool, torch.tensor([0, 1]), torch.tensor([40, 41]))
    assert torch.equal(page_format.read_tokens(pool, torch.tensor([40, 41]))[0],
                       page_format.read_tokens(before, torch.tensor([0, 1]))[0])


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_cpu_kernel_on_fp8_pages_matches_dense_reference(cache_dtype, dtype, group,
                                                         layout_name):
    lengths, num_new = LAYOUTS[layout_name]
    page_format = fp8_format(cache_dtype)
    case = build_case(page_format, lengths, num_new, num_layers=2, num_kv_heads=2, group=group,
                      head_size=64, page_size=32, dtype=dtype, kv_scales=SCALES)
    kernel = CpuPagedKernel(case.layout, dtype, kv_cache_dtype=cache_dtype)
    assert kernel.isa == "vec" and kernel.page_format == page_format
    outputs = run_kernel(kernel, case, None, kv_scales=SCALES)
    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
    for layer, output in enumerate(outputs):
        torch.testing.assert_close(output.double(), dense_attention(case, layer, 64**-0.5),
                                   atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("kind", MODEL_SOFTMAXES)
def test_cpu_kernel_on_fp8_pages_applies_the_model_softmax_and_window(kind):
    lengths, num_new = LAYOUTS["mixed"]
    case = build_case(fp8_format("fp8"), lengths, num_new, num_layers=2, num_kv_heads=2,
                      group=2, head_size=64, page_size=32, dtype=torch.float32,
                      kv_scales=SCALES)
    softmax = model_softmax(kind, 4)
    kernel = CpuPagedKernel(case.layout, torch.float32, kv_cache_dtype="fp8")
    for layer, output in enumerate(run_kernel(kernel, case, 16, kv_scales=SCALES, **softmax)):
        expected = dense_attention(case, layer, 64**-0.5, window=16, **softmax)
        torch.testing.assert_close(output.double(), expected, atol=2e-5, rtol=2e-5)


def test_fp8_pages_need_pages_and_heads_of_multiples_of_32():
    with pytest.raises(NotImplementedError, match="--kv-page-size and the head size"):
        cpu_isa(16, 64, torch.float32, "fp8")
    with pytest.raises(ValueError, match="--kv-cache-dtype int8.*auto, fp8"):
        cpu_isa(32, 64, torch.float32, "int8")


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("whole_prompt", [True, False], ids=["one_chunk", "chunked"])
def test_window_scores_read_fp8_pages_through_the_layer(cache_dtype, whole_prompt):
    """attend_layer on fp8 pages: the window scores are those of the stored keys (the step's
    own keys are not used: they are not what attention sees), the K scale folded into the
    logit scale once."""
    prompt, window = 40, 5
    before = 0 if whole_prompt else 24
    case = build_case(fp8_format(cache_dtype), [[before] * 2], [prompt - before],
                      num_layers=1, num_kv_heads=2, group=3, head_size=64, page_size=32,
                      dtype=torch.float32, prompt_lens=[prompt], window=window,
                      wants_compression=[True], kv_scales=SCALES)
    kernel = CpuPagedKernel(case.layout, torch.float32, kv_cache_dtype=cache_dtype)
    metadata = PagedAttentionMetadata(case.step, prompt - before, kernel,
                                      kernel.prepare(case.step), {})
    # keys that fp8 does not represent: the pages hold them rounded, the step's tensor not
    step_keys = case.new_keys + 0.01 * torch.randn(case.new_keys.shape,
                                                   generator=torch.Generator().manual_seed(9))
    attend_layer(metadata, 0, case.query, step_keys, case.new_values, case.pool,
                 torch.empty_like(case.query), 64**-0.5, kv_scales=SCALES)
    page_format = kernel.page_format
    for row in range(2):  # the reference reads what the pages hold
        stored, _ = page_format.read_tokens(case.pool, case.step.slot_mapping[:, row])
        case.new_keys[:, row] = page_format.decode(stored) * SCALES.key
    assert not torch.equal(case.new_keys, step_keys)
    if not whole_prompt:  # the reference over history + new keys, queries aligned to them
        history = torch.stack([case.old_keys[0, 0], case.old_keys[0, 1]], dim=1)
        case.new_keys = torch.cat([history, case.new_keys])
        case.query = torch.cat([torch.zeros(before, *case.query.shape[1:]), case.query])
        case.step.window_queries[0].first_query += before
    probs = dense_window_probs(case, 0, 64**-0.5)
    torch.testing.assert_close(case.step.window_queries[0].scores[0],
                               aggregate_window_probs(probs, "mean").float(),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_decode_scores_read_fp8_pages_through_the_layer(cache_dtype):
    case = decode_case(fp8_format(cache_dtype), seed=3, page_size=32, kv_scales=SCALES)
    kernel = CpuPagedKernel(case.layout, torch.float32, kv_cache_dtype=cache_dtype)
    run_layers(case, kernel, kv_scales=SCALES)
    assert not case.step.failures
    assert HEADS == 2 and HEAD_SIZE == 32  # the decode case's shape, fp8-compatible
    for index in SCORED:
        torch.testing.assert_close(case.state.requests[f"req{index}"].decode_scores.double(),
                                   dense_decode_scores(case, index, "mean"),
                                   atol=1e-5, rtol=1e-5)


def test_the_backend_hands_the_layer_scales_to_the_kernel():
    """vLLM's layer carries its fp8 scales (``_k_scale_float`` / ``_v_scale_float``); the
    backend's forward writes and attends with them."""
    from types import SimpleNamespace

    from kvcompress.attention.backend import KVCompressAttentionImpl

    lengths, num_new = LAYOUTS["mixed"]
    case = build_case(fp8_format("fp8"), [row[:2] for row in lengths], num_new, num_layers=1,
                      num_kv_heads=2, group=2, head_size=64, page_size=32,
                      dtype=torch.float32, kv_scales=SCALES)
    kernel = CpuPagedKernel(case.layout, torch.float32, kv_cache_dtype="fp8")
    impl = KVCompressAttentionImpl(num_heads=4, head_size=64, scale=64**-0.5, num_kv_heads=2,
                                   alibi_slopes=None, sliding_window=None,
                                   kv_cache_dtype="fp8")
    metadata = PagedAttentionMetadata(case.step, case.query.shape[0], kernel,
                                      kernel.prepare(case.step), {"layers.0.attn": 0})
    layer = SimpleNamespace(layer_name="layers.0.attn", _k_scale_float=SCALES.key,
                            _v_scale_float=SCALES.value)
    output = torch.empty_like(case.query)
    impl.forward(layer, case.query, case.new_keys, case.new_values, case.pool, metadata, output)
    torch.testing.assert_close(output.double(), dense_attention(case, 0, 64**-0.5),
                               atol=2e-5, rtol=2e-5)
