"""Compaction plan: fill the holes below each head's new length with its kept tail tokens.

For one head with sorted keep indices (physical positions of the survivors) and new length
``n = keep_count``: positions ``< n`` that are not kept are *holes*; kept positions ``>= n`` are
*tails*. There are as many holes as tails; the k-th smallest tail moves into the k-th smallest
hole. Kept tokens already below ``n`` do not move, so only ``#tails`` tokens are copied.

Everything is vectorized over many heads (rows) with padded inputs and no device->host sync;
results are padded with -1, which :func:`kvcompress.kernels.move_kv` skips.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HoleFillingPlan:
    """Moves and permutations for N heads; padded with -1, int64 on the input device.

    Attributes:
        src_positions: [N, K_max] tail position of move k of row n (k < num_moves[n]).
        dst_positions: [N, K_max] hole position of move k of row n.
        num_moves: [N] number of moves of each row.
        new_position_of_kept: [N, K_max] new physical position of ``keep_indices[n, k]``
            (same column order as the input; -1 for padding columns).
        source_of_new_position: [N, K_max] old physical position of the token that ends up at
            new position p (p < keep_counts[n]); move per-token metadata with
            ``new_meta = old_meta.gather(1, source_of_new_position.clamp_min(0))``.
    """

    src_positions: torch.Tensor
    dst_positions: torch.Tensor
    num_moves: torch.Tensor
    new_position_of_kept: torch.Tensor
    source_of_new_position: torch.Tensor

    def flat_moves(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row, src_position, dst_position) of the real moves, compacted. Syncs on GPU."""
        rows, cols = torch.nonzero(self.src_positions >= 0, as_tuple=True)
        return rows, self.src_positions[rows, cols], self.dst_positions[rows, cols]


def plan_hole_filling_moves(
    keep_indices: torch.Tensor, keep_counts: torch.Tensor
) -> HoleFillingPlan:
    """Plan the compaction of N heads at once.

    Args:
        keep_indices: int [N, K_max] physical positions of the kept tokens of each row; only the
            first ``keep_counts[n]`` columns count (any order is accepted; they are sorted here;
            indices must be distinct within a row). The rest is padding and ignored.
        keep_counts: int [N] number of kept tokens (the new physical length), <= K_max.
    """
    if keep_indices.dim() != 2 or keep_counts.shape != keep_indices.shape[:1]:
        raise ValueError(
            f"keep_indices must be [N, K_max] and keep_counts [N], got "
            f"{tuple(keep_indices.shape)} and {tuple(keep_counts.shape)}"
        )
    num_rows, max_keep = keep_indices.shape
    device = keep_indices.device
    counts = keep_counts.to(device=device, dtype=torch.long)[:, None]  # [N, 1]
    columns = torch.arange(max_keep, device=device)
    valid = columns[None, :] < counts
    padding_value = torch.iinfo(torch.long).max  # sorts after every real position
    keep = torch.where(valid, keep_indices.long(), padding_value)
    keep_sorted, order = keep.sort(dim=1, stable=True)

    # A dump column at index K_max absorbs the scatters of entries that must not land anywhere.
    dump = max_keep
    below = valid & (keep_sorted < counts)
    is_tail = valid & (keep_sorted >= counts)
    kept_below = torch.zeros(num_rows, max_keep + 1, dtype=torch.bool, device=device)
    kept_below.scatter_(1, torch.where(below, keep_sorted, dump), True)
    is_hole = ~kept_below[:, :max_keep] & (columns[None, :] < counts)

    hole_rank = torch.cumsum(is_hole, dim=1) - 1
    tail_rank = torch.cumsum(is_tail, dim=1) - 1
    dst_positions = torch.full((num_rows, max_keep + 1), -1, dtype=torch.long, device=device)
    dst_positions.scatter_(1, torch.where(is_hole, hole_rank, dump), columns.expand(num_rows, -1))
    src_positions = torch.full_like(dst_positions, -1)
    src_positions.scatter_(1, torch.where(is_tail, tail_rank, dump), keep_sorted)
    dst_positions, src_positions = dst_positions[:, :max_keep], src_positions[:, :max_keep]
    num_moves = is_tail.sum(dim=1)

    # New positions in sorted order: tails go to their hole, everything else stays.
    tail_destination = dst_positions.gather(1, tail_rank.clamp_min(0))
    new_sorted = torch.where(is_tail, tail_destination, keep_sorted)
    new_sorted = torch.where(valid, new_sorted, -1)
    new_position_of_kept = torch.full_like(new_sorted, -1)
    new_position_of_kept.scatter_(1, order, new_sorted)

    source_of_new_position = torch.full(
        (num_rows, max_keep + 1), -1, dtype=torch.long, device=device
    )
    source_of_new_position.scatter_(
        1, torch.where(valid, new_sorted, dump), torch.where(valid, keep_sorted, -1)
    )
    return HoleFillingPlan(
        src_positions=src_positions,
        dst_positions=dst_positions,
        num_moves=num_moves,
        new_position_of_kept=new_position_of_kept,
        source_of_new_position=source_of_new_position[:, :max_keep],
    )


def positions_to_slots(
    page_rows: torch.Tensor, positions: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Map physical positions of N heads to pool slots; negative positions stay -1.

    page_rows: int [N, max_pages] page table rows of the heads (e.g. ``tables[req, layer, head]``
    gathered per plan row); positions: int [N, K]. Returns int64 [N, K].
    """
    page_index = torch.div(positions.clamp_min(0), page_size, rounding_mode="floor")
    pages = page_rows.long().gather(1, page_index.clamp_max(page_rows.shape[1] - 1))
    slots = pages * page_size + positions.clamp_min(0) % page_size
    return torch.where(positions >= 0, slots, -1)
