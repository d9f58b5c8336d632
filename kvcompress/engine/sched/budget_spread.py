"""The worst way a shared budget can spread over rows, in pages: what admission must count
when a policy decides per row only after the scores (model-wide sharing, Ada-KV's heads).

Rows that share a total each keep at least a floor (their window) and at most a cap (the
prompt), and pages are rounded up per row: the same tokens cost the most pages when as
many rows as possible end just past a page boundary. Which spread is worst depends on how
far the rows have grown since (a row one token past a boundary gains nothing for the next
``page_size - 1`` tokens), so there is one worst spread per growth modulo ``page_size``:
the request's pages at any step are the most over those spreads (``Trajectory``'s
alternatives), and no spread the policy may pick takes more.

Why greedy is exact: from the floor, row ``i``'s first extra page costs ``d_i`` tokens
(to one past its next boundary, ``1 <= d_i <= page_size``), each further page
``page_size``. Every page is worth one, so the cheapest first: the ``d_i`` in ascending
order, then whole pages; what is left over goes where it costs no page.

No vLLM imports.
"""

from __future__ import annotations

import numpy as np

# The cost of a page a row cannot reach: larger than any total, small enough to add up.
_UNREACHABLE = 1 << 40


def worst_spreads(offsets: np.ndarray, floors: np.ndarray, cap: int, totals: np.ndarray,
                  page_size: int) -> np.ndarray:
    """``offsets [G, m]``: tokens row ``j`` of group ``g`` holds besides its share (adopted
    context, generated tokens); the group's ``m`` rows share ``totals[g]`` tokens, each
    keeping between ``floors[g]`` and ``cap`` (``m * floors[g] <= totals[g] <= m * cap``).
    Returns ``[page_size, G * m]`` row lengths (offsets included): entry ``s`` is a spread
    whose pages after ``s`` more tokens per row are the most any spread takes then (and so
    after ``s + k * page_size``)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    groups, width = offsets.shape
    floors = np.asarray(floors, dtype=np.int64)[:, None]
    growth = np.arange(page_size, dtype=np.int64)[:, None, None]  # [P, 1, 1]
    start = offsets + floors + growth  # [P, G, m] each row at its floor, grown
    end = offsets + cap + growth  # the most it may hold
    spare = np.asarray(totals, dtype=np.int64)[:, None] - width * floors  # [G, 1]

    # A row's first extra page: to one past its next boundary, where its cap allows.
    pages_at_start = -(-start // page_size)
    first = pages_at_start * page_size + 1 - start
    first = np.where(start + first <= end, first, _UNREACHABLE)
    order = np.argsort(first, axis=-1, kind="stable")
    cost = np.take_along_axis(first, order, axis=-1)
    taken = np.zeros_like(first, dtype=bool)
    np.put_along_axis(taken, order, np.cumsum(cost, axis=-1) <= spare[None], axis=-1)
    lengths = start + np.where(taken, first, 0)
    left = spare[None, :, 0] - np.where(taken, first, 0).sum(axis=-1)  # [P, G]

    # Then whole pages on rows past a boundary already, as far as their caps allow.
    more = np.where(taken, -(-end // page_size) - pages_at_start - 1, 0)
    whole = np.minimum(left // page_size, more.sum(axis=-1))
    lengths += page_size * _fill_in_order(more, whole)
    left -= page_size * whole
    # The rest costs no page whichever row takes it (it fits: the caps hold the total).
    lengths += _fill_in_order(end - lengths, left)
    return (lengths - growth).reshape(page_size, groups * width)


def _fill_in_order(room: np.ndarray, amount: np.ndarray) -> np.ndarray:
    """``amount [..]`` units per group given to its rows ``room [.., m]`` in row order, each
    at most its room."""
    before = np.cumsum(room, axis=-1) - room
    return np.clip(amount[..., None] - before, 0, room)
