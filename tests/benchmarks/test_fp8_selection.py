"""fp8 selection benchmark parts: vLLM's fp8 write as the scores see it, window rows, and the
agreement of two selections."""

from __future__ import annotations

import pytest
import torch

from benchmarks.fp8_selection import (
    render,
    selection_agreement,
    vllm_fp8_keys,
    window_probs,
)
from kvcompress.attention.cpu_kernel import cpu_supports_fp8_pages


@pytest.mark.skipif(not cpu_supports_fp8_pages(),
                    reason="vLLM's fp8 CPU write needs x86 with AVX-512 or AMX")
@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_keys_are_what_vllm_stores(cache_dtype):
    keys = torch.randn(45, 64, generator=torch.Generator().manual_seed(0))
    stored = vllm_fp8_keys(keys, cache_dtype, scale=0.5)
    fp8 = torch.float8_e4m3fn if cache_dtype == "fp8_e4m3" else torch.float8_e5m2
    assert stored.shape == keys.shape
    assert (stored.abs() <= keys.abs()).all()  # rounded toward zero
    assert not torch.equal(stored, keys)
    # representable values at the scale come back exactly
    exact = (keys / 0.5).to(fp8).float() * 0.5
    assert torch.equal(vllm_fp8_keys(exact, cache_dtype, scale=0.5), exact)


def test_window_rows_are_causal_softmax_rows_per_query_head():
    generator = torch.Generator().manual_seed(1)
    query, keys = torch.randn(4, 10, 8, generator=generator), torch.randn(2, 10, 8,
                                                                          generator=generator)
    probs = window_probs(query, keys, 3, 0.5)
    assert probs.shape == (4, 3, 10)
    torch.testing.assert_close(probs.sum(-1), torch.ones(4, 3))
    assert (probs[:, 0, 8:] == 0).all() and (probs[:, 1, 9:] == 0).all()
    # query head 3 reads KV head 1
    logits = query[3, 9] @ keys[1].T * 0.5
    torch.testing.assert_close(probs[3, 2], torch.softmax(logits, 0))


def test_selection_agreement_counts_common_tokens_and_kept_mass():
    scores = torch.tensor([[[4.0, 3.0, 2.0, 1.0], [1.0, 1.0, 1.0, 1.0]]])  # [L=1, H=2, S=4]
    reference = (torch.tensor([[[0, 1], [0, 1]]]), torch.tensor([[2, 2]]))
    other = (torch.tensor([[[0, 2], [1, 0]]]), torch.tensor([[2, 2]]))
    measured = selection_agreement(reference, other, scores)
    assert measured["overlap"].tolist() == [0.5, 1.0]
    assert measured["identical"].tolist() == [False, True]
    torch.testing.assert_close(measured["mass"], torch.tensor([6.0 / 7.0, 1.0]))
    table = render([{"label": "snapkv:64 fp8_e4m3", "overlap_mean": 0.75}])
    assert "snapkv:64 fp8_e4m3" in table and "0.750" in table
