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


FP8_FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("kv_fp8", FP8_FORMATS)
def test_reference_writes_fp8_codes_of_scaled_values(kv_fp8):
    """fp8 pages: each element is the code of x / scale (K and V scales apart), rounded to
    nearest even, saturated to the largest finite value (out-of-range inputs included)."""
    key, value, _, slots = make_inputs(7, 3, 64, 16, torch.float32, torch.bfloat16)
    key[0, 0, :4] = torch.tensor([1e6, -1e6, 0.0, -0.0])  # beyond fp8's range at any scale
    pool = torch.zeros(2 * 7 * 3 // 16 + 3, 2, 16, 64, dtype=torch.uint8)
    write_kv_ref(key, value, pool, slots, kv_fp8=kv_fp8, k_scale=0.5, v_scale=3.0)
    largest = torch.finfo(kv_fp8).max
    for t, h in itertools.product(range(7), range(3)):
        slot = int(slots[t, h])
        if slot < 0:
            continue
        stored = pool[slot // 16, :, slot % 16].view(kv_fp8).float()
        assert stored.isfinite().all()
        expected_k = (key[t, h].float() / 0.5).clamp(-largest, largest).to(kv_fp8).float()
        expected_v = (value[t, h].float() / 3.0).clamp(-largest, largest).to(kv_fp8).float()
        assert torch.equal(stored[0], expected_k) and torch.equal(stored[1], expected_v)
    if int(slots[0, 0]) >= 0:
        slot = int(slots[0, 0])
        assert pool[slot // 16, 0, slot % 16, :2].view(kv_fp8).float().tolist() == [largest,
                                                                                    -largest]


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("kv_fp8", FP8_FORMATS)
@pytest.mark.parametrize("key_dtype, scales", [(torch.bfloat16, (0.5, 0.25)),
                                               (torch.float32, (0.37, 1.9))])
def test_triton_writes_the_reference_fp8_bytes(device, kv_fp8, key_dtype, scales):
    """The same bytes as the reference, with ties, subnormals, saturation and signed zeros in
    the inputs (the kernel encodes by integer arithmetic, exact everywhere)."""
    key, value, _, slots = make_inputs(9, 5, 80, 16, torch.float32, key_dtype)
    every_code = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(kv_fp8).float()
    every_code = every_code[every_code.isfinite()].sort().values
    midpoints = (every_code[1:] + every_code[:-1]) / 2  # ties: round to even
    special = torch.cat([every_code, midpoints, torch.tensor([1e9, -1e9, -0.0])])
    special = special * scales[0]
    flat = key.reshape(-1).clone()
    flat[: special.numel()] = special.to(key_dtype)
    key.copy_(flat.view(key.shape))
    pool = torch.zeros(2 * 9 * 5 // 16 + 3, 2, 16, 80, dtype=torch.uint8, device=device)
    key, value, slots = key.to(device), value.to(device), slots.to(device)
    expected = pool.clone()
    write_kv_ref(key, value, expected, slots, kv_fp8=kv_fp8, k_scale=scales[0],
                 v_scale=scales[1])
    write_kv_triton(key, value, pool, slots, kv_fp8=kv_fp8, k_scale=scales[0],
                    v_scale=scales[1])
    assert torch.equal(pool, expected)
    assert pool.any()


def test_fp8_pages_need_a_uint8_pool():
    key, value, pool, slots = make_inputs(2, 1, 64, 16, torch.float32, torch.float32)
    with pytest.raises(TypeError, match="uint8 pool"):
        write_kv_ref(key, value, pool, slots, kv_fp8=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_fp8 must be"):
        write_kv_ref(key, value, pool.to(torch.uint8), slots, kv_fp8=torch.float16)
