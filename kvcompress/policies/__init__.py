"""KV-cache compression policies in pure torch (no vLLM): budgets, scores, selection, plans.

- registry:  the methods users can choose (``METHODS``, in the order shown), one record each,
             defined in ``methods/<name>.py``; ``get_method(name)``.
- settings:  ``PolicySettings`` (method, budget or ratio, window, knobs) and the policy defaults.
- budgets:   tokens kept per layer (PyramidKV arithmetic schedule, uniform), exact totals.
- scores:    observation-window scores per KV head (GQA-aware), pooling, H2O attention mass.
- selection: keep masks (top-k per head, Ada-KV shared allocation, sinks + recent) and indices.
- threshold: threshold eviction (``PolicySettings.score_threshold``): keep what scores above
             it, with a floor per head, optionally capped by the budget.
- union:     hybrid scoring's union of rankings shared model-wide, its kept set found slice
             by slice (the whole request never ranked at once).
- plan:      ``plan_keep(settings, ...)``, returning a ``KeepPlan``, and the engine's entry
             point ``plan_keep_each`` (one per request, each as wide as its own rows).
- decode:    decode-time eviction of generated tokens (``--kv-decode-policy``): one module per
             method, ``DecodeEviction`` (a request's resolved settings), ``get_decode_method``.
"""

from .budgets import distribute_exactly, layer_budgets, resolve_budget
from .methods.base import CompressionMethod, SelectionBlock, SelectionSettings
from .plan import KeepPlan, plan_keep, plan_keep_each
from .registry import COMPRESSION_METHODS, METHODS, get_method, temporarily_registered
from .scores import (
    accumulate_attention_mass,
    aggregate_window_probs,
    finalize_window_scores,
    observation_window_scores,
    pool_scores,
    rank_union,
    window_attention_probs,
)
from .selection import (
    PAD_INDEX,
    mask_to_indices,
    positions_to_mask,
    ranking_keys,
    shared_quota_mask,
    shared_quota_positions,
    sink_recent_mask,
    top_quota_mask,
    top_quota_positions,
    window_mask,
)
from .settings import PolicySettings

__all__ = [
    "COMPRESSION_METHODS",
    "METHODS",
    "PAD_INDEX",
    "CompressionMethod",
    "KeepPlan",
    "PolicySettings",
    "SelectionBlock",
    "SelectionSettings",
    "accumulate_attention_mass",
    "aggregate_window_probs",
    "distribute_exactly",
    "finalize_window_scores",
    "get_method",
    "layer_budgets",
    "mask_to_indices",
    "observation_window_scores",
    "plan_keep",
    "plan_keep_each",
    "pool_scores",
    "positions_to_mask",
    "rank_union",
    "ranking_keys",
    "resolve_budget",
    "shared_quota_mask",
    "shared_quota_positions",
    "sink_recent_mask",
    "temporarily_registered",
    "top_quota_mask",
    "top_quota_positions",
    "window_attention_probs",
    "window_mask",
]
