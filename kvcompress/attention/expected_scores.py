"""Expected-attention scores: how much attention the queries to come are expected to pay
each cached key, from a model's query profile (``kvcompress.profiles``). No extra pass and
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


def expected_scores(keys: torch.Tensor, lengths: torch.Tensor, means: torch.Tensor,
                    covariances: torch.Tensor, rotation: torch.Tensor, scale: float,
                    group_reduce: str = "mean") -> torch.Tensor:
    """``keys [H, D, S]`` (rotated, as cached) of the ``H`` KV heads of one layer, row ``h``
    holding ``lengths[h]`` keys; ``means [Hq, D]`` / ``covariances [Hq, D, D]`` the layer's
    profile of its ``Hq = H * group`` query heads. Returns ``[H, S]`` fp32: each key's
    expected attention (0 past a row's length)."""
    num_kv_heads, _, width = keys.shape
    group = means.shape[0] // num_kv_heads
    keys = keys.float()
    mean = (means.float() @ rotation.T).view(num_kv_heads, group, -1)  # [H, G, D]
    cov = rotation @ covariances.float() @ rotation.T  # [Hq, D, D]
    cov = cov.view(num_kv_heads, group, *cov.shape[1:])
    linear = torch.matmul(mean, keys)  # [H, G, S]
    # k^T S k per key: (S k) . k, batched over heads and their query heads.
    quadratic = (torch.matmul(cov, keys[:, None]) * keys[:, None]).sum(2)  # [H, G, S]
    logits = scale * linear + 0.5 * scale * scale * quadratic
    past = torch.arange(width, device=keys.device)[None, :] >= lengths.to(keys.device)[:, None]
    logits.masked_fill_(past[:, None, :], float("-inf"))
    probabilities = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # an empty row: zeros
    if group_reduce == "max":
        return probabilities.amax(dim=1)
    return probabilities.mean(dim=1)
