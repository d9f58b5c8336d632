"""Which prefix-cache entries a new prompt may start from: token prefixes matched by
chained hashes.

An entry is a finished request's K/V (``prefix_cache``) for its first tokens. A prompt may
adopt it when they share a prefix at least as long as the entry's first cut (the first
position where the entry's rows can be cut, ``CacheEntry.first_cut``). Entries are filed
under the chained hash of their tokens up to the block boundary at or below that cut, so a
lookup hashes the prompt once, block by block, finds the candidates filed under any of its
boundaries, and confirms each one token by token (which also rules out collisions).
No vLLM imports: the scheduler glue (``kvcompress.engine.sched.prefix_cache``) owns the policy.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

# Tokens per hashed block: shorter shared prefixes are not worth adopting.
BLOCK_TOKENS = 16


class TokenChain:
    """A prompt's tokens with the chained hash of every whole block (``hashes[k]``: of
    ``tokens[:(k + 1) * BLOCK_TOKENS]``), made once: prefixes are then compared in time
    independent of their length (``shared_with``), not token by token."""

    __slots__ = ("tokens", "hashes")

    def __init__(self, tokens: np.ndarray | Sequence[int]) -> None:
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.hashes = _chain_hashes(self.tokens, len(self.tokens))

    def __len__(self) -> int:
        return len(self.tokens)

    def shared_with(self, other: TokenChain, limit: int) -> int:
        """Tokens the two share from the start, at most ``limit``: whole blocks by a binary
        search over the chained hashes, then the tokens of the next block."""
        limit = min(limit, len(self.tokens), len(other.tokens))
        mine, theirs = self.hashes, other.hashes
        low, high = 0, min(len(mine), len(theirs), limit // BLOCK_TOKENS)
        while low < high:  # the number of leading blocks whose chains agree
            middle = (low + high + 1) // 2
            if mine[middle - 1] == theirs[middle - 1]:
                low = middle
            else:
                high = middle - 1
        start = low * BLOCK_TOKENS
        stop = min(limit, start + BLOCK_TOKENS)
        differ = np.flatnonzero(self.tokens[start:stop] != other.tokens[start:stop])
        return start + (int(differ[0]) if len(differ) else stop - start)


class PromptChains:
    """Each live request's prompt as a ``TokenChain``, made on first use and kept while the
    request lives (a prompt does not change): the scheduler looks up and groups every
    waiting request every schedule, and hashes none of their tokens again."""

    def __init__(self) -> None:
        self._chains: dict[str, TokenChain] = {}

    def get(self, request_id: str, length: int,
            token_ids: Callable[[], Sequence[int]]) -> TokenChain:
        """The chain of the request's ``length`` prompt tokens (``token_ids()`` asked only
        when it is made)."""
        chain = self._chains.get(request_id)
        if chain is None or len(chain) != length:
            chain = self._chains[request_id] = TokenChain(token_ids())
        return chain

    def prune(self, live: Callable[[str], bool]) -> None:
        """Forget the prompts of requests that are no longer ``live``."""
        for request_id in [r for r in self._chains if not live(r)]:
            del self._chains[request_id]


@dataclass
class _Filed:
    chain: TokenChain  # the entry's tokens
    boundary_hash: int
    settings: Hashable  # the compression settings it was made under
    exact: bool  # its prompt part kept every token

    @property
    def tokens(self) -> np.ndarray:
        return self.chain.tokens


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
        self.version = 0  # counts every add and remove

    def __len__(self) -> int:
        return len(self._filed)

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._filed

    def add(self, entry_id: int, tokens: np.ndarray, first_cut: int, settings: Hashable,
            exact: bool) -> bool:
        """File an entry holding ``tokens`` whose rows can be cut from ``first_cut`` on, made
        under ``settings``; ``exact``: its prompt part kept every token. False when it is
        too short to be worth filing."""
        chain = TokenChain(tokens)
        boundary = max(BLOCK_TOKENS, first_cut // BLOCK_TOKENS * BLOCK_TOKENS)
        if boundary > len(chain):
            return False
        boundary_hash = chain.hashes[boundary // BLOCK_TOKENS - 1]
        self.remove(entry_id)
        self.version += 1
        self._filed[entry_id] = _Filed(chain, boundary_hash, settings, exact)
        self._by_hash.setdefault(boundary_hash, set()).add(entry_id)
        return True

    def remove(self, entry_id: int) -> None:
        filed = self._filed.pop(entry_id, None)
        if filed is None:
            return
        self.version += 1
        siblings = self._by_hash[filed.boundary_hash]
        siblings.discard(entry_id)
        if not siblings:
            del self._by_hash[filed.boundary_hash]

    def filed(self, entry_id: int) -> tuple[np.ndarray, Hashable] | None:
        """The tokens and settings entry ``entry_id`` was filed with (None: not filed)."""
        filed = self._filed.get(entry_id)
        return None if filed is None else (filed.tokens, filed.settings)

    def shared_with(self, entry_id: int, chain: TokenChain, limit: int) -> int:
        """Tokens entry ``entry_id`` (filed) shares with the prompt ``chain``, at most
        ``limit``."""
        return chain.shared_with(self._filed[entry_id].chain, limit)

    def candidates(self, prompt: TokenChain | np.ndarray, limit: int,
                   settings: Hashable) -> list[tuple[int, int, bool]]:
        """``(entry_id, shared, same_settings)`` for every entry the prompt may start from:
        made under equal ``settings``, or exact. ``shared`` = tokens in common (at most
        ``limit``), at least the entry's boundary."""
        chain = prompt if isinstance(prompt, TokenChain) else TokenChain(prompt)
        limit = min(limit, len(chain))
        blocks = chain.hashes[: limit // BLOCK_TOKENS]
        # Whichever is fewer: the prompt's blocks or the hashes entries are filed under.
        if len(self._by_hash) < len(blocks):
            mine = set(blocks)
            hits = [block_hash for block_hash in self._by_hash if block_hash in mine]
        else:
            hits = [block_hash for block_hash in blocks if block_hash in self._by_hash]
        found = []
        for block_hash in hits:
            for entry_id in self._by_hash[block_hash]:
                filed = self._filed[entry_id]
                same = filed.settings == settings
                if same or filed.exact:
                    found.append((entry_id, chain.shared_with(filed.chain, limit), same))
        return found


def shared_prefix(first: np.ndarray, second: np.ndarray, limit: int) -> int:
    length = min(len(first), len(second), limit)
    differ = np.flatnonzero(first[:length] != second[:length])
    return int(differ[0]) if len(differ) else length
