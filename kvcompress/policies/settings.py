"""Policy settings: everything plan_keep needs besides prompts and scores, validated once.

The policy defaults are defined here and nowhere else: settings/flags.py (the user-facing flags)
and the ``budgets`` command read them from this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .methods.base import BUDGET_SHAPES, BudgetShape, CompressionMethod
from .registry import get_method
from .sharing import BUDGET_SHARINGS, BudgetSharing
from .validation import (
    check_beta,
    check_budget_spec,
    check_choice,
    check_int,
    check_pooling,
    check_real,
)

DEFAULT_WINDOW = 8  # PyramidKV's LongBench runs; the authors found 8 or 16 best.
DEFAULT_BETA = 2.0  # measured: docs/methods.md, "Defaults, by measurement"
DEFAULT_POOLING = "max"
DEFAULT_POOLING_KERNEL = 15  # measured, as DEFAULT_BETA
DEFAULT_SINK_TOKENS = 4  # StreamingLLM's attention sinks.
DEFAULT_ADAKV_FLOOR = 0.2
DEFAULT_ADAKV_TOTALS: BudgetShape = "pyramid"
# Where the budget may go: within each layer (the methods' own) or across the whole model.
DEFAULT_BUDGET_SHARING: BudgetSharing = "layer"
# How the engine turns window attention into scores (scores.py), before plan_keep sees them.
DEFAULT_GROUP_REDUCE = "mean"
DEFAULT_WINDOW_REDUCE = "sum"


@dataclass(frozen=True)
class PolicySettings:
    """Which method, how much to keep, and the methods' knobs. ValueError on construction
    naming the argument and its allowed range.

    method: a registered method name (registry.METHODS).
    budget / ratio: exactly one: tokens kept per KV head and layer on average, window included
        (an integer >= window), or the fraction of the prompt evicted, in (0, 1).
    window: the observation window (last prompt tokens, always kept), >= 0.
    beta: PyramidKV slope, >= 1 (pyramid-shaped methods only).
    pooling / pooling_kernel: 1-D pooling of the scores before selection: "max", "avg" or
        "none"; odd kernel >= 1.
    sink_tokens: StreamingLLM's attention sinks, >= 0.
    adakv_floor: Ada-KV's per-head floor as a fraction of the per-head average, in [0, 1].
    adakv_totals: the layer totals Ada-KV's heads share: "pyramid" (PyramidKV's schedule) or
        "uniform" (every layer the budget); read only by methods whose record names it
        (CompressionMethod.shape_setting).
    budget_sharing: "layer" (the method's own: each layer keeps its budget, Ada-KV's heads
        share theirs) or "model" (the total of the request's layer budgets goes to its best
        (layer, head, token) anywhere; sharing.py). "model" needs a method with scores.
    score_threshold: None, or T < 0 (finite): every head keeps each prefix token whose pooled
        score s has log(s) > T, besides its floor (the window and the first sink_tokens;
        threshold.py). Budget and ratio may then both be None (no cap: as many as pass);
        given, one of them caps what passes (the method's split, or the request's total when
        shared model-wide). Needs a method with scores.
    """

    method: str
    budget: int | None = None
    ratio: float | None = None
    window: int = DEFAULT_WINDOW
    beta: float = DEFAULT_BETA
    pooling: str = DEFAULT_POOLING
    pooling_kernel: int = DEFAULT_POOLING_KERNEL
    sink_tokens: int = DEFAULT_SINK_TOKENS
    adakv_floor: float = DEFAULT_ADAKV_FLOOR
    adakv_totals: BudgetShape = DEFAULT_ADAKV_TOTALS
    budget_sharing: BudgetSharing = DEFAULT_BUDGET_SHARING
    score_threshold: float | None = None

    def __post_init__(self) -> None:
        get_method(self.method)
        if self.score_threshold is None or self.capped:
            check_budget_spec(self.budget, self.ratio, self.window)
        else:
            check_int("window", self.window, 0)
        check_beta(self.beta)
        check_pooling(self.pooling, self.pooling_kernel)
        # A plain int (not a numpy one): selections use it in tensor arithmetic.
        object.__setattr__(self, "sink_tokens", check_int("sink_tokens", self.sink_tokens, 0))
        check_real("adakv_floor", self.adakv_floor, low=0.0, high=1.0)
        check_choice("adakv_totals", self.adakv_totals, BUDGET_SHAPES)
        check_choice("budget_sharing", self.budget_sharing, BUDGET_SHARINGS)
        if self.budget_sharing == "model" and not self.compression_method.needs_scores:
            raise ValueError(f"budget_sharing 'model' needs a method that scores tokens; "
                             f"{self.method!r} does not")
        if self.score_threshold is not None:
            check_real("score_threshold", self.score_threshold, low=-math.inf, high=0.0,
                       high_open=True)
            if not self.compression_method.needs_scores:
                raise ValueError(f"score_threshold needs a method that scores tokens; "
                                 f"{self.method!r} does not")

    @property
    def capped(self) -> bool:
        """Whether a budget or a ratio bounds what each request keeps (always, without a
        score threshold; with one, only when given besides it)."""
        return self.budget is not None or self.ratio is not None

    @property
    def compression_method(self) -> CompressionMethod:
        """The registry record of ``method``: budget shape, whether it needs scores, selection."""
        return get_method(self.method)

    @property
    def budget_shape(self) -> BudgetShape:
        """How this request's layer budgets are shaped: the method's own, unless its record
        lets a setting choose (Ada-KV: adakv_totals)."""
        method = self.compression_method
        if method.shape_setting is None:
            return method.budget_shape
        return getattr(self, method.shape_setting)
