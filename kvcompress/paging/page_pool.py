"""The page pool: which pages are free, as a stack of ids.

Every page of a rank's pool is free (on the stack here) or held: by one request's table
(``request_tables``) or by one prefix-cache entry (``prefix_cache``). The pool only stacks
ids; ``check`` proves, given everything the holders report, that each page is in exactly one
place: free + owned + cached == total.

A pop that needs more pages than are free first asks ``reclaim`` for them: the prefix cache
evicts entries into the pool there (``PageManager`` wires it), so cached pages count as
available without the request tables knowing about the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


class PagePool:
    def __init__(self, total_pages: int) -> None:
        self.total_pages = total_pages
        # Popped from the end: the lowest ids go first (a fresh pool hands out 0, 1, ...).
        self._stack = np.arange(total_pages - 1, -1, -1, dtype=np.int32)
        self._num_free = total_pages
        # Called with the pages a pop wants when fewer are free; it pushes what it can spare.
        self.reclaim: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        return self._num_free

    def pop(self, count: int) -> np.ndarray:
        """``count`` free page ids (reclaiming first when the stack falls short)."""
        if count > self._num_free and self.reclaim is not None:
            self.reclaim(count)
        if count > self._num_free:
            raise RuntimeError(f"{count} pages wanted, {self._num_free} free after "
                               "evicting every cached entry")
        start = self._num_free - count
        page_ids = self._stack[start : self._num_free].copy()
        self._num_free = start
        return page_ids

    def push(self, page_ids: np.ndarray) -> None:
        count = len(page_ids)
        self._stack[self._num_free : self._num_free + count] = page_ids
        self._num_free += count

    def check(self, held: dict[str, Sequence[np.ndarray]]) -> None:
        """Raise AssertionError unless the free pages and ``held`` (page-id arrays by kind
        of holder, e.g. "owned", "cached") hold every page exactly once."""
        everything = np.concatenate([self._stack[: self._num_free],
                                     *(pages for kind in held.values() for pages in kind)])
        assert len(everything) == self.total_pages, (
            f"free {self._num_free} + "
            + " + ".join(f"{name} {sum(len(pages) for pages in kind)}"
                         for name, kind in held.items())
            + f" != total {self.total_pages}")
        assert len(np.unique(everything)) == self.total_pages, "a page is held twice"
