"""Argument checks shared by the policies and the CLI, and how user-given decimals are read.

Every check raises ValueError naming the argument (or CLI flag, via ``name``) and the allowed range,
so bad configuration fails before any tensor work starts.
"""

from __future__ import annotations

import math
import operator
from fractions import Fraction

# Method names live in registry.py, defaults in settings.py.
POOLINGS = ("max", "avg", "none")
GROUP_REDUCES = ("mean", "max", "sum")
WINDOW_REDUCES = ("sum", "mean")


def exact_fraction(value: float) -> Fraction:
    """The decimal the user wrote (0.2 -> 1/5), not the binary float's expansion."""
    if isinstance(value, int):
        return Fraction(value)
    return Fraction(repr(float(value)))


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    """An integer (bools rejected) in [minimum, maximum]."""
    try:
        if isinstance(value, bool):
            raise TypeError("bool is not a count")
        number = operator.index(value)  # accepts int-like (numpy ints), rejects 3.0
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    upper = "" if maximum is None else f" and <= {maximum}"
    if number < minimum or (maximum is not None and number > maximum):
        raise ValueError(f"{name} must be an integer >= {minimum}{upper}, got {number}")
    return number


def check_real(
    name: str,
    value: object,
    *,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """A finite real number in the interval described by low/high and openness."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)  # type: ignore[arg-type]  # numpy scalars, 0-d tensors
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a number, got {value!r}") from None
    number = float(value)
    left = "(" if low_open else "["
    right = ")" if high_open or math.isinf(high) else "]"
    interval = f"{left}{low:g}, {high:g}{right}"
    too_low = number <= low if low_open else number < low
    too_high = number >= high if high_open else number > high
    if not math.isfinite(number) or too_low or too_high:
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return number


def check_pooling(pooling: str, kernel: int, *, kernel_name: str = "pooling_kernel") -> None:
    check_choice("pooling", pooling, POOLINGS)
    check_int(kernel_name, kernel, 1)
    if kernel % 2 == 0:
        raise ValueError(f"{kernel_name} must be an odd integer >= 1, got {kernel}")


def check_budget_spec(
    budget: int | None,
    ratio: float | None,
    window: int,
    *,
    budget_name: str = "budget",
    ratio_name: str = "ratio",
    window_name: str = "window",
) -> None:
    """Exactly one of budget (tokens per head, window included) or ratio (fraction evicted)."""
    check_int(window_name, window, 0)
    if (budget is None) == (ratio is None):
        raise ValueError(f"give exactly one of {budget_name} or {ratio_name}")
    if budget is not None:
        check_int(budget_name, budget, 1)
        if budget < window:
            raise ValueError(
                f"{budget_name} must be >= {window_name} ({window}), got {budget}: "
                "the observation window is always kept"
            )
    else:
        check_real(ratio_name, ratio, low=0.0, high=1.0, low_open=True, high_open=True)


def check_beta(beta: float, *, name: str = "beta") -> float:
    # beta < 1 would put the top layer above the average and invert the pyramid.
    return check_real(name, beta, low=1.0)
