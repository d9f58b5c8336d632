"""Triton kernel copying K/V of many tokens between slots. Loaded lazily by ``move_kv.py``."""

import triton
import triton.language as tl


@triton.jit
def move_kv_kernel(
    pool_ptr,
    src_slots_ptr,
    dst_slots_ptr,
    num_moves,
    stride_pool_page,
    stride_pool_kv,
    stride_pool_tok,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """One program: BLOCK_T moves, K and V rows of each. Negative slots are skipped."""
    moves = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = moves < num_moves
    src = tl.load(src_slots_ptr + moves, mask=in_range, other=-1).to(tl.int64)
    dst = tl.load(dst_slots_ptr + moves, mask=in_range, other=-1).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = ((src >= 0) & (dst >= 0))[:, None] & (dims < HEAD_DIM)[None, :]
    src_offset = (src // PAGE_SIZE) * stride_pool_page + (src % PAGE_SIZE) * stride_pool_tok
    dst_offset = (dst // PAGE_SIZE) * stride_pool_page + (dst % PAGE_SIZE) * stride_pool_tok
    for kv in tl.static_range(2):  # K then V
        base = pool_ptr + kv * stride_pool_kv + dims[None, :]
        rows = tl.load(base + src_offset[:, None], mask=mask)
        tl.store(base + dst_offset[:, None], rows, mask=mask)
