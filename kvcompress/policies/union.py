"""Hybrid scoring's union of rankings shared model-wide, selected without ranking it whole.

``scores.rank_union(..., ranked_dims=3)`` ranks each source over a request's whole
``[L, H, S]`` and max-combines the scaled ranks; model-wide sharing then keeps the request's
``total`` best union values (ties to the lower flat position). Ranking ``[L, H, S]`` at once
holds ~36 bytes per score (two argsorts per source): ~290 MiB at 32k tokens of a Llama-8B
layout. Only the kept set matters to the plan, and it is found here exactly, a slice of rows
at a time, with temporaries bounded by the caller's workspace:

- a source's rank of an element is ``N - k`` for the ``k`` such that the element is the
  ``k``-th largest of its source's keys (``score_keys`` plus the flat position: a stable
  sort's order, equal scores ranked by position). An element's union value is
  ``f(max(rank_a, rank_b))``, ``f(m) = fp32(m) * scale`` as ``rank_union`` computes it, and
  ``{max rank >= N - k}`` is ``Top_a(k) | Top_b(k)``: the union of each source's ``k`` largest
  keys, each a threshold key (``kth_largest_keys``, digit by digit over the slices).
- ``U(k) = |Top_a(k) | Top_b(k)|`` grows with ``k`` from ``k`` to ``2k``: the kept set is
  bracketed between two ``k`` (``lo``, ``hi``) with ``U(lo) < total <= U(hi)``, narrowed by
  counting ``U`` at a few ``k`` at once until at most ``capacity`` keys of each source lie
  between them. Bracket points sit where ``f`` steps (every ``k`` where ``N`` is below 2**24;
  beyond, fp32 rounds some ranks together), so the union values inside the bracket are
  below those above it and above those below it.
- every element with a rank at or above ``N - lo`` is kept; the keys between the bracket's
  thresholds are gathered (``hi - lo`` of each source), ranked exactly, and the best
  ``total - U(lo)`` of them by ``(f(max rank), lower position)`` are kept too.

The result is the selection ``rank_union`` with a stable argsort would give, key for key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .selection import score_keys

# A slice: (flat position of its first element, each source's pooled scores [n], -inf where
# not selectable). Flat positions are those of ``rank_union``'s flattened [L, H, S].
SourceSlices = Callable[[], Iterator[tuple[int, list[torch.Tensor]]]]

# Digits of the threshold search: a 16-bit first digit (one histogram per source, shared by
# every query), then 12-bit ones (a histogram per distinct prefix of the queries).
_DIGIT_WIDTHS = (16, 12, 12, 12, 12)
_NO_THRESHOLD = 2**63 - 1  # above every key: Top(0), nothing
_LOW_32 = 0xFFFFFFFF
# Bytes of the histograms per bracket point counted in a round (two sources, 12-bit
# digits): a round narrows the bracket ``points + 1`` times and holds ``points + 2``.
UNION_POINT_BYTES = 2 * 4097 * 8


def union_keys(scores: torch.Tensor, first: int) -> torch.Tensor:
    """Keys ``[n]`` (int64) ranking ``scores [n]`` (flat positions ``first...``) as a stable
    ascending argsort does: by score, then position; unique, the position in the low 32
    bits."""
    keys = score_keys(scores)
    keys += first
    keys += torch.arange(scores.numel(), device=scores.device)
    return keys


def kth_largest_keys(key_slices: Callable[[], Iterator[list[torch.Tensor]]],
                     counts: list[list[int]], device: torch.device) -> list[list[int]]:
    """``counts[p][q]`` (each in [1, keys of source p]) -> source ``p``'s ``counts[p][q]``-th
    largest key, reading each source's keys as ``key_slices()`` yields them (a list of
    tensors ``[n]``, one per source, per slice; read once per digit: five times). Holds
    one histogram per source and distinct prefix of its queries (``4097 * 8`` bytes each,
    the first digit's one ``65537 * 8``)."""
    remaining = [list(row) for row in counts]
    prefix = [[0] * len(row) for row in counts]
    ones = torch.ones((), dtype=torch.long, device=device)
    shift = 64
    for number, bits in enumerate(_DIGIT_WIDTHS):
        shift -= bits
        bins = 1 << bits
        groups = [sorted(set(row)) for row in prefix]
        group_keys = [torch.tensor(group, dtype=torch.long, device=device) for group in groups]
        width = max(len(group) for group in groups) * bins
        histogram = torch.zeros(len(counts), width + 1, dtype=torch.long, device=device)
        for keys in key_slices():
            for source, source_keys in enumerate(keys):
                if number == 0:  # the sign digit: signed, made unsigned in order
                    slot = (source_keys >> shift).add_(bins // 2)
                else:  # the digit under its query's prefix; keys under none to a spare bin
                    high = source_keys >> (shift + bits)
                    group = torch.searchsorted(group_keys[source], high).clamp_(
                        max=len(groups[source]) - 1)
                    outside = group_keys[source][group] != high
                    del high
                    slot = (source_keys >> shift).bitwise_and_(bins - 1)
                    slot += group.mul_(bins)
                    del group
                    slot.masked_fill_(outside, width)
                    del outside
                histogram[source].scatter_add_(0, slot, ones.expand_as(slot))
                del slot
            del keys
        before = [list(row) for row in prefix]  # the groups' prefixes (updated below)
        for source, group_prefixes in enumerate(groups):
            for number_in_group, group_prefix in enumerate(group_prefixes):
                queries = [query for query, query_prefix in enumerate(before[source])
                           if query_prefix == group_prefix]
                row = histogram[source, number_in_group * bins:(number_in_group + 1) * bins]
                # at_least[d]: keys of the group whose digit is d or more (non-increasing);
                # a query's digit is the largest d with at least its remaining count.
                at_least = torch.cat([row.flip(0).cumsum(0).flip(0).cpu(),
                                      torch.zeros(1, dtype=torch.long)])
                wanted = torch.tensor([remaining[source][query] for query in queries])
                digits = torch.searchsorted(-at_least[:bins], -wanted, right=True) - 1
                taken_above = at_least[digits + 1]
                for query, digit, above in zip(queries, digits.tolist(), taken_above.tolist()):
                    remaining[source][query] -= above
                    prefix[source][query] = (digit - bins // 2 if number == 0
                                             else (group_prefix << bits) | digit)
    return prefix


def union_values(ranks: torch.Tensor, size: int) -> torch.Tensor:
    """``rank_union``'s value of an element whose larger rank is ``ranks`` (int64), among
    ``size`` elements: the same fp32 operations."""
    return ranks.float() * (1.0 / max(1, size - 1))


def _step_start(rank: int, size: int) -> int:
    """The lowest rank whose union value equals ``rank``'s (fp32 rounds ranks above 2**24
    together)."""
    low = rank
    while low > 0:
        window = torch.arange(max(0, low - 1024), low + 1)
        equal = union_values(window, size) == union_values(torch.tensor([rank]), size)
        first = int(window[int(equal.int().argmax())])
        if first > window[0] or first == 0:
            return first
        low = first
    return 0


def _bracket_point(k: int, size: int, upward: bool) -> int:
    """``k`` moved to where the union value steps (the top ``k`` ranks ``size - k...`` start
    a value): down (``upward`` False: fewer ranks) or up."""
    if k <= 0 or k >= size:
        return max(0, min(k, size))
    start = _step_start(size - k, size)
    if start == size - k:
        return k
    if upward:
        return size - start
    # Down: the start of the next value above.
    rank = size - k
    while rank < size and _step_start(rank, size) == start:
        rank += 1
    return size - rank


def model_wide_union_selection(source_slices: SourceSlices, size: int, total: int,
                               capacity: int, points: int, device: torch.device,
                               ) -> Callable[[int, list[torch.Tensor]], torch.Tensor]:
    """The ``total`` elements of the best union values among ``size`` (``rank_union`` of the
    two sources over every element, then the top by value, ties to the lower position), as
    a function of a slice (its first flat position, its sources' scores as
    ``source_slices`` yields them) to its kept mask ``[n]``. ``capacity``: most keys of a
    source gathered between the bracket's thresholds; ``points``: bracket points counted
    per round (their histograms: ``2 * (points + 2) * 32 KiB``)."""

    def key_slices() -> Iterator[list[torch.Tensor]]:
        for first, scores in source_slices():
            keys = [union_keys(source, first) for source in scores]
            del scores  # nothing of a slice but its keys stays referenced while they are read
            yield keys

    total = max(0, min(total, size))
    # U(k) is in [k, 2k]: the bracket starts at (ceil(total / 2) - 1, total).
    low = _bracket_point(-(-total // 2) - 1, size, upward=False)
    high = _bracket_point(total, size, upward=True)
    thresholds: dict[int, tuple[int, int]] = {0: (_NO_THRESHOLD, _NO_THRESHOLD)}
    counted = {0: 0}
    while total:
        wanted = [k for k in (low, high) if k not in thresholds]
        if high - low > capacity:
            spacing = (high - low) / (points + 1)
            inner = {_bracket_point(low + round(spacing * step), size, upward=True)
                     for step in range(1, points + 1)}
            wanted += sorted(k for k in inner if low < k < high and k not in thresholds)
        if not wanted:
            break
        found = kth_largest_keys(key_slices, [wanted, wanted], device)
        thresholds.update(zip(wanted, zip(*found)))
        ks = sorted(k for k in thresholds if low <= k <= high)
        counted.update(zip(ks, _union_sizes(
            key_slices, torch.tensor([thresholds[k] for k in ks], device=device).T)))
        low = max(k for k in ks if counted[k] < total)
        high = min(k for k in ks if counted[k] >= total)
    if not total:
        return lambda _first, scores: torch.zeros(scores[0].shape, dtype=torch.bool,
                                                  device=scores[0].device)
    low_keys = torch.tensor(thresholds[low], device=device)
    chosen = _chosen_between(key_slices, size, low_keys,
                             torch.tensor(thresholds[high], device=device), low, high,
                             total - counted[low])

    def selection(first: int, scores: list[torch.Tensor]) -> torch.Tensor:
        keys = [union_keys(source, first) for source in scores]
        kept = keys[0] >= low_keys[0]
        kept |= keys[1] >= low_keys[1]
        del keys
        kept[chosen[(chosen >= first) & (chosen < first + kept.numel())] - first] = True
        return kept

    return selection


def _union_sizes(key_slices: Callable[[], Iterator[list[torch.Tensor]]],
                 thresholds: torch.Tensor) -> list[int]:
    """``U(k)`` at each bracket point: ``thresholds [2, Q]`` (each source's threshold key,
    the points in increasing ``k``, so decreasing keys) -> the elements at or above either
    source's threshold, per point (one pass)."""
    queries = thresholds.shape[1]
    sizes = None
    for keys in key_slices():
        # In how many points' tops each element is, by either source (a point's top holds
        # the points after it too).
        deepest = None
        for source, source_keys in enumerate(keys):
            ascending = thresholds[source].flip(0).to(source_keys.device)
            inside = torch.searchsorted(ascending, source_keys, right=True)
            deepest = inside if deepest is None else torch.maximum(deepest, inside)
        del keys, source_keys
        assert deepest is not None
        histogram = torch.bincount(deepest, minlength=queries + 1)
        sizes = histogram if sizes is None else sizes + histogram
    assert sizes is not None
    # Point q (in increasing k) holds the elements in at least queries - q of the tops.
    at_least = sizes.flip(0).cumsum(0).flip(0)
    return [int(at_least[queries - point]) for point in range(queries)]


def _chosen_between(key_slices: Callable[[], Iterator[list[torch.Tensor]]], size: int,
                    low_keys: torch.Tensor, high_keys: torch.Tensor, low: int, high: int,
                    wanted: int) -> torch.Tensor:
    """Flat positions ``[wanted]`` of the best union values among the elements whose
    larger rank is in ``[size - high, size - low)``: each source's keys between its two
    thresholds gathered (``high - low`` each), ranked exactly."""
    # Unique keys: exactly ``high - low`` of each source lie between its two thresholds.
    bands = [torch.empty(2, high - low, dtype=torch.long, device=low_keys.device)
             for _ in (0, 1)]  # per source: its keys, the other source's
    filled = [0, 0]
    for keys in key_slices():
        for source in (0, 1):
            between = (keys[source] >= high_keys[source]) & (keys[source] < low_keys[source])
            count = int(between.sum())
            for row, of in enumerate((source, 1 - source)):
                bands[source][row, filled[source]:filled[source] + count] = keys[of][between]
            filled[source] += count
            del between
        del keys
    for source in (0, 1):
        own, order = bands[source][0].sort()
        bands[source] = torch.stack([own, bands[source][1][order]])
        del own, order
    # Ranks: the band's keys are the ranks [size - high, size - low) of their source.
    base = size - high
    own_a, other_a = bands[0]
    own_b, other_b = bands[1]
    rank_a = torch.arange(own_a.numel(), device=own_a.device) + base
    # A's band elements whose B rank is below size - low (else kept already): their larger
    # rank is A's, or B's where B's band holds them too.
    open_a = other_a < low_keys[1]
    in_b = other_a >= high_keys[1]
    rank_b_of_a = torch.searchsorted(own_b, other_a) + base
    larger_a = torch.where(in_b, torch.maximum(rank_a, rank_b_of_a), rank_a)[open_a]
    positions_a = (own_a[open_a] & _LOW_32)
    # B's band elements outside A's band (A's band holds the others).
    open_b = other_b < high_keys[0]
    larger_b = (torch.arange(own_b.numel(), device=own_b.device) + base)[open_b]
    positions_b = (own_b[open_b] & _LOW_32)
    del bands, own_a, other_a, own_b, other_b
    larger = torch.cat([larger_a, larger_b])
    positions = torch.cat([positions_a, positions_b])
    # Best union value first, then the lower position (unique keys).
    order_keys = score_keys(union_values(larger, size)) + (_LOW_32 - positions)
    best = torch.topk(order_keys, wanted).indices
    return positions[best]
