"""Slow, obvious loop implementations the vectorized policies are checked against."""

from __future__ import annotations

import math

import torch

from kvcompress.policies import PolicySettings, layer_budgets


def ref_window_probs(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[H_q, W, D] x [H_kv, S, D] -> [H_kv, G, W, S], one query and one key at a time."""
    num_q_heads, window, head_dim = queries.shape
    num_kv_heads, seq_len, _ = keys.shape
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_kv_heads, group, window, seq_len, dtype=torch.float64)
    for h in range(num_kv_heads):
        for g in range(group):
            q_head = h * group + g
            for i in range(window):
                visible = seq_len - window + i + 1
                logits = [
                    float(queries[q_head, i].double() @ keys[h, j].double()) / math.sqrt(head_dim)
                    for j in range(visible)
                ]
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights)
                for j in range(visible):
                    out[h, g, i, j] = weights[j] / total
    return out


def ref_aggregate(probs: torch.Tensor, group_reduce: str) -> torch.Tensor:
    """[H_kv, G, W, S] -> [H_kv, S]: reduce the group per query, then sum the queries."""
    num_kv_heads, group, window, seq_len = probs.shape
    out = torch.zeros(num_kv_heads, seq_len, dtype=torch.float64)
    for h in range(num_kv_heads):
        for j in range(seq_len):
            for i in range(window):
                values = [float(probs[h, g, i, j]) for g in range(group)]
                if group_reduce == "mean":
                    out[h, j] += sum(values) / group
                elif group_reduce == "max":
                    out[h, j] += max(values)
                else:
                    out[h, j] += sum(values)
    return out


def ref_pool(row: list[float], pooling: str, kernel: int) -> list[float]:
    """Same-length 1-D pooling; max ignores the border, avg counts it as zeros."""
    if pooling == "none":
        return list(row)
    half = kernel // 2
    out = []
    for center in range(len(row)):
        inside = [row[j] for j in range(center - half, center + half + 1) if 0 <= j < len(row)]
        out.append(max(inside) if pooling == "max" else sum(inside) / kernel)
    return out


def _pooled_prefix(scores: torch.Tensor, prefix: int, pooling: str, kernel: int) -> list[float]:
    """Pool a score row over its non-window prefix with torch fp32 arithmetic for avg pooling.

    Max and none are exact in any order; avg goes through the same fp32 ops as a sum then a
    division so that near-ties cannot flip between reference and implementation.
    """
    row = scores[:prefix].float()
    if pooling != "avg":
        return ref_pool(row.tolist(), pooling, kernel)
    half = kernel // 2
    padded = torch.cat([torch.zeros(half), row, torch.zeros(half)])
    return [float(padded[c : c + kernel].sum() / kernel) for c in range(prefix)]


def ref_top(values: list[float], count: int) -> set[int]:
    """The ``count`` largest values' positions, lower position first on ties."""
    order = sorted(range(len(values)), key=lambda j: (-values[j], j))
    return set(order[:count])


def ref_plan(
    policy: PolicySettings,
    prompt_lens: list[int],
    scores: list[torch.Tensor | None] | None,
    *,
    num_layers: int,
    num_kv_heads: int,
) -> list[list[list[list[int]]]]:
    """kept[r][l][h] = sorted kept positions, computed head by head with Python sets."""
    method, window = policy.method, policy.window
    result = []
    # Ada-KV sharing uniform totals: the layer budgets of a uniform method (SnapKV's).
    budget_method = "snapkv" if (method, policy.adakv_totals) == ("adakv", "uniform") else method
    for r, q in enumerate(prompt_lens):
        budgets = layer_budgets(
            budget_method, num_layers, q, policy.budget, policy.ratio, window, policy.beta
        )
        win = min(window, q)
        prefix = q - win
        window_set = set(range(prefix, q))
        if policy.budget_sharing == "model" and min(budgets) < q:
            result.append(_ref_model_wide(policy, scores[r], budgets, prefix, window_set,
                                          num_kv_heads))
            continue
        per_request = []
        for layer in range(num_layers):
            keep = budgets[layer]
            if keep == q:
                per_request.append([list(range(q)) for _ in range(num_kv_heads)])
                continue
            if method == "streamingllm":
                sinks = min(policy.sink_tokens, keep - win)
                kept = set(range(sinks)) | set(range(q - (keep - sinks), q))
                per_request.append([sorted(kept) for _ in range(num_kv_heads)])
                continue
            rows = [
                _pooled_prefix(scores[r][layer, h], prefix, policy.pooling, policy.pooling_kernel)
                for h in range(num_kv_heads)
            ]
            quota = keep - win
            if method == "adakv":
                chosen = ref_adakv(rows, quota, policy.adakv_floor)
            else:
                chosen = [ref_top(row, quota) for row in rows]
            per_request.append([sorted(c | window_set) for c in chosen])
        result.append(per_request)
    return result


def ref_adakv(rows: list[list[float]], quota: int, floor_fraction: float) -> list[set[int]]:
    """Each head's top ceil(floor * quota), then the best of the rest across heads."""
    from fractions import Fraction

    head_floor = math.ceil(Fraction(repr(floor_fraction)) * quota)
    chosen = [ref_top(row, head_floor) for row in rows]
    remaining = len(rows) * quota - len(rows) * head_floor
    candidates = [
        (-value, h, j)
        for h, row in enumerate(rows)
        for j, value in enumerate(row)
        if j not in chosen[h]
    ]
    for _, h, j in sorted(candidates)[:remaining]:
        chosen[h].add(j)
    return chosen


def _ref_model_wide(policy: PolicySettings, scores: torch.Tensor, budgets: list[int],
                    prefix: int, window_set: set[int], num_kv_heads: int) -> list:
    """Budgets shared model-wide: the best (layer, head, position) of the whole request for
    the sum of the heads' quotas; ties to the lower layer, then head, then position."""
    win = len(window_set)
    total = sum(budget - win for budget in budgets) * num_kv_heads
    candidates = []
    for layer in range(len(budgets)):
        for h in range(num_kv_heads):
            row = _pooled_prefix(scores[layer, h], prefix, policy.pooling, policy.pooling_kernel)
            candidates += [(-value, layer, h, j) for j, value in enumerate(row)]
    chosen = [[set(window_set) for _ in range(num_kv_heads)] for _ in budgets]
    for _, layer, h, j in sorted(candidates)[:total]:
        chosen[layer][h].add(j)
    return [[sorted(kept) for kept in layer] for layer in chosen]
