"""The vLLM attention backend: which layers it takes, and that a layer's soft-cap and sinks
reach the kernel's attention and the observation-window scores."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvcompress.attention.backend import KVCompressAttentionImpl, KVCompressCudaAttentionBackend
from kvcompress.attention.cpu_kernel import CpuPagedKernel
from kvcompress.paging.page_format import CPU_PAGE_FORMAT
from kvcompress.policies import aggregate_window_probs
from kvcompress.step import PagedAttentionMetadata
from tests.paged_cases import (
    MODEL_SOFTMAXES,
    build_case,
    dense_attention,
    dense_window_probs,
    model_softmax,
)

HEADS, GROUP, HEAD_SIZE = 2, 3, 64
# vLLM's attention layer as the backend reads it: its name and its fp8 scales (1.0 unless a
# checkpoint brings others)
LAYER = SimpleNamespace(layer_name="layers.0.attn", _k_scale_float=1.0, _v_scale_float=1.0)


def _impl(**overrides) -> KVCompressAttentionImpl:
    arguments = dict(num_heads=HEADS * GROUP, head_size=HEAD_SIZE, scale=HEAD_SIZE**-0.5,
                     num_kv_heads=HEADS, alibi_slopes=None, sliding_window=None,
                     kv_cache_dtype="auto")
    return KVCompressAttentionImpl(**(arguments | overrides))


def test_soft_capping_sinks_and_sliding_windows_are_taken_alibi_refused():
    _impl(logits_soft_cap=50.0)
    _impl(sinks=torch.zeros(HEADS * GROUP))
    assert _impl(sliding_window=128, logits_soft_cap=50.0).sliding_window == 128
    with pytest.raises(NotImplementedError, match="ALiBi"):
        _impl(alibi_slopes=[0.5] * (HEADS * GROUP))


def test_a_layer_window_the_page_layout_does_not_know_stops_the_step():
    case = build_case(CPU_PAGE_FORMAT, [[0] * HEADS], [8], num_layers=1, num_kv_heads=HEADS,
                      group=GROUP, head_size=HEAD_SIZE, page_size=16, dtype=torch.float32)
    kernel = CpuPagedKernel(case.layout, torch.float32)
    metadata = PagedAttentionMetadata(
        step=case.step, num_actual_tokens=8, kernel=kernel,
        kernel_args=kernel.prepare(case.step), layer_index={"layers.0.attn": 0},
    )
    with pytest.raises(RuntimeError, match="attention window 16 but the page layout has full"):
        _impl(sliding_window=16).forward(
            LAYER, case.query, case.new_keys,
            case.new_values, case.pool, metadata, torch.empty_like(case.query))


def test_the_cuda_backend_passes_vllm_selection_for_sinks_and_sliding_windows():
    from vllm.platforms.interface import DeviceCapability

    common = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None,
                  use_mla=False, has_sink=True, use_sparse=False, use_mm_prefix=False,
                  use_per_head_quant_scales=False, device_capability=DeviceCapability(9, 0),
                  attn_type="decoder")
    assert KVCompressCudaAttentionBackend.validate_configuration(**common) == []
    assert KVCompressCudaAttentionBackend.validate_configuration(
        **{**common, "has_sliding_window": True}) == []


@pytest.mark.parametrize("kind", MODEL_SOFTMAXES)
def test_forward_attends_and_scores_with_the_layer_softmax(kind):
    prompt, window = 40, 5
    case = build_case(CPU_PAGE_FORMAT, [[0] * HEADS], [prompt], num_layers=1,
                      num_kv_heads=HEADS, group=GROUP, head_size=HEAD_SIZE, page_size=16,
                      dtype=torch.float32, prompt_lens=[prompt], window=window,
                      wants_compression=[True])
    softmax = model_softmax(kind, HEADS * GROUP)
    impl = _impl(logits_soft_cap=softmax.get("soft_cap"), sinks=softmax.get("sinks"))
    kernel = CpuPagedKernel(case.layout, torch.float32)
    metadata = PagedAttentionMetadata(
        step=case.step, num_actual_tokens=prompt, kernel=kernel,
        kernel_args=kernel.prepare(case.step), layer_index={"layers.0.attn": 0},
    )
    output = torch.empty_like(case.query)
    impl.forward(LAYER, case.query, case.new_keys,
                 case.new_values, case.pool, metadata, output)
    torch.testing.assert_close(output.double(), dense_attention(case, 0, impl.scale, **softmax),
                               atol=2e-5, rtol=2e-5)
    probs = dense_window_probs(case, 0, impl.scale, **softmax)
    torch.testing.assert_close(case.step.window_queries[0].scores[0],
                               aggregate_window_probs(probs, "mean").float(),
                               atol=1e-5, rtol=1e-5)
    assert metadata.kernel is kernel  # the layer's softmax is bound for this call only
