"""Per-KV-head token importance scores, vectorized over heads and tokens.

Observation-window scores (SnapKV / PyramidKV): the last W prompt queries attend to the prompt;
their softmax probabilities (fp32) are reduced over the query heads of each GQA group, summed over
the window queries, then smoothed by 1-D pooling over the key axis.

The engine computes probabilities chunk by chunk, so the reductions are separable:
``aggregate_window_probs`` reduces the group per query and sums over the queries it is given;
partial results add up; ``finalize_window_scores`` (mean over W) and ``pool_scores`` run once on
the accumulated scores. Layout of query heads: query head ``h_kv * G + g`` belongs to KV head
``h_kv`` (the usual repeat_kv / GQA layout).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .settings import DEFAULT_GROUP_REDUCE, DEFAULT_POOLING_KERNEL, DEFAULT_WINDOW_REDUCE
from .validation import GROUP_REDUCES, WINDOW_REDUCES, check_choice, check_int, check_pooling


def window_attention_probs(
    queries: torch.Tensor, keys: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Causal softmax probabilities of the last W prompt queries over all S prompt keys.

    queries: [..., H_q, W, D] (the queries of prompt positions S - W .. S - 1).
    keys:    [..., H_kv, S, D] with H_q = H_kv * G.
    Returns fp32 [..., H_kv, G, W, S]; window query i sees keys 0 .. S - W + i.
    """
    num_q_heads, window, head_dim = queries.shape[-3:]
    num_kv_heads, seq_len = keys.shape[-3], keys.shape[-2]
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})"
        )
    if not 1 <= window <= seq_len:
        raise ValueError(f"window queries must be in [1, {seq_len}] (prompt length), got {window}")
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    grouped_q = queries.float().reshape(*queries.shape[:-3], num_kv_heads, group, window, head_dim)
    logits = torch.einsum("...hgwd,...hsd->...hgws", grouped_q, keys.float()) * scale
    query_pos = torch.arange(seq_len - window, seq_len, device=keys.device)
    key_pos = torch.arange(seq_len, device=keys.device)
    future = key_pos[None, :] > query_pos[:, None]  # [W, S]
    logits = logits.masked_fill(future, float("-inf"))
    return torch.softmax(logits, dim=-1)


def aggregate_window_probs(
    probs: torch.Tensor, group_reduce: str = DEFAULT_GROUP_REDUCE
) -> torch.Tensor:
    """[..., H_kv, G, W, S] probabilities -> [..., H_kv, S] fp32 scores.

    Per window query the G query heads of a KV head are reduced (mean / max / sum), then the W
    queries are summed. Summing last keeps this additive over chunks of window queries and of keys
    (for "max" the order matters: max-then-sum is the separable one).
    """
    check_choice("group_reduce", group_reduce, GROUP_REDUCES)
    probs = probs.float()
    if group_reduce == "mean":
        per_query = probs.mean(dim=-3)
    elif group_reduce == "max":
        per_query = probs.amax(dim=-3)
    else:
        per_query = probs.sum(dim=-3)
    return per_query.sum(dim=-2)


def finalize_window_scores(
    scores: torch.Tensor, window_reduce: str, num_window_queries: int
) -> torch.Tensor:
    """Turn summed window scores into the requested reduction ("sum": as is, "mean": / W).

    A uniform positive scale: it never changes which tokens are selected.
    """
    check_choice("window_reduce", window_reduce, WINDOW_REDUCES)
    check_int("num_window_queries", num_window_queries, 1)
    return scores if window_reduce == "sum" else scores / num_window_queries


def pool_scores(
    scores: torch.Tensor,
    pooling: str,
    kernel: int = DEFAULT_POOLING_KERNEL,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """1-D pooling over the last (key) axis, same length out (odd kernel, padding kernel // 2).

    "max" pads with -inf, "avg" with zeros counted in the divisor (both as torch's pool1d and the
    SnapKV reference); "none" returns the scores as fp32. ``lengths`` (broadcastable to
    ``scores.shape[:-1]``) marks positions >= length as padding: they neither feed their neighbours
    (treated like the border padding) nor come out selectable (set to -inf).
    """
    check_pooling(pooling, kernel)
    scores = scores.float()
    valid = None
    if lengths is not None:
        positions = torch.arange(scores.shape[-1], device=scores.device)
        valid = positions < lengths.to(scores.device).unsqueeze(-1)
        neutral = float("-inf") if pooling == "max" else 0.0
        scores = torch.where(valid, scores, neutral)
    if pooling != "none" and kernel > 1 and scores.shape[-1] > 0:
        rows = scores.reshape(-1, 1, scores.shape[-1])
        pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
        scores = pool(rows, kernel_size=kernel, stride=1, padding=kernel // 2).reshape(scores.shape)
    if valid is not None:
        scores = torch.where(valid, scores, float("-inf"))
    return scores


def observation_window_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    group_reduce: str = DEFAULT_GROUP_REDUCE,
    window_reduce: str = DEFAULT_WINDOW_REDUCE,
    pooling: str = "none",
    kernel: int = DEFAULT_POOLING_KERNEL,
    scale: float | None = None,
) -> torch.Tensor:
    """Scores [..., H_kv, S] straight from raw queries [..., H_q, W, D] and keys [..., H_kv, S, D].

    Pooling defaults to "none": ``plan_keep`` expects raw scores and pools (prefix only) itself.
    With a pooling method the whole key axis is pooled, window positions included.
    """
    probs = window_attention_probs(queries, keys, scale)
    scores = aggregate_window_probs(probs, group_reduce)
    scores = finalize_window_scores(scores, window_reduce, queries.shape[-2])
    return pool_scores(scores, pooling, kernel)


def accumulate_attention_mass(
    running: torch.Tensor | None,
    probs: torch.Tensor,
    group_reduce: str = DEFAULT_GROUP_REDUCE,
) -> torch.Tensor:
    """H2O heavy-hitter scores: add new attention probabilities to the running mass per token.

    running: [..., H_kv, S_old] fp32 or None (start from zero).
    probs:   [..., H_kv, G, T, S_new] probabilities of T new queries, S_new >= S_old (the cache
             may have grown; new tokens start at zero mass).
    Returns a new [..., H_kv, S_new] fp32 tensor.
    """
    added = aggregate_window_probs(probs, group_reduce)
    if running is None:
        return added
    grown = added.shape[-1] - running.shape[-1]
    if grown < 0:
        raise ValueError(
            f"probs cover {added.shape[-1]} tokens but the running score has {running.shape[-1]}"
        )
    return F.pad(running.float(), (0, grown)) + added


def rank_union(scores: Sequence[torch.Tensor], ranked_dims: int = 1) -> torch.Tensor:
    """Scores of the same positions ``[..., S]`` from several sources -> one fp32 ``[..., S]``
    whose top-k is what ranks high by any source: each source's scores become their rank
    among the positions of its last ``ranked_dims`` dimensions (1: each row's positions;
    3 over ``[L, H, S]``: the whole request's, for methods that share budgets model-wide),
    scaled to [0, 1], and the ranks are max-combined (so the top k/2 of each source rank above
    everything else, whatever their scales). Equal scores of a source rank by position (a
    stable sort: the later one higher), as ``union.model_wide_union_selection`` reproduces
    without ranking a long prompt whole."""
    if not scores:
        raise ValueError("rank_union needs at least one score tensor")
    shape = scores[0].shape
    if any(score.shape != shape for score in scores):
        raise ValueError(f"rank_union needs scores of one shape, got "
                         f"{[list(score.shape) for score in scores]}")
    if not 1 <= ranked_dims <= len(shape):
        raise ValueError(f"ranked_dims must be in [1, {len(shape)}], got {ranked_dims}")
    flat = [score.float().flatten(-ranked_dims) for score in scores]
    scale = 1.0 / max(1, flat[0].shape[-1] - 1)
    ranks = [score.argsort(dim=-1, stable=True).argsort(dim=-1).float() * scale
             for score in flat]
    return torch.stack(ranks).amax(dim=0).view(shape)
