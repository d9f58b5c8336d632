"""Cache moves for compaction: copy K and V of many tokens from source to destination slots.

``move_kv(pool, src_slots, dst_slots)``: flat int64 (or int32) slot lists of equal length, one
launch for any mix of layers, heads and requests (the pool is shared by all layers). A negative
source or destination skips that entry, so padded plans (see :mod:`.hole_filling`) can be passed
without compacting them first.

Contract: no destination slot is also the source of another move in the same call (the
"fill holes below the new length from the tail" plan guarantees it). The torch reference gathers
everything before scattering, so it is correct even without that guarantee; the Triton kernel
copies in parallel and relies on it. Destinations must be distinct.
"""

from __future__ import annotations

import torch

from ._common import check_pool, slots_to_page_offset
from ._triton_support import (
    can_run_triton,
    check_triton_device,
    load_kernel_module,
    next_power_of_2,
)


def move_kv(
    pool: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    *,
    use_triton: bool | None = None,
) -> None:
    """Dispatch: Triton on GPU tensors (or under ``TRITON_INTERPRET=1``), torch otherwise."""
    if use_triton is None:
        use_triton = pool.is_cuda and can_run_triton(pool)
    (move_kv_triton if use_triton else move_kv_ref)(pool, src_slots, dst_slots)


def _check(pool: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    check_pool(pool)
    if src_slots.shape != dst_slots.shape or src_slots.dim() != 1:
        raise ValueError(
            f"src_slots and dst_slots must be 1-D of equal length, got {tuple(src_slots.shape)} "
            f"and {tuple(dst_slots.shape)}"
        )
    for name, slots in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        if slots.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must be int64 or int32, got {slots.dtype}")


def move_kv_ref(pool: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Torch reference (any device, GPU page format): gather all sources, then scatter."""
    _check(pool, src_slots, dst_slots)
    valid = (src_slots >= 0) & (dst_slots >= 0)
    src_page, src_offset = slots_to_page_offset(src_slots[valid].long(), pool.shape[2])
    dst_page, dst_offset = slots_to_page_offset(dst_slots[valid].long(), pool.shape[2])
    pool[dst_page, :, dst_offset] = pool[src_page, :, src_offset]  # the gather copies first


def move_kv_triton(
    pool: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    *,
    block_t: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Triton launch: grid over blocks of ``block_t`` moves (default 16)."""
    _check(pool, src_slots, dst_slots)
    check_triton_device(pool, src_slots, dst_slots)
    if not (src_slots.is_contiguous() and dst_slots.is_contiguous()):
        src_slots, dst_slots = src_slots.contiguous(), dst_slots.contiguous()
    num_moves = src_slots.numel()
    if num_moves == 0:
        return
    block_t = block_t or 16
    kernels = load_kernel_module("_move_kv_triton")
    kernels.move_kv_kernel[(_cdiv(num_moves, block_t),)](
        pool, src_slots, dst_slots, num_moves,
        pool.stride(0), pool.stride(1), pool.stride(2),
        HEAD_DIM=pool.shape[3],
        HEAD_DIM_PAD=next_power_of_2(pool.shape[3]),
        PAGE_SIZE=pool.shape[2],
        BLOCK_T=block_t,
        num_warps=num_warps or 4,
    )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
