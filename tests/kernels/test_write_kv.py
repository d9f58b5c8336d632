"""write_kv: Triton kernel vs torch reference (and the reference vs the layout definition)."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvcompress.kernels import write_kv, write_kv_ref, write_kv_triton


def make_inputs(num_tokens, num_kv_heads, head_size, page_size, dtype, key_dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    num_pages = 2 * num_tokens * num_kv_heads // page_size + 3
    pool = torch.randn(num_pages, 2, page_size, head_size, generator=generator).to(dtype)
    slots = torch.randperm(num_pages * page_size, generator=generator)[: num_tokens * num_kv_heads]
    slots = slots.view(num_tokens, num_kv_heads).clone()
    slots[torch.rand(num_tokens, num_kv_heads, generator=generator) < 0.2] = -1  # skipped
    # key/value as strided views into one fused qkv buffer, as an attention layer produces them.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_size, generator=generator).to(key_dtype)
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    return key, value, pool, slots


@pytest.mark.parametrize(
    "page_size, head_size, dtype",
    list(itertools.product([8, 16, 32], [64, 128], [torch.float32, torch.bfloat16])),
)
def test_reference_writes_each_head_at_its_slot(page_size, head_size, dtype):
    key, value, pool, slots = make_inputs(7, 3, head_size, page_size, dtype, dtype)
    before = pool.clone()
    write_kv_ref(key, value, pool, slots)
    expected = before.clone()
    for t, h in itertools.product(range(7), range(3)):
        slot = int(slots[t, h])
        if slot >= 0:
            expected[slot // page_size, 0, slot % page_size] = key[t, h]
            expected[slot // page_size, 1, slot % page_size] = value[t, h]
    assert torch.equal(pool, expected)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize(
    "page_size, head_size, dtype, key_dtype",
    [
        (8, 64, torch.float32, torch.float32),
        (16, 128, torch.bfloat16, torch.bfloat16),
        (32, 64, torch.float16, torch.float16),
        (16, 80, torch.bfloat16, torch.float32),  # padded head dim, cast on store
    ],
)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_triton_matches_reference(device, page_size, head_size, dtype, key_dtype, slot_dtype):
    key, value, pool, slots = make_inputs(9, 5, head_size, page_size, dtype, key_dtype)
    key, value, slots = key.to(device), value.to(device), slots.to(device, slot_dtype)
    expected = pool.to(device).clone()
    write_kv_ref(key, value, expected, slots)
    result = pool.to(device).clone()
    write_kv_triton(key, value, result, slots)
    if key_dtype == dtype:
        assert torch.equal(result, expected)
    else:  # the interpreter rounds fp32 -> bf16 toward zero, torch (and GPUs) to nearest even
        torch.testing.assert_close(result, expected)
    assert not torch.equal(result.cpu(), pool)


@pytest.mark.usefixtures("needs_triton")
def test_dispatch_and_empty(device):
    key, value, pool, slots = make_inputs(4, 2, 64, 16, torch.float32, torch.float32)
    expected = pool.clone()
    write_kv_ref(key, value, expected, slots)
    write_kv(key, value, pool, slots)
    assert torch.equal(pool, expected)
    write_kv_triton(key[:0].to(device), value[:0].to(device), pool.to(device), slots[:0].to(device))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_ref(key, value, pool, slots[:, :1])
