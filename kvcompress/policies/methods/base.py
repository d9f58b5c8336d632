"""What a compression method is: the record the registry lists, and what its selection sees."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from ..validation import check_choice

if TYPE_CHECKING:
    import torch

BudgetShape = Literal["pyramid", "uniform"]
BUDGET_SHAPES: tuple[BudgetShape, ...] = ("pyramid", "uniform")


@dataclass(frozen=True)
class SelectionBlock:
    """Requests planned together, as a method's selection sees them. All of them compress
    (prompt_len > budget >= window), so every head keeps its window plus ``quota`` tokens.

    scores: fp32 [R, L, H, S] observation-window scores, pooled over each request's selectable
        prefix, -inf from ``prefix`` on (window and padding); None for methods without scores.
        Under a score threshold (threshold.py) also -inf inside the prefix where a token is no
        candidate, and a quota may then exceed the finite scores: a selection picking -inf
        entries is fine, the planner drops them.
    prefix: LongTensor[R]; the selectable positions of request r are [0, prefix[r]), the window
        [prefix[r], prompt_len) is kept anyway.
    quota: LongTensor[R, L], tokens each KV head selects from the prefix: its layer budget minus
        the window (a method may share a layer's H * quota among its heads).
    num_kv_heads: H, also when there are no scores.
    """

    scores: torch.Tensor | None
    prefix: torch.Tensor
    quota: torch.Tensor
    num_kv_heads: int


@runtime_checkable
class SelectionSettings(Protocol):
    """The PolicySettings fields selections read. The methods cannot import settings.py (it checks
    method names against the registry, which imports the methods), so they name it by this
    protocol: a method reading a new PolicySettings field adds it here too."""

    sink_tokens: int
    adakv_floor: float


# (block, settings) -> kept prefix positions [R, L, H, K], distinct within a row, any order,
# PAD_INDEX-padded. The planner adds the window, sorts, and counts the non-padding entries.
SelectTokens = Callable[[SelectionBlock, SelectionSettings], "torch.Tensor"]


@dataclass(frozen=True)
class CompressionMethod:
    """One compression method: its name, how its layer budgets are shaped, how it selects.

    name: what users pass (--kv-compression, PolicySettings.method).
    summary: one line that completes "'<name>' ..." in the --kv-compression help.
    budget_shape: "pyramid" (PyramidKV's schedule: shallow layers keep more, deep ones less) or
        "uniform" (every layer keeps the budget).
    needs_scores: whether ``select`` reads observation-window scores; without them the engine
        passes none and plan_keep accepts None.
    select: the token selection, see SelectTokens.
    shape_setting: the PolicySettings field that chooses the budget shape instead of
        ``budget_shape`` (the default), or None when the shape is fixed.
    shares_layer_budget: whether the heads of a layer share its total by score, so that a
        head keeps more or less than the layer budget (admission counts the worst spread).
    """

    name: str
    summary: str
    budget_shape: BudgetShape
    needs_scores: bool
    select: SelectTokens
    shape_setting: str | None = None
    shares_layer_budget: bool = False

    def __post_init__(self) -> None:
        check_choice("budget_shape", self.budget_shape, BUDGET_SHAPES)
