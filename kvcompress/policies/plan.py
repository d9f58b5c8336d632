"""The engine's entry point: which tokens each (request, layer, KV head) keeps after prefill."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .budgets import exact_fraction, layer_budgets
from .scores import pool_scores
from .selection import (
    PAD_INDEX,
    mask_to_indices,
    shared_quota_positions,
    sink_recent_mask,
    top_quota_positions,
)
from .validation import (
    DEFAULT_ADAKV_FLOOR,
    DEFAULT_BETA,
    DEFAULT_POOLING,
    DEFAULT_POOLING_KERNEL,
    DEFAULT_SINK_TOKENS,
    DEFAULT_WINDOW,
    METHODS,
    check_beta,
    check_budget_spec,
    check_choice,
    check_int,
    check_pooling,
    check_real,
)

# Largest padded score block ([requests, layers, heads, longest prompt]) planned at once; larger
# batches are split into blocks of similar-length requests to bound temporary memory (the int64
# ranking keys take 8 bytes per element).
MAX_BLOCK_ELEMENTS = 1 << 25


@dataclass(frozen=True)
class KeepPlan:
    """Tokens kept per (request, layer, KV head), window included.

    counts:  LongTensor[R, L, H], tokens kept by each head.
    indices: LongTensor[R, L, H, K_max], K_max = max(counts) (0 for an empty batch). The first
             counts[r, l, h] entries are the kept prompt positions, ascending and in
             [0, prompt_lens[r]); the rest equal PAD_INDEX (2**31 - 1).
    prompt_lens: LongTensor[R].
    compressed:  BoolTensor[R], False where the request keeps its whole prompt (nothing to move).
    """

    counts: torch.Tensor
    indices: torch.Tensor
    prompt_lens: torch.Tensor
    compressed: torch.Tensor

    pad_index = PAD_INDEX

    @property
    def num_requests(self) -> int:
        return self.counts.shape[0]

    @property
    def max_keep(self) -> int:
        return self.indices.shape[-1]

    def to(self, device: torch.device | str) -> KeepPlan:
        return KeepPlan(
            self.counts.to(device),
            self.indices.to(device),
            self.prompt_lens.to(device),
            self.compressed.to(device),
        )


@torch.no_grad()
def plan_keep(
    method: str,
    prompt_lens: list[int],
    scores: Sequence[torch.Tensor | None] | None,
    *,
    num_layers: int,
    num_kv_heads: int,
    budget: int | None = None,
    ratio: float | None = None,
    window: int = DEFAULT_WINDOW,
    beta: float = DEFAULT_BETA,
    pooling: str = DEFAULT_POOLING,
    pooling_kernel: int = DEFAULT_POOLING_KERNEL,
    sink_tokens: int = DEFAULT_SINK_TOKENS,
    adakv_floor: float = DEFAULT_ADAKV_FLOOR,
) -> KeepPlan:
    """Plan which prompt tokens every (request, layer, KV head) keeps.

    method: "pyramidkv" (pyramid layer budgets, top-k per head), "snapkv" (uniform budgets, top-k
        per head), "streamingllm" (uniform budgets, first sinks + most recent tokens; scores
        ignored, may be None), "adakv" (pyramid layer totals shared among a layer's heads).
    scores: per request fp32 [num_layers, num_kv_heads, prompt_len] RAW window scores (summed over
        window queries, GQA-aggregated, not pooled: pooling happens here, over the non-window
        prefix only). An entry may be None when that request keeps its whole prompt.
    budget / ratio: exactly one; tokens per head per layer on average (window included) or the
        fraction of the prompt evicted. A request with prompt_len <= its budget keeps everything.
    The last min(window, prompt_len) tokens are always kept. Output lives on the scores' device
    (CPU when no scores are given).
    """
    check_choice("method", method, METHODS)
    num_layers = check_int("num_layers", num_layers, 1)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, 1)
    check_budget_spec(budget, ratio, window)
    check_beta(beta)
    check_pooling(pooling, pooling_kernel)
    sink_tokens = check_int("sink_tokens", sink_tokens, 0)
    check_real("adakv_floor", adakv_floor, low=0.0, high=1.0)
    lens = [check_int(f"prompt_lens[{i}]", q, 1) for i, q in enumerate(prompt_lens)]
    if scores is not None and len(scores) != len(lens):
        raise ValueError(f"scores has {len(scores)} entries for {len(lens)} prompt_lens")

    per_layer = [layer_budgets(method, num_layers, q, budget, ratio, window, beta) for q in lens]
    keeps_all = [min(budgets) == q for budgets, q in zip(per_layer, lens)]
    if method != "streamingllm":
        _check_scores(scores, lens, keeps_all, num_layers, num_kv_heads)
    device = _device_of(scores)

    if method == "streamingllm":
        counts, indices = _plan_streaming(
            lens, per_layer, window, sink_tokens, num_layers, num_kv_heads, device
        )
    else:
        counts, indices = _plan_top_scores(
            method,
            lens,
            scores,
            per_layer,
            keeps_all,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            window=window,
            pooling=pooling,
            pooling_kernel=pooling_kernel,
            adakv_floor=adakv_floor,
            device=device,
        )
    prompt_lens_t = torch.tensor(lens, dtype=torch.long, device=device)
    compressed = (counts < prompt_lens_t[:, None, None]).flatten(1).any(dim=1)
    return KeepPlan(counts, indices, prompt_lens_t, compressed)


def _plan_streaming(
    lens: list[int],
    per_layer: list[list[int]],
    window: int,
    sink_tokens: int,
    num_layers: int,
    num_kv_heads: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sinks + most recent tokens; the same for every layer and head of a request.

    Sinks are capped at budget - window so the observation window is always among the recent.
    """
    keep = [budgets[0] for budgets in per_layer]  # uniform budgets, already capped at prompt_len
    sinks = [min(sink_tokens, k - min(window, q)) for k, q in zip(keep, lens)]
    recent = [k - s for k, s in zip(keep, sinks)]
    lengths, sinks_t, recent_t = (torch.tensor(v, device=device) for v in (lens, sinks, recent))
    mask = sink_recent_mask(lengths, sinks_t, recent_t, max(lens, default=0))  # [R, max prompt]
    indices = mask_to_indices(mask, max(keep, default=0))
    counts = torch.tensor(keep, dtype=torch.long, device=device)
    return (
        counts[:, None, None].expand(-1, num_layers, num_kv_heads).contiguous(),
        indices[:, None, None, :].expand(-1, num_layers, num_kv_heads, -1).contiguous(),
    )


def _plan_top_scores(
    method: str,
    lens: list[int],
    scores: Sequence[torch.Tensor | None] | None,
    per_layer: list[list[int]],
    keeps_all: list[bool],
    *,
    num_layers: int,
    num_kv_heads: int,
    window: int,
    pooling: str,
    pooling_kernel: int,
    adakv_floor: float,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score-based methods: requests that compress go through padded blocks, the rest keep all."""
    counts = torch.empty((len(lens), num_layers, num_kv_heads), dtype=torch.long, device=device)
    blocks = []  # (request ids, counts, kept positions)
    for group in _request_groups(lens, keeps_all, num_layers * num_kv_heads):
        block_counts, block_kept = _plan_block(
            method,
            [lens[i] for i in group],
            [scores[i] for i in group],  # type: ignore[index,misc]  # compressed => scores given
            [per_layer[i] for i in group],
            num_kv_heads=num_kv_heads,
            window=window,
            pooling=pooling,
            pooling_kernel=pooling_kernel,
            adakv_floor=adakv_floor,
            device=device,
        )
        blocks.append((torch.tensor(group, device=device), block_counts, block_kept))

    whole = [i for i, keep in enumerate(keeps_all) if keep]
    max_keep = max([lens[i] for i in whole] + [kept.shape[-1] for _, _, kept in blocks] + [0])
    indices = torch.full(
        (len(lens), num_layers, num_kv_heads, max_keep), PAD_INDEX, dtype=torch.long, device=device
    )
    if whole:  # counts = prompt_len, indices = arange(prompt_len)
        whole_ids = torch.tensor(whole, device=device)
        whole_lens = torch.tensor([lens[i] for i in whole], device=device)
        positions = torch.arange(max_keep, device=device)
        counts[whole_ids] = whole_lens[:, None, None]
        aranges = torch.where(positions < whole_lens[:, None], positions, PAD_INDEX)
        indices[whole_ids] = aranges[:, None, None, :]
    for ids, block_counts, block_kept in blocks:
        counts[ids] = block_counts
        indices[ids, :, :, : block_kept.shape[-1]] = block_kept
    return counts, indices


def _check_scores(
    scores: Sequence[torch.Tensor | None] | None,
    lens: list[int],
    keeps_all: list[bool],
    num_layers: int,
    num_kv_heads: int,
) -> None:
    for i, (q, whole) in enumerate(zip(lens, keeps_all)):
        score = None if scores is None else scores[i]
        if score is None:
            if not whole:
                raise ValueError(f"scores[{i}] is required: request {i} is compressed")
            continue
        expected = (num_layers, num_kv_heads, q)
        if tuple(score.shape) != expected:
            raise ValueError(
                f"scores[{i}] must have shape [num_layers, num_kv_heads, prompt_len] = "
                f"{list(expected)}, got {list(score.shape)}"
            )
        if not score.is_floating_point():
            raise ValueError(f"scores[{i}] must be a floating-point tensor, got {score.dtype}")


def _device_of(scores: Sequence[torch.Tensor | None] | None) -> torch.device:
    for score in scores or ():
        if score is not None:
            return score.device
    return torch.device("cpu")


def _request_groups(
    lens: list[int], keeps_all: list[bool], rows_per_request: int
) -> list[list[int]]:
    """Compressed requests in blocks of similar length, longest first.

    A block closes when its padded score block would exceed MAX_BLOCK_ELEMENTS or when the next
    prompt is under half the block's longest (bounding padding waste to 2x).
    """
    order = sorted((i for i, keep in enumerate(keeps_all) if not keep), key=lambda i: -lens[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            longest = lens[groups[-1][0]]
            fits = (len(groups[-1]) + 1) * rows_per_request * longest <= MAX_BLOCK_ELEMENTS
            if fits and 2 * lens[i] >= longest:
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def _plan_block(
    method: str,
    lens: list[int],
    scores: list[torch.Tensor],
    per_layer: list[list[int]],
    *,
    num_kv_heads: int,
    window: int,
    pooling: str,
    pooling_kernel: int,
    adakv_floor: float,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k methods on a padded block of compressed requests (prompt_len > budget >= window).

    Returns counts [R, L, H] and kept positions [R, L, H, K] ascending, PAD_INDEX-padded.
    """
    width = max(lens)
    if len(scores) == 1:
        padded = scores[0].to(device=device, dtype=torch.float32).unsqueeze(0)
    else:
        padded = torch.zeros((len(lens), *scores[0].shape[:2], width), device=device)
        for r, score in enumerate(scores):
            padded[r, :, :, : lens[r]] = score.to(device=device, dtype=torch.float32)

    prefix = torch.tensor(lens, device=device) - window  # selectable positions are [0, prefix)
    pooled = pool_scores(padded, pooling, pooling_kernel, lengths=prefix[:, None, None])

    quota = torch.tensor(per_layer, device=device) - window  # [R, L] selected tokens per head
    if method == "adakv":
        floor = exact_fraction(adakv_floor)
        # ceil(floor * quota) in integers, exact for the decimal the user gave
        head_floor = (quota * floor.numerator + floor.denominator - 1) // floor.denominator
        selected = shared_quota_positions(pooled, head_floor, quota * num_kv_heads)
    else:
        selected = top_quota_positions(pooled, quota[:, :, None])
    # The window [prefix, prompt_len) is disjoint from the selectable prefix: no duplicates.
    window_pos = prefix[:, None] + torch.arange(window, device=device)
    window_pos = window_pos[:, None, None, :].expand(*selected.shape[:3], window)
    kept = torch.cat([selected, window_pos], dim=-1).sort(dim=-1).values
    counts = (kept != PAD_INDEX).sum(dim=-1)
    return counts, kept[..., : int(counts.max())]
