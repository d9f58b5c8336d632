"""Which tokens survive, per row of scores: kept positions (compact) or boolean keep masks.

All functions work on whole batches ([..., S] rows) without Python loops over heads or tokens.
Ties between equal scores are broken by position: the lower index wins. Selection uses topk on
unique integer keys rather than a full sort, and returns positions so that no pass over the full
key axis is needed after the top-k.
"""

from __future__ import annotations

import torch

# Padding value of kept-position lists (and KeepPlan.indices): INT32_MAX. Out of range for any
# prompt, sorts after every real position, and survives a cast to int32 for kernels.
PAD_INDEX = 2**31 - 1
_INT64_MAX = 2**63 - 1


def ranking_keys(scores: torch.Tensor) -> torch.Tensor:
    """Unique int64 keys ordering each row by score (descending), then position (ascending).

    The fp32 bit pattern, made monotone for signed comparison, fills the high 32 bits; the
    inverted position fills the low 32. Unique keys make topk deterministic. -0.0 is folded into
    +0.0 first so equal scores tie. (NaN is not supported.)
    """
    positions = torch.arange(scores.shape[-1], device=scores.device)
    # The low 32 bits are zero: adding the inverted position is or-ing it in.
    return score_keys(scores).add_(0xFFFFFFFF - positions)


def score_keys(scores: torch.Tensor) -> torch.Tensor:
    """``ranking_keys``' high half: int64, the monotone fp32 bits shifted up 32, the low 32
    bits zero. Computed in place on one copy (keys of a long prompt's rows are large)."""
    bits = (scores.float() + 0.0).view(torch.int32)  # a copy: modified in place below
    # Negative floats order backwards: flip every bit but the sign.
    bits ^= (bits < 0).to(torch.int32).mul_(0x7FFFFFFF)
    keys = bits.long()
    del bits
    return keys.bitwise_left_shift_(32)


def _ranked_top(keys: torch.Tensor, quota: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top max(quota) positions per row, best first (distinct), and which are within quota."""
    quota = quota.to(keys.device).expand(keys.shape[:-1])
    most = min(int(quota.max()), keys.shape[-1]) if quota.numel() else 0
    best = torch.topk(keys, most, dim=-1, sorted=True).indices
    return best, torch.arange(most, device=keys.device) < quota.unsqueeze(-1)


def _top_positions(keys: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
    """Positions of the ``quota`` largest keys per row, best first, PAD_INDEX after."""
    best, taken = _ranked_top(keys, quota)
    return torch.where(taken, best, PAD_INDEX)


def top_quota_positions(scores: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
    """Per row of ``scores`` [..., S], the ``quota`` highest-scoring positions, best first.

    ``quota`` broadcasts to ``scores.shape[:-1]``; the result is [..., max(quota)] with PAD_INDEX
    after each row's quota. Callers keep quota <= number of finite scores in the row (-inf marks
    positions that must not be chosen).
    """
    return _top_positions(ranking_keys(scores), quota)


def shared_quota_positions(
    scores: torch.Tensor, head_floor: torch.Tensor, group_quota: torch.Tensor
) -> torch.Tensor:
    """Ada-KV style allocation: the H heads of a group compete for one shared quota.

    scores: [..., H, S] (-inf = not selectable); head_floor and group_quota broadcast to
    ``scores.shape[:-2]``. Each head first takes its own top ``head_floor`` tokens; the rest of
    ``group_quota`` goes to the highest remaining scores of any head (ties: lower head, then lower
    position). Requires H * head_floor <= group_quota; with fewer finite scores than the
    quota (a head's or the group's) the rest is filled with -inf entries, which callers drop.
    Returns [..., H, K] kept positions per head, ascending, PAD_INDEX after each head's count,
    K = the largest per-head count.
    """
    num_heads, length = scores.shape[-2:]
    batch = scores.shape[:-2]
    head_floor = head_floor.to(scores.device).expand(batch)
    # One set of keys over the flattened group; viewed per head it still ranks each head's row
    # correctly (flat index = head offset + position).
    keys = ranking_keys(scores.flatten(-2))
    # Round 1, per head: floor tokens get keys above every real key (still unique), so round 2
    # takes them first. Entries past a head's floor are rewritten with their own key; a head's
    # top-k positions are distinct, so no position is written twice.
    best, in_floor = _ranked_top(keys.view(scores.shape), head_floor.unsqueeze(-1))  # [..., H, F]
    head_offset = torch.arange(num_heads, device=scores.device).unsqueeze(-1) * length
    flat_best = (best + head_offset).flatten(-2)
    # A head with fewer selectable (finite) scores than its floor (under a score threshold)
    # boosts only those: a boosted -inf would take a slot of the shared quota for nothing.
    in_floor = in_floor.flatten(-2) & (scores.flatten(-2).gather(-1, flat_best) > float("-inf"))
    boosted = torch.where(in_floor, _INT64_MAX - flat_best, keys.gather(-1, flat_best))
    keys.scatter_(-1, flat_best, boosted)

    # Round 2, shared: the group's best keys; then split the flat positions back into heads.
    chosen = _top_positions(keys, group_quota.to(scores.device).expand(batch))
    chosen = chosen.sort(dim=-1).values  # by head, then position; PAD_INDEX last
    valid = chosen != PAD_INDEX
    head = torch.where(valid, chosen // length, num_heads)  # dropped entries go to a spare head
    counts = torch.zeros((*batch, num_heads + 1), dtype=torch.long, device=scores.device)
    counts.scatter_add_(-1, head, torch.ones_like(head))
    starts = counts.cumsum(dim=-1) - counts
    slot = torch.arange(chosen.shape[-1], device=scores.device) - starts.gather(-1, head)
    width = int(counts[..., :num_heads].max()) if counts.numel() else 0
    # Spare head rows absorb dropped entries; slot < width holds for every kept entry.
    out = torch.full((*batch, (num_heads + 1) * (width + 1)), PAD_INDEX, device=scores.device)
    target = head * (width + 1) + torch.where(valid, slot, width)
    out.scatter_(-1, target, torch.where(valid, chosen % length, PAD_INDEX))
    return out.view(*batch, num_heads + 1, width + 1)[..., :num_heads, :width]


def positions_to_mask(positions: torch.Tensor, size: int) -> torch.Tensor:
    """Boolean [..., size] mask of the positions listed (PAD_INDEX entries ignored)."""
    spare = torch.where(positions == PAD_INDEX, size, positions)
    mask = torch.zeros((*positions.shape[:-1], size + 1), dtype=torch.bool, device=positions.device)
    return mask.scatter_(-1, spare, True)[..., :size]


def top_quota_mask(scores: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
    """Mask form of ``top_quota_positions``."""
    return positions_to_mask(top_quota_positions(scores, quota), scores.shape[-1])


def shared_quota_mask(
    scores: torch.Tensor, head_floor: torch.Tensor, group_quota: torch.Tensor
) -> torch.Tensor:
    """Mask form of ``shared_quota_positions``."""
    return positions_to_mask(
        shared_quota_positions(scores, head_floor, group_quota), scores.shape[-1]
    )


def window_mask(lengths: torch.Tensor, window: torch.Tensor, size: int) -> torch.Tensor:
    """Positions in [length - window, length) of each row; lengths/window are [...] tensors."""
    positions = torch.arange(size, device=lengths.device)
    length = lengths.unsqueeze(-1)
    return (positions < length) & (positions >= length - window.unsqueeze(-1))


def sink_recent_mask(
    lengths: torch.Tensor, sinks: torch.Tensor, recent: torch.Tensor, size: int
) -> torch.Tensor:
    """StreamingLLM: the first ``sinks`` tokens plus the last ``recent`` ones of each row."""
    positions = torch.arange(size, device=lengths.device)
    length = lengths.unsqueeze(-1)
    first = positions < sinks.unsqueeze(-1)
    last = (positions >= length - recent.unsqueeze(-1)) & (positions < length)
    return first | last


def mask_to_indices(mask: torch.Tensor, max_keep: int, pad: int = PAD_INDEX) -> torch.Tensor:
    """Kept positions of each row in ascending order, [..., max_keep], padded with ``pad``.

    Linear time: each kept position goes to slot (number kept before it); dropped positions go to
    a spare slot that is cut off.
    """
    slots = mask.cumsum(dim=-1)  # int64; in place from here (a long prompt's rows are large)
    slots -= 1
    slots.masked_fill_(~mask, max_keep)
    positions = torch.arange(mask.shape[-1], device=mask.device).expand(mask.shape)
    out = torch.full((*mask.shape[:-1], max_keep + 1), pad, dtype=torch.long, device=mask.device)
    out.scatter_(-1, slots, positions)
    return out[..., :max_keep]
