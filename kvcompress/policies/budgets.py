"""How many tokens each layer keeps per KV head: PyramidKV's arithmetic schedule or a uniform one.

All budgets count the observation window. The schedule is computed in exact rational arithmetic and
rounded with the largest-remainder method, so the per-layer budgets add up to exactly
``num_layers * budget`` (the reference implementation floors the step and overshoots).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from functools import lru_cache

from .methods.base import BudgetShape
from .registry import get_method
from .settings import DEFAULT_BETA, DEFAULT_WINDOW
from .validation import check_beta, check_budget_spec, check_int, exact_fraction


def resolve_budget(
    prompt_len: int,
    budget: int | None = None,
    ratio: float | None = None,
    window: int = DEFAULT_WINDOW,
) -> int:
    """Average tokens kept per (layer, head), window included, for one prompt.

    ``ratio`` is the fraction of the prompt evicted: C = round_half_up((1 - ratio) * prompt_len),
    at least ``window + 1`` so something beyond the window survives. The result may exceed the
    prompt length; callers then keep everything.
    """
    check_int("prompt_len", prompt_len, 1)
    check_budget_spec(budget, ratio, window)
    if budget is not None:
        return int(budget)
    kept = (1 - exact_fraction(ratio)) * prompt_len
    return max(window + 1, math.floor(kept + Fraction(1, 2)))


def distribute_exactly(values: Sequence[Fraction], total: int) -> list[int]:
    """Integers close to ``values`` that sum to ``total`` (largest-remainder method).

    Each value is floored, then the units still missing go to the largest fractional parts; ties go
    to the lower index. For a non-increasing input the output stays non-increasing: equal floors
    imply the earlier value has the larger (or equal) fractional part, so it is served first.
    """
    floors = [math.floor(v) for v in values]
    missing = total - sum(floors)
    if not 0 <= missing <= len(values):
        raise ValueError(f"cannot round {len(values)} values to total {total}")
    by_remainder = sorted(range(len(values)), key=lambda i: (-(values[i] - floors[i]), i))
    for i in by_remainder[:missing]:
        floors[i] += 1
    return floors


def pyramid_selected_schedule(
    num_layers: int, prompt_len: int, budget: int, window: int, beta: Fraction
) -> list[Fraction]:
    """PyramidKV's real-valued per-layer count of selected (non-window) tokens.

    B = budget - window; top = B / beta; bottom = 2B - top; if bottom > q - w then bottom = q - w
    and top = 2B - bottom; layer l gets bottom - l * (bottom - top) / (L - 1). The mean is exactly
    B. Callers guarantee budget < prompt_len and num_layers >= 2.
    """
    selected = budget - window
    top = selected / beta
    bottom = 2 * selected - top
    if bottom > prompt_len - window:
        bottom = Fraction(prompt_len - window)
        top = 2 * selected - bottom
    step = (bottom - top) / (num_layers - 1)
    return [bottom - layer * step for layer in range(num_layers)]


def uses_pyramid(num_layers: int, prompt_len: int, budget: int, window: int) -> bool:
    """Whether the pyramid applies; otherwise every layer keeps ``budget``.

    Same regimes as the reference: prompt_len <= budget keeps everything (handled by the caller);
    prompt_len < 2 * (budget - window) falls back to uniform budgets; one layer is uniform.
    """
    return num_layers > 1 and prompt_len >= 2 * (budget - window)


@lru_cache(maxsize=4096)
def _budgets_for(
    pyramid: bool, num_layers: int, prompt_len: int, budget: int, window: int, beta: Fraction
) -> tuple[int, ...]:
    if prompt_len <= budget:
        # Nothing to compress. The total is then num_layers * prompt_len < num_layers * budget:
        # the exact total is impossible and we cap at what exists.
        return (prompt_len,) * num_layers
    if not (pyramid and uses_pyramid(num_layers, prompt_len, budget, window)):
        return (budget,) * num_layers
    schedule = pyramid_selected_schedule(num_layers, prompt_len, budget, window, beta)
    selected = distribute_exactly(schedule, num_layers * (budget - window))
    return tuple(count + window for count in selected)


def layer_budgets(
    method: str,
    num_layers: int,
    prompt_len: int,
    budget: int | None = None,
    ratio: float | None = None,
    window: int = DEFAULT_WINDOW,
    beta: float = DEFAULT_BETA,
    shape: BudgetShape | None = None,
) -> list[int]:
    """Tokens kept per KV head in each layer (window included), layer 0 first.

    ``shape`` (PolicySettings.budget_shape), else the method's record (registry), says the
    shape: "pyramid" budgets shrink with depth (for
    "adakv" they are the per-head average of the layer total), "uniform" ones keep the same
    budget in every layer. Whenever prompt_len > budget the list sums to exactly
    num_layers * budget, each entry lies in [window, prompt_len], and the list is
    non-increasing. Otherwise every layer keeps prompt_len.
    """
    shape = shape or get_method(method).budget_shape
    check_int("num_layers", num_layers, 1)
    check_beta(beta)
    per_layer = resolve_budget(prompt_len, budget, ratio, window)
    return list(
        _budgets_for(
            shape == "pyramid",
            int(num_layers),
            int(prompt_len),
            per_layer,
            int(window),
            exact_fraction(beta),
        )
    )
