"""What a decode-time eviction method is, and the resolved settings one request evicts with.

During generation each (layer, KV head) row holds its prompt part (what prompt compression
kept, never touched here) and then its generated tokens in generation order. Generated tokens
are addressed by their *offset* in that part (0 = the oldest still held). A decode method picks
which offsets survive an eviction; the engine moves them, in order, to the start of the part.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from ..selection import top_quota_positions
from ..validation import check_choice, check_int

# When a method's scores are collected (see DecodeMethod.score_collection).
ScoreCollection = Literal["none", "every_step", "last_window"]
SCORE_COLLECTIONS: tuple[ScoreCollection, ...] = ("none", "every_step", "last_window")



@dataclass(frozen=True)
class GeneratedSignals:
    """What a selection may look at, per (layer, KV head) row and generated offset.

    scores: ``[rows, generated]`` fp32 attention mass (what the method's score_collection
        says), or None: no scores were collected (keep the newest).
    keys: ``[rows, generated, head_size]`` the generated tokens' keys as cached (after the
        rotary embedding), only for methods with ``needs_keys`` (else None).
    anchor_scores: ``[rows, generated]`` fp32 attention mass each token received from the
        ``recent`` decode queries after it was written (itself included), only for methods
        with ``scores_anchors`` (else None).
    """

    scores: torch.Tensor | None
    keys: torch.Tensor | None = None
    anchor_scores: torch.Tensor | None = None


# (signals, rows, generated, budget, recent) -> kept offsets [rows, budget], ascending, each
# row's newest ``recent`` offsets among them.
SelectGenerated = Callable[[GeneratedSignals, int, int, int, int], torch.Tensor]


@dataclass(frozen=True)
class DecodeMethod:
    """One decode-time eviction method (``--kv-decode-policy``).

    name: what users pass.
    summary: one line that completes "'<name>' ..." in the --kv-decode-policy help.
    score_collection: which decode steps score the generated tokens: "none" (no scores),
        "every_step" (every decode step adds its attention; the mass of kept tokens is carried
        over an eviction, H2O) or "last_window" (only the decode steps of the newest ``recent``
        tokens before an eviction; reset after it, SnapKV's observation window).
    select: the selection, see SelectGenerated. Given ``scores=None`` (a method without
        scores, or a request with none collected yet, e.g. resumed after preemption) it keeps
        the newest ``budget`` offsets.
    needs_keys: the selection reads the generated tokens' keys (the engine gathers them from
        the pool at an eviction).
    scores_anchors: the decode steps also collect anchor scores (GeneratedSignals); they are
        carried over an eviction like "every_step" scores, so this needs "every_step".
    """

    name: str
    summary: str
    score_collection: ScoreCollection
    select: SelectGenerated
    needs_keys: bool = False
    scores_anchors: bool = False

    def __post_init__(self) -> None:
        check_choice("score_collection", self.score_collection, SCORE_COLLECTIONS)
        if self.scores_anchors and self.score_collection != "every_step":
            raise ValueError(f"decode method {self.name!r}: anchor scores are collected at "
                             "every decode step, so score_collection must be 'every_step'")

    @property
    def needs_scores(self) -> bool:
        return self.score_collection != "none"

    @property
    def carries_scores(self) -> bool:
        """Whether the kept tokens keep their scores over an eviction (else reset)."""
        return self.score_collection == "every_step"

    @property
    def samples_scores(self) -> bool:
        """Whether --kv-decode-score-every may sample its scores (H2O's mass, summed over
        every step, is estimated well from every K-th step counted K times). Not with anchor
        scores: a step adds anchor mass only to the newest ``recent`` offsets, so with K
        above that some offsets would never get any."""
        return self.score_collection == "every_step" and not self.scores_anchors


@dataclass(frozen=True)
class DecodeEviction:
    """How one request evicts generated tokens: its method, ``budget`` (generated tokens each
    KV head keeps), ``interval`` (how many more a head may hold before an eviction) and
    ``recent`` (newest generated tokens always kept, ``<= budget``). ValueError on
    construction naming the argument."""

    method: DecodeMethod
    budget: int
    interval: int
    recent: int

    def __post_init__(self) -> None:
        check_int("decode budget", self.budget, 1)
        check_int("decode interval", self.interval, 1)
        check_int("recent", self.recent, 0, self.budget)

    @property
    def capacity(self) -> int:
        """Generated tokens a head holds when an eviction runs (``budget + interval``): the
        width of the score accumulator, indexed by generated offset."""
        return self.budget + self.interval

    def headroom(self, generated: int | np.ndarray) -> int | np.ndarray:
        """Tokens a head holding ``generated`` generated tokens may still add before its
        cache stops growing: evictions bring it back to ``budget`` every ``interval``
        tokens, so it never holds more than ``capacity``. Elementwise over an array (the
        admission planner asks for a whole running batch at once)."""
        # Each eviction so far took ``interval`` tokens off; past ``budget`` one runs every
        # ``interval`` tokens (the first at ``capacity``).
        evictions = np.maximum(np.subtract(generated, self.budget), 0) // self.interval
        return self.capacity - (generated - evictions * self.interval)

    def due(self, generated: int) -> bool:
        """Whether a head holding ``generated`` tokens after a step evicts now."""
        return generated >= self.capacity

    def scores_step(self, generated_after: int) -> bool:
        """Whether a decode step that leaves ``generated_after`` tokens is scored."""
        if generated_after > self.capacity or not self.method.needs_scores:
            return False
        if self.method.score_collection == "last_window":
            return generated_after > self.capacity - self.recent
        return True

    def keep(self, scores: torch.Tensor | None, num_rows: int, generated: int, *,
             keys: torch.Tensor | None = None,
             anchor_scores: torch.Tensor | None = None) -> torch.Tensor:
        """Kept offsets ``[num_rows, budget]``, ascending, of rows holding ``generated >=
        budget`` tokens; ``scores`` ``[num_rows, generated]`` or None (keep the newest);
        ``keys`` and ``anchor_scores`` as in GeneratedSignals."""
        check_int("generated", generated, self.budget)
        for name, tensor in (("scores", scores), ("anchor scores", anchor_scores)):
            if tensor is not None and tuple(tensor.shape) != (num_rows, generated):
                raise ValueError(f"decode {name} must be [{num_rows}, {generated}], "
                                 f"got {list(tensor.shape)}")
        if keys is not None and (keys.dim() != 3 or tuple(keys.shape[:2]) != (num_rows,
                                                                            generated)):
            raise ValueError(f"decode keys must be [{num_rows}, {generated}, head_size], "
                             f"got {list(keys.shape)}")
        signals = GeneratedSignals(scores, keys, anchor_scores)
        kept = self.method.select(signals, num_rows, generated, self.budget, self.recent)
        if tuple(kept.shape) != (num_rows, self.budget):
            raise ValueError(f"decode method {self.method.name!r} kept {list(kept.shape)} "
                             f"offsets, expected [{num_rows}, {self.budget}]")
        return kept


def newest_offsets(num_rows: int, generated: int, budget: int,
                   device: torch.device | None = None) -> torch.Tensor:
    """The newest ``budget`` of ``generated`` offsets, in every row: ``[num_rows, budget]``."""
    return torch.arange(generated - budget, generated, device=device).expand(num_rows, -1)


def select_recent_and_top(signals: GeneratedSignals, num_rows: int, generated: int,
                          budget: int, recent: int) -> torch.Tensor:
    """``recent_and_top_offsets`` by the signals' scores (h2o, snapkv)."""
    return recent_and_top_offsets(signals.scores, num_rows, generated, budget, recent)


def recent_and_top_offsets(scores: torch.Tensor | None, num_rows: int, generated: int,
                           budget: int, recent: int) -> torch.Tensor:
    """Each row's newest ``recent`` offsets plus the ``budget - recent`` highest-scored older
    ones (ties: the older offset), ascending: ``[rows, budget]``. Without scores: the newest
    ``budget``."""
    if scores is None:
        return newest_offsets(num_rows, generated, budget)
    older = generated - recent
    quota = torch.tensor(budget - recent, device=scores.device)
    top = top_quota_positions(scores[:, :older], quota)  # best first
    newest = torch.arange(older, generated, device=scores.device).expand(scores.shape[0], -1)
    return torch.cat([top, newest], dim=-1).sort(dim=-1).values
