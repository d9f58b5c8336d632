"""Write the new tokens' K/V into the pool, each KV head at its own slot.

``key, value: [T, H_kv, D]``; ``slot_mapping: int64 (or int32) [T, H_kv]`` with
``slot = page * page_size + offset`` of that token in that head, ``-1`` = skip (e.g. padding).
K goes to ``pool[page, 0, offset]``, V to ``pool[page, 1, offset]`` (cast to the pool dtype).
Slots must be distinct (a duplicated slot gets one of the writers, unspecified which).

fp8 pages (``kv_fp8`` = ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``, ``pool`` uint8): an
element stores the fp8 code of ``x / k_scale`` (V: ``v_scale``), rounded to nearest even and
saturated to the format's largest finite value, as vLLM's GPU cache writes do
(:func:`fp8_codes`).
"""

from __future__ import annotations

import torch

from ._common import K_INDEX, V_INDEX, check_pool, slots_to_page_offset
from ._triton_support import (
    can_run_triton,
    check_triton_device,
    fp8_kind,
    load_kernel_module,
    next_power_of_2,
)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    pool: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_fp8: torch.dtype | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    use_triton: bool | None = None,
) -> None:
    """Dispatch: Triton on GPU tensors (or under ``TRITON_INTERPRET=1``), torch otherwise."""
    if use_triton is None:
        use_triton = key.is_cuda and can_run_triton(key)
    (write_kv_triton if use_triton else write_kv_ref)(
        key, value, pool, slot_mapping, kv_fp8=kv_fp8, k_scale=k_scale, v_scale=v_scale)


def fp8_codes(x: torch.Tensor, kv_fp8: torch.dtype, scale: float) -> torch.Tensor:
    """The uint8 page bytes of ``x`` at ``scale``: ``x / scale`` in fp32, saturated to the
    format's finite range (torch's cast alone would give NaN or inf), rounded to nearest even."""
    largest = torch.finfo(kv_fp8).max
    return (x.float() / scale).clamp_(-largest, largest).to(kv_fp8).view(torch.uint8)


def _check(key: torch.Tensor, value: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> None:
    _, head_size = check_pool(pool)
    if key.shape != value.shape or key.dim() != 3 or key.shape[2] != head_size:
        raise ValueError(
            f"key/value must both be [T, H_kv, {head_size}], got {tuple(key.shape)} and "
            f"{tuple(value.shape)}"
        )
    if tuple(slots.shape) != tuple(key.shape[:2]):
        raise ValueError(f"slot_mapping must be {tuple(key.shape[:2])}, got {tuple(slots.shape)}")
    if slots.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"slot_mapping must be int64 or int32, got {slots.dtype}")


def write_kv_ref(
    key: torch.Tensor, value: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor,
    *, kv_fp8: torch.dtype | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Torch reference (any device, GPU page format)."""
    _check(key, value, pool, slot_mapping)
    fp8_kind(kv_fp8, pool)  # validates the fp8 arguments
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    page, offset = slots_to_page_offset(slots, pool.shape[2])
    if kv_fp8 is None:
        keys, values = key[valid].to(pool.dtype), value[valid].to(pool.dtype)
    else:
        keys = fp8_codes(key[valid], kv_fp8, k_scale)
        values = fp8_codes(value[valid], kv_fp8, v_scale)
    pool[page, K_INDEX, offset] = keys
    pool[page, V_INDEX, offset] = values


def write_kv_triton(
    key: torch.Tensor, value: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor,
    *, kv_fp8: torch.dtype | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Triton launch: grid (token, head block). fp8 scales are host floats: no device read."""
    _check(key, value, pool, slot_mapping)
    kind = fp8_kind(kv_fp8, pool)
    check_triton_device(key, value, pool, slot_mapping)
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value need a unit stride in their last dimension")
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    block_h = min(next_power_of_2(num_kv_heads), 8)
    kernels = load_kernel_module("_write_kv_triton")
    kernels.write_kv_kernel[(num_tokens, -(-num_kv_heads // block_h))](
        key, value, pool, slot_mapping, num_kv_heads,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        slot_mapping.stride(0), slot_mapping.stride(1),
        pool.stride(0), pool.stride(1), pool.stride(2),
        HEAD_DIM=head_size,
        HEAD_DIM_PAD=next_power_of_2(head_size),
        PAGE_SIZE=pool.shape[2],
        BLOCK_H=block_h,
        k_scale=float(k_scale),
        v_scale=float(v_scale),
        KV_FP8=kind,
        num_warps=4,
    )
