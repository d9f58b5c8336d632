"""The engine's entry point: which tokens each (request, layer, KV head) keeps after prefill."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .budgets import layer_budgets
from .methods.base import SelectionBlock
from .scores import pool_scores
from .selection import PAD_INDEX
from .settings import PolicySettings
from .sharing import (
    model_wide_counts,
    model_wide_cutoffs,
    model_wide_keys,
    model_wide_positions,
    model_wide_slice_positions,
)
from .threshold import sink_counts, threshold_candidates, threshold_positions
from .validation import check_int

# Largest padded score block ([requests, layers, heads, longest prompt]) planned at once; larger
# batches are split into blocks of similar-length requests, and a request larger than this alone
# into blocks of layers, to bound temporary memory. The engine reserves a block's workspace out
# of the KV cache (2.6 MB at this size), so it stays small: a block already spans many layers of
# a 1k-token prompt, and more blocks cost only a few more small tensor calls.
MAX_BLOCK_ELEMENTS = 1 << 16
# Peak temporary bytes per score of a padded block being planned (pooled fp32 copies, int64
# ranking keys, top-k outputs): 33 measured on CPU, plus headroom. The engine reserves it.
PLAN_BYTES_PER_SCORE = 40
# KeepPlan.indices' element: PAD_INDEX is INT32_MAX, and int32 halves the plan, which grows
# with the prompt times the layers (it is written once, slice by slice, never joined).
INDEX_DTYPE = torch.int32
INDEX_BYTES = 4


def workspace_scores(num_kv_heads: int, prompt_len: int) -> int:
    """Scores of the workspace the engine reserves for a prompt of ``prompt_len`` (or any
    shorter), PLAN_BYTES_PER_SCORE bytes each: one layer's, at least MAX_BLOCK_ELEMENTS."""
    return max(MAX_BLOCK_ELEMENTS, num_kv_heads * prompt_len)


@dataclass(frozen=True)
class KeepPlan:
    """Tokens kept per (request, layer, KV head), window included.

    counts:  LongTensor[R, L, H], tokens kept by each head.
    indices: IntTensor[R, L, H, K_max] (int32: positions and PAD_INDEX fit, and the plan is
             the largest tensor of the step's device->host transfer), K_max = max(counts) (0
             for an empty batch). The first counts[r, l, h] entries are the kept prompt
             positions, ascending and in [0, prompt_lens[r]); the rest equal PAD_INDEX
             (2**31 - 1).
    prompt_lens: LongTensor[R].
    compressed:  BoolTensor[R], False where the request keeps its whole prompt (nothing to move).
    """

    counts: torch.Tensor
    indices: torch.Tensor
    prompt_lens: torch.Tensor
    compressed: torch.Tensor

    def to(self, device: torch.device | str) -> KeepPlan:
        """The plan on ``device``: the engine plans where the scores are and moves tokens
        from the host, so it transfers each plan once."""
        return KeepPlan(*(tensor.to(device) for tensor in
                          (self.counts, self.indices, self.prompt_lens, self.compressed)))


@torch.no_grad()
def plan_keep(
    settings: PolicySettings,
    prompt_lens: list[int],
    scores: Sequence[torch.Tensor | None] | None,
    *,
    num_layers: int,
    num_kv_heads: int,
) -> KeepPlan:
    """Plan which prompt tokens every (request, layer, KV head) keeps.

    settings: the method (its registry record shapes the layer budgets and selects the tokens),
        budget or ratio, window and the methods' knobs. A request with prompt_len <= its budget
        keeps everything.
    scores: per request fp32 [num_layers, num_kv_heads, prompt_len] RAW window scores (summed over
        window queries, GQA-aggregated, not pooled: pooling happens here, over the non-window
        prefix only). An entry may be None when that request keeps its whole prompt; all of
        them may be None (or anything) for a method that needs no scores.
    The last min(window, prompt_len) tokens are always kept. Output lives on the scores' device
    (CPU when no scores are given). With ``settings.score_threshold`` a request keeps what
    passes it (threshold.py), at most its budgets when a budget or ratio caps it; only a
    prompt no longer than the window is kept whole without being looked at.

    The requests' plans padded to the widest row of any of them: ``plan_keep_each`` gives
    each its own (what the engine transfers: no padding to another request's width).
    """
    plans = plan_keep_each(settings, prompt_lens, scores, num_layers=num_layers,
                           num_kv_heads=num_kv_heads)
    if len(plans) == 1:
        return plans[0]
    device = _device_of(scores)
    width = max((plan.indices.shape[-1] for plan in plans), default=0)
    indices = torch.full((len(plans), num_layers, num_kv_heads, width), PAD_INDEX,
                         dtype=INDEX_DTYPE, device=device)
    for number, plan in enumerate(plans):
        indices[number, :, :, : plan.indices.shape[-1]] = plan.indices[0]
    if not plans:
        return KeepPlan(torch.empty((0, num_layers, num_kv_heads), dtype=torch.long,
                                    device=device), indices,
                        torch.empty(0, dtype=torch.long, device=device),
                        torch.empty(0, dtype=torch.bool, device=device))
    return KeepPlan(torch.cat([plan.counts for plan in plans]), indices,
                    torch.cat([plan.prompt_lens for plan in plans]),
                    torch.cat([plan.compressed for plan in plans]))


@torch.no_grad()
def plan_keep_each(
    settings: PolicySettings,
    prompt_lens: list[int],
    scores: Sequence[torch.Tensor | None] | None,
    *,
    num_layers: int,
    num_kv_heads: int,
) -> list[KeepPlan]:
    """``plan_keep``'s plan, one ``KeepPlan`` per request (``R = 1``), each as wide as its own
    widest row (at most its prompt): the requests are planned together, in the same blocks,
    but a short request's plan is never padded to a long one's width (the engine reserves
    each prompt's plan, not the group's widest)."""
    num_layers = check_int("num_layers", num_layers, 1)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, 1)
    lens = [check_int(f"prompt_lens[{i}]", q, 1) for i, q in enumerate(prompt_lens)]
    if scores is not None and len(scores) != len(lens):
        raise ValueError(f"scores has {len(scores)} entries for {len(lens)} prompt_lens")

    per_layer = [_layer_caps(settings, num_layers, q) for q in lens]
    if settings.score_threshold is None:
        keeps_all = [min(budgets) == q for budgets, q in zip(per_layer, lens)]
    else:  # under its cap the threshold still evicts: only a prompt inside the window is whole
        keeps_all = [q <= settings.window for q in lens]
    device = _device_of(scores)
    if settings.compression_method.needs_scores:
        _check_scores(scores, lens, keeps_all, num_layers, num_kv_heads)
    else:
        scores = None  # not read: they only told the device
    plans = []
    for q, (counts, indices) in zip(lens, _plan_requests(
            settings, lens, scores, per_layer, keeps_all,
            num_layers=num_layers, num_kv_heads=num_kv_heads, device=device)):
        prompt_len = torch.tensor([q], dtype=torch.long, device=device)
        plans.append(KeepPlan(counts, indices, prompt_len,
                              (counts < q).flatten(1).any(dim=1)))
    return plans


def model_wide_total(settings: PolicySettings, num_layers: int, num_kv_heads: int,
                     prompt_len: int) -> int:
    """Tokens a request of ``prompt_len`` keeps besides its windows when its budget is
    shared model-wide: what its layers' caps give every head, summed."""
    caps = _layer_caps(settings, num_layers, prompt_len)
    return num_kv_heads * sum(cap - settings.window for cap in caps)


def _layer_caps(settings: PolicySettings, num_layers: int, prompt_len: int) -> list[int]:
    """Tokens each KV head of a layer may keep (window included): the method's layer
    budgets, or the whole prompt for a score threshold without a cap."""
    if not settings.capped:
        return [prompt_len] * num_layers
    return layer_budgets(
        settings.method, num_layers, prompt_len, settings.budget, settings.ratio,
        settings.window, settings.beta, settings.budget_shape,
    )


def _plan_requests(
    settings: PolicySettings,
    lens: list[int],
    scores: Sequence[torch.Tensor | None] | None,
    per_layer: list[list[int]],
    keeps_all: list[bool],
    *,
    num_layers: int,
    num_kv_heads: int,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each request's (counts ``[1, L, H]``, kept positions ``[1, L, H, K]``), ``K`` its own
    widest row: requests that compress go through padded blocks (a block of several is at
    most MAX_BLOCK_ELEMENTS scores, its requests' plans copied out at their own widths; a
    request alone is its block's plan), the rest keep all (``arange`` rows, broadcast)."""
    planned: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(lens)
    for group in _request_groups(lens, keeps_all, num_layers * num_kv_heads):
        block_counts, block_kept = _plan_block(
            settings,
            [lens[i] for i in group],
            None if scores is None else [scores[i] for i in group],  # type: ignore[misc]
            [per_layer[i] for i in group],
            num_kv_heads,
            device,
        )
        if len(group) == 1:
            planned[group[0]] = block_counts, block_kept
            continue
        widths = block_counts.flatten(1).max(dim=1).values.tolist()  # one sync per block
        for number, (request, width) in enumerate(zip(group, widths)):
            planned[request] = (block_counts[number : number + 1].clone(),
                                block_kept[number : number + 1, :, :, :width].clone())
        del block_counts, block_kept
    for request, keep in enumerate(keeps_all):
        if keep:  # counts = prompt_len, indices = arange(prompt_len)
            q = lens[request]
            planned[request] = (
                torch.full((1, num_layers, num_kv_heads), q, dtype=torch.long, device=device),
                torch.arange(q, dtype=INDEX_DTYPE, device=device).expand(
                    1, num_layers, num_kv_heads, q))
    return planned  # type: ignore[return-value]  # every request is planned above


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
    settings: PolicySettings,
    lens: list[int],
    scores: list[torch.Tensor] | None,
    per_layer: list[list[int]],
    num_kv_heads: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One padded block of compressed requests (prompt_len > budget >= window, or with a
    score threshold prompt_len > window), planned in slices of layers of at most
    MAX_BLOCK_ELEMENTS scores (selections treat layers apart).

    Returns counts [R, L, H] and kept positions [R, L, H, K] ascending, PAD_INDEX-padded.
    """
    num_layers = len(per_layer[0])
    layers_at_once = max(1, MAX_BLOCK_ELEMENTS // (len(lens) * num_kv_heads * max(lens)))
    slices = [slice(first, min(first + layers_at_once, num_layers))
              for first in range(0, num_layers, layers_at_once)]
    shared: tuple[torch.Tensor, torch.Tensor] | None = None  # model-wide (cut-off, total)
    kept: torch.Tensor | None = None
    # Every layer of a request competes (a threshold's passing tokens too, for its cap): its
    # cut-off key first, slice by slice, and the widest row it leaves, so the plan is
    # allocated once. (Without a cap a threshold's rows do not compete.)
    if (settings.budget_sharing == "model" and len(slices) > 1
            and (settings.score_threshold is None or settings.capped)):
        cutoff, total, width = _model_wide_cutoffs(settings, lens, scores, per_layer,
                                                   num_kv_heads, device, slices)
        shared = cutoff, total
        kept = _widened(None, (len(lens), num_layers, num_kv_heads), width, device)
    counts = torch.empty((len(lens), num_layers, num_kv_heads), dtype=torch.long, device=device)
    for layers in slices:
        part_counts, part = _plan_layers(settings, lens, scores, per_layer, num_kv_heads,
                                         device, layers, shared)
        counts[:, layers] = part_counts
        kept = _widened(kept, (len(lens), num_layers, num_kv_heads), part.shape[-1], device)
        # Written in place: the slices' parts are never held together and joined.
        kept[:, layers, :, : part.shape[-1]] = part
        del part
    assert kept is not None  # num_layers >= 1
    return counts, kept


def _model_wide_cutoffs(
    settings: PolicySettings,
    lens: list[int],
    scores: list[torch.Tensor] | None,
    per_layer: list[list[int]],
    num_kv_heads: int,
    device: torch.device,
    slices: list[slice],
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each request's model-wide cut-off key and total (``sharing.model_wide_cutoffs``),
    its scores pooled and ranked a slice of layers at a time, and the most tokens a head
    keeps then (its window included). Under a score threshold the candidates compete (the
    passing tokens past each head's sinks, as ``threshold_positions`` gives its cap), for
    the total beyond the sinks."""
    assert scores is not None  # settings refuse model-wide sharing without scores
    prefix = torch.tensor(lens, device=device) - settings.window
    quota = torch.tensor(per_layer, device=device) - settings.window
    threshold = settings.score_threshold
    sinks = (sink_counts(quota, settings.sink_tokens) if threshold is not None
             else torch.zeros_like(quota))
    total = (quota - sinks).sum(dim=1) * num_kv_heads

    def keys_of(layers: slice) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The slice's keys ``[R, L' * H * S]`` and, under a threshold, which are
        candidates (the others' scores are -inf: they rank last, never kept)."""
        pooled = _pooled_prefix_scores(settings, lens, [score[layers] for score in scores],
                                       prefix)
        candidate = None
        if threshold is not None:
            candidate = threshold_candidates(pooled, threshold, sinks[:, layers])
            pooled.masked_fill_(~candidate, float("-inf"))
        return model_wide_keys(pooled, layers.start), candidate

    def key_slices() -> Iterator[torch.Tensor]:
        # Nothing of a slice stays referenced here while its keys are read.
        return (keys_of(layers)[0] for layers in slices)

    cutoff = model_wide_cutoffs(key_slices, total)
    width = 0
    for layers in slices:
        keys, candidate = keys_of(layers)
        counted = model_wide_counts(keys.view(len(lens), -1, max(lens)), cutoff, total,
                                    None if candidate is None else candidate.view(keys.shape[0],
                                                                                  -1, max(lens)))
        del keys, candidate
        layer_sinks = sinks[:, layers].repeat_interleave(num_kv_heads, dim=1)
        width = max(width, int((counted + layer_sinks).max()))
    return cutoff, total, width + settings.window


def _widened(kept: torch.Tensor | None, shape: tuple[int, int, int], width: int,
             device: torch.device) -> torch.Tensor:
    """``kept`` (PAD_INDEX-filled where not written yet) at least ``width`` wide. Only a
    method sharing a layer's budget among its heads can need a later slice wider than the
    first ones (PyramidKV's widest layers come first): that one step holds the plan twice."""
    if kept is not None and kept.shape[-1] >= width:
        return kept
    wider = torch.full((*shape, width), PAD_INDEX, dtype=INDEX_DTYPE, device=device)
    if kept is not None:
        wider[..., : kept.shape[-1]] = kept
    return wider


def _plan_layers(
    settings: PolicySettings,
    lens: list[int],
    scores: list[torch.Tensor] | None,
    per_layer: list[list[int]],
    num_kv_heads: int,
    device: torch.device,
    layers: slice,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``layers`` of one block: the method selects from each prefix, every head also keeps
    the window. ``shared``: model-wide sharing's (cut-off, total) per request, when the
    request's layers are planned in several slices (``_model_wide_cutoffs``)."""
    window = settings.window
    prefix = torch.tensor(lens, device=device) - window  # selectable positions are [0, prefix)
    # [R, L'] selected tokens per head
    quota = torch.tensor(per_layer, device=device)[:, layers] - window
    if scores is not None:
        scores = [score[layers] for score in scores]
    pooled = None if scores is None else _pooled_prefix_scores(settings, lens, scores, prefix)
    block = SelectionBlock(pooled, prefix, quota, num_kv_heads)

    def within_quota(block: SelectionBlock) -> torch.Tensor:
        if settings.budget_sharing == "model":
            assert block.scores is not None  # settings refuse model-wide sharing without scores
            if shared is not None:
                return model_wide_slice_positions(block.scores, layers.start, *shared)
            return model_wide_positions(block.scores, block.quota)
        return settings.compression_method.select(block, settings)

    if settings.score_threshold is None:
        selected = within_quota(block)
    else:
        selected = threshold_positions(block, settings.score_threshold, settings.sink_tokens,
                                       within_quota if settings.capped else None)
    # The window [prefix, prompt_len) is disjoint from the selectable prefix: no duplicates.
    window_pos = prefix[:, None] + torch.arange(window, device=device)
    window_pos = window_pos[:, None, None, :].expand(*selected.shape[:3], window)
    kept = torch.cat([selected, window_pos], dim=-1).sort(dim=-1).values
    counts = (kept != PAD_INDEX).sum(dim=-1)
    return counts, kept[..., : int(counts.max())]


def _pooled_prefix_scores(
    settings: PolicySettings, lens: list[int], scores: list[torch.Tensor], prefix: torch.Tensor
) -> torch.Tensor:
    """fp32 [R, L, H, max(lens)]: the scores pooled over each prefix, -inf from the prefix on."""
    device = prefix.device
    if len(scores) == 1:
        padded = scores[0].to(device=device, dtype=torch.float32).unsqueeze(0)
    else:
        padded = torch.zeros((len(lens), *scores[0].shape[:2], max(lens)), device=device)
        for r, score in enumerate(scores):
            padded[r, :, :, : lens[r]] = score.to(device=device, dtype=torch.float32)
    return pool_scores(
        padded, settings.pooling, settings.pooling_kernel, lengths=prefix[:, None, None]
    )
