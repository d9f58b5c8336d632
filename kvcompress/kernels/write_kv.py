"""Write the new tokens' K/V into the pool, each KV head at its own slot.

``key, value: [T, H_kv, D]``; ``slot_mapping: int64 (or int32) [T, H_kv]`` with
``slot = page * page_size + offset`` of that token in that head, ``-1`` = skip (e.g. padding).
K goes to ``pool[page, 0, offset]``, V to ``pool[page, 1, offset]`` (cast to the pool dtype).
Slots must be distinct (a duplicated slot gets one of the writers, unspecified which).
"""

from __future__ import annotations

import torch

from ._common import K_INDEX, V_INDEX, check_pool, slots_to_page_offset
from ._triton_support import (
    can_run_triton,
    check_triton_device,
    load_kernel_module,
    next_power_of_2,
)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    pool: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    use_triton: bool | None = None,
) -> None:
    """Dispatch: Triton on GPU tensors (or under ``TRITON_INTERPRET=1``), torch otherwise."""
    if use_triton is None:
        use_triton = key.is_cuda and can_run_triton(key)
    (write_kv_triton if use_triton else write_kv_ref)(key, value, pool, slot_mapping)


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
    key: torch.Tensor, value: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Torch reference (any device, GPU page format)."""
    _check(key, value, pool, slot_mapping)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    page, offset = slots_to_page_offset(slots, pool.shape[2])
    pool[page, K_INDEX, offset] = key[valid].to(pool.dtype)
    pool[page, V_INDEX, offset] = value[valid].to(pool.dtype)


def write_kv_triton(
    key: torch.Tensor, value: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton launch: grid (token, head block)."""
    _check(key, value, pool, slot_mapping)
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
        num_warps=4,
    )
