"""Expected-attention scores: how much attention the queries to come are expected to pay
each cached key, from a model's query profile (``profile_model.profiles``). No extra pass and
no question: a prompt's keys are scored from the keys alone when the prompt completes.

A future query of query head ``h`` at position ``t`` is modelled as ``R_t q`` with ``q``
Gaussian (the profile's pre-rotary mean ``mu`` and covariance ``S``) and ``R_t`` the
rotary embedding. Averaging the rotation over the next ``horizon`` positions gives ``R``,
and for ``q ~ N(R mu, R S R^T)`` the expected ``exp(scale * q . k)`` is
``exp(scale * (R mu) . k + scale^2 / 2 * k^T (R S R^T) k)``: that logit, softmax-normalized
over the row's keys, is the key's expected attention (the Expected Attention estimator of
kvpress, with the statistics profiled once per model instead of taken from the prompt's
last queries, which would be the question's). Query heads of a KV head combine by mean or
max as the window scores do. The soft-cap and sinks are left out: the score is an estimate.
"""

from __future__ import annotations

import torch

# Future positions the rotation is averaged over (kvpress's default horizon).
DEFAULT_HORIZON = 512


def mean_rotation(inv_freq: torch.Tensor, start: int, head_dim: int, *,
                  rotary_scaling: float = 1.0, horizon: int = DEFAULT_HORIZON) -> torch.Tensor:
    """``[D, D]``: the rotary embedding (neox layout over the first ``2 * len(inv_freq)``
    dimensions, the rest unrotated) averaged over positions ``start .. start + horizon - 1``;
    ``R @ q`` is the mean of the rotated ``q``."""
    half = inv_freq.shape[0]
    positions = torch.arange(start, start + horizon, dtype=torch.float64,
                             device=inv_freq.device)
    angles = positions[:, None] * inv_freq.double()[None, :]  # [horizon, R/2]
    cos = angles.cos().mean(0) * rotary_scaling
    sin = angles.sin().mean(0) * rotary_scaling
    rotation = torch.eye(head_dim, dtype=torch.float64, device=inv_freq.device)
    first = torch.arange(half, device=inv_freq.device)
    second = first + half
    rotation[first, first] = cos
    rotation[second, second] = cos
    rotation[first, second] = -sin
    rotation[second, first] = sin
    return rotation.float()


def rotated_profile(means: torch.Tensor, covariances: torch.Tensor, rotation: torch.Tensor,
                    num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's profile of its ``Hq`` query heads grouped by KV head: rotated means
    ``[H, G, D]``, the covariances ``[H, G, D, D]`` as profiled (a view: ``R S R^T`` is
    applied to the keys instead, ``k^T R S R^T k = (R^T k)^T S (R^T k)``, so no rotated copy
    of every query head's matrix is made) and the rotation."""
    group = means.shape[0] // num_kv_heads
    mean = (means.float() @ rotation.T).view(num_kv_heads, group, -1)
    cov = covariances.float()
    return mean, cov.view(num_kv_heads, group, *cov.shape[1:]), rotation


def expected_logits(keys: torch.Tensor, profile: tuple[torch.Tensor, torch.Tensor,
                                                       torch.Tensor],
                    scale: float) -> torch.Tensor:
    """``[H, G, n]`` fp32 logits of ``keys [H, D, n]`` under a ``rotated_profile``. Builds
    an ``[H, G, D, n]`` product: callers bound ``n`` (``worker.expected``)."""
    mean, cov, rotation = profile
    keys = keys.float()
    linear = torch.matmul(mean, keys)  # [H, G, n]
    turned = torch.matmul(rotation.T, keys)[:, None]  # R^T k: [H, 1, D, n]
    # k^T R S R^T k per key: (S R^T k) . R^T k, batched over heads and their query heads.
    quadratic = (torch.matmul(cov, turned) * turned).sum(2)  # [H, G, n]
    return linear.mul_(scale).add_(quadratic, alpha=0.5 * scale * scale)


def expected_probabilities(logits: torch.Tensor, lengths: torch.Tensor,
                           group_reduce: str = "mean") -> torch.Tensor:
    """``logits [H, G, S]`` (overwritten) softmax-normalized over each row's first
    ``lengths[h]`` keys, reduced over the group -> ``[H, S]`` (0 past a row's length)."""
    width = logits.shape[-1]
    past = torch.arange(width, device=logits.device)[None, :] >= lengths.to(logits.device)[:, None]
    logits.masked_fill_(past[:, None, :], float("-inf"))
    top = logits.amax(dim=-1, keepdim=True).nan_to_num_(0.0, neginf=0.0)  # an empty row
    probabilities = logits.sub_(top).exp_()
    probabilities.div_(probabilities.sum(dim=-1, keepdim=True)).nan_to_num_(0.0)
    if group_reduce == "max":
        return probabilities.amax(dim=1)
    return probabilities.mean(dim=1)


def expected_scores(keys: torch.Tensor, lengths: torch.Tensor, means: torch.Tensor,
                    covariances: torch.Tensor, rotation: torch.Tensor, scale: float,
                    group_reduce: str = "mean") -> torch.Tensor:
    """``keys [H, D, S]`` (rotated, as cached) of the ``H`` KV heads of one layer, row ``h``
    holding ``lengths[h]`` keys; ``means [Hq, D]`` / ``covariances [Hq, D, D]`` the layer's
    profile of its ``Hq = H * group`` query heads. Returns ``[H, S]`` fp32: each key's
    expected attention (0 past a row's length). All keys at once: the reference the
    engine's chunked reading (``worker.expected``) is tested against."""
    profile = rotated_profile(means, covariances, rotation, keys.shape[0])
    return expected_probabilities(expected_logits(keys, profile, scale), lengths, group_reduce)
