"""Which prefix-cache entries a new prompt may start from: token prefixes matched by
chained hashes.

An entry is a finished request's K/V (``prefix_cache``) for its first tokens. A prompt may
adopt it when they share a prefix at least as long as the entry's first cut (the first
position where the entry's rows can be cut, ``CacheEntry.first_cut``). Entries are filed
under the chained hash of their tokens up to the block boundary at or below that cut, so a
lookup hashes the prompt once, block by block, finds the candidates filed under any of its
boundaries, and confirms each one token by token (which also rules out collisions).
No vLLM imports: the scheduler glue (``kvcompress.engine.prefix_cache``) owns the policy.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

# Tokens per hashed block: shorter shared prefixes are not worth adopting.
BLOCK_TOKENS = 16


@dataclass
class _Filed:
    tokens: np.ndarray  # int64, the entry's tokens
    boundary_hash: int
    settings: Hashable  # the compression settings it was made under
    exact: bool  # its prompt part kept every token


def _chain_hashes(tokens: np.ndarray, limit: int) -> list[int]:
    """``hashes[k]``: hash of ``tokens[:(k + 1) * BLOCK_TOKENS]``, for blocks within ``limit``."""
    hashes: list[int] = []
    previous = 0
    for end in range(BLOCK_TOKENS, limit + 1, BLOCK_TOKENS):
        previous = hash((previous, tokens[end - BLOCK_TOKENS : end].tobytes()))
        hashes.append(previous)
    return hashes


class PrefixIndex:
    def __init__(self) -> None:
        self._filed: dict[int, _Filed] = {}
        self._by_hash: dict[int, set[int]] = {}

    def __len__(self) -> int:
        return len(self._filed)

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._filed

    def add(self, entry_id: int, tokens: np.ndarray, first_cut: int, settings: Hashable,
            exact: bool) -> bool:
        """File an entry holding ``tokens`` whose rows can be cut from ``first_cut`` on, made
        under ``settings``; ``exact``: its prompt part kept every token. False when it is
        too short to be worth filing."""
        tokens = np.asarray(tokens, dtype=np.int64)
        boundary = max(BLOCK_TOKENS, first_cut // BLOCK_TOKENS * BLOCK_TOKENS)
        if boundary > len(tokens):
            return False
        boundary_hash = _chain_hashes(tokens, boundary)[-1]
        self.remove(entry_id)
        self._filed[entry_id] = _Filed(tokens, boundary_hash, settings, exact)
        self._by_hash.setdefault(boundary_hash, set()).add(entry_id)
        return True

    def remove(self, entry_id: int) -> None:
        filed = self._filed.pop(entry_id, None)
        if filed is None:
            return
        siblings = self._by_hash[filed.boundary_hash]
        siblings.discard(entry_id)
        if not siblings:
            del self._by_hash[filed.boundary_hash]

    def filed(self, entry_id: int) -> tuple[np.ndarray, Hashable] | None:
        """The tokens and settings entry ``entry_id`` was filed with (None: not filed)."""
        filed = self._filed.get(entry_id)
        return None if filed is None else (filed.tokens, filed.settings)

    def candidates(self, tokens: np.ndarray, limit: int,
                   settings: Hashable) -> list[tuple[int, int, bool]]:
        """``(entry_id, shared, same_settings)`` for every entry the prompt ``tokens`` may
        start from: made under equal ``settings``, or exact. ``shared`` = tokens in common (at
        most ``limit``), at least the entry's boundary."""
        tokens = np.asarray(tokens, dtype=np.int64)
        limit = min(limit, len(tokens))
        found = []
        for block_hash in _chain_hashes(tokens, limit):
            for entry_id in self._by_hash.get(block_hash, ()):
                filed = self._filed[entry_id]
                same = filed.settings == settings
                if same or filed.exact:
                    found.append((entry_id, shared_prefix(filed.tokens, tokens, limit), same))
        return found


def shared_prefix(first: np.ndarray, second: np.ndarray, limit: int) -> int:
    length = min(len(first), len(second), limit)
    differ = np.flatnonzero(first[:length] != second[:length])
    return int(differ[0]) if len(differ) else length
