"""The page pool's reference counts against a plain model: a dict of page -> holders.

Random pops, shares, releases and transfers by holders of every kind (rows owning or reading
pages, entries, pins); after every operation the pool's counts, free stack and figures equal
the model's, and ``check`` accepts the holders' own account. A page is free iff nobody holds
it; a release never frees a page another holder still has."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcompress.paging.page_pool import Holder, PagePool

TOTAL = 24


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = PagePool(TOTAL)
        # The model: each holder (kind, name) -> its pages; a page at most once per holder.
        self.holders: dict[tuple[Holder, int], set[int]] = {}
        self.next_name = 0
        self.freed_by_reclaim = 0

    def _held(self) -> Counter:
        return Counter(page for pages in self.holders.values() for page in pages)

    def _new(self, kind: Holder, pages) -> None:
        self.holders[kind, self.next_name] = {int(page) for page in pages}
        self.next_name += 1

    def _pick(self, data, kinds) -> tuple[Holder, int] | None:
        names = sorted(key for key in self.holders if key[0] in kinds and self.holders[key])
        return data.draw(st.sampled_from(names)) if names else None

    @rule(count=st.integers(0, 6))
    def pop(self, count):
        """A row takes new pages: the lowest free ones are no one's."""
        if count > self.pool.num_free:
            with pytest.raises(RuntimeError, match="pages wanted"):
                self.pool.pop(count)
            return
        pages = self.pool.pop(count)
        assert not set(pages.tolist()) & set(self._held()), "popped a held page"
        self._new(Holder.OWNER, pages)

    @rule(data=st.data(), kind=st.sampled_from([Holder.READER, Holder.ENTRY, Holder.PIN]))
    def share(self, data, kind):
        """A new reader, entry or pin takes some held pages, but never a page a row owns
        (it writes it)."""
        held = sorted(self._held())
        if not held:
            return
        pages = data.draw(st.lists(st.sampled_from(held), unique=True, max_size=5))
        owned = set().union(*(pages for (k, _), pages in self.holders.items()
                              if k == Holder.OWNER))
        if set(pages) & owned:
            with pytest.raises(RuntimeError, match="a row owns"):
                self.pool.share(np.array(pages, dtype=np.int32), kind)
            return
        self.pool.share(np.array(pages, dtype=np.int32), kind)
        self._new(kind, pages)

    @rule(data=st.data())
    def release(self, data):
        """A holder lets go of some of its pages; only the pages nobody holds any more are
        free afterwards."""
        key = self._pick(data, list(Holder))
        if key is None:
            return
        pages = data.draw(st.lists(st.sampled_from(sorted(self.holders[key])), unique=True))
        self.holders[key] -= set(pages)
        expected = sum(1 for page in pages if self._held()[page] == 0)
        assert self.pool.release(np.array(pages, dtype=np.int32), key[0]) == expected

    @rule(data=st.data(), kind=st.sampled_from(list(Holder)))
    def transfer(self, data, kind):
        """A row's pages retired into an entry, an entry's handed over to a row: only a
        page nobody else holds can become a row's own."""
        target = kind
        key = self._pick(data, list(Holder))
        if key is None or key[0] == target:
            return
        pages = sorted(self.holders[key])
        held = self._held()
        if target == Holder.OWNER and any(held[page] > 1 for page in pages):
            with pytest.raises(RuntimeError, match="cannot become a row's own"):
                self.pool.transfer(np.array(pages, dtype=np.int32), key[0], target)
            return
        self.pool.transfer(np.array(pages, dtype=np.int32), key[0], target)
        del self.holders[key]
        self._new(target, pages)

    @precondition(lambda self: self.pool.num_free < TOTAL)
    @rule(data=st.data())
    def release_what_it_does_not_hold(self, data):
        """A holder's bookkeeping that is wrong fails loudly and changes nothing."""
        page = data.draw(st.sampled_from(range(TOTAL)))
        if any(page in pages for (kind, _), pages in self.holders.items()
               if kind == Holder.PIN):
            return
        with pytest.raises(RuntimeError, match="did not hold"):
            self.pool.release(np.array([page], dtype=np.int32), Holder.PIN)

    @invariant()
    def counts_free_stack_and_figures_match_the_model(self):
        held = self._held()
        counts = self.pool.counts(np.arange(TOTAL))
        assert counts.tolist() == [held[page] for page in range(TOTAL)]
        assert self.pool.num_free == TOTAL - len(held)  # free + count > 0 == total
        kinds = {page: {kind for (kind, _), pages in self.holders.items() if page in pages}
                 for page in held}
        rows = {Holder.OWNER, Holder.READER}
        assert self.pool.num_owned == sum(Holder.OWNER in k for k in kinds.values())
        assert self.pool.num_read == sum(Holder.READER in k and Holder.OWNER not in k
                                         for k in kinds.values())
        assert self.pool.num_evictable == sum(k == {Holder.ENTRY} for k in kinds.values())
        assert self.pool.num_cached == sum(not k & rows for k in kinds.values())
        self.pool.check({kind: [np.array(sorted(pages), dtype=np.int32)
                                for (held_kind, _), pages in self.holders.items()
                                if held_kind == kind]
                         for kind in Holder})

    @invariant()
    def an_owned_page_has_no_other_holder(self):
        held = self._held()
        for (kind, _), pages in self.holders.items():
            if kind == Holder.OWNER:
                assert all(held[page] == 1 for page in pages)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


def test_check_catches_a_count_that_no_holder_accounts_for():
    pool = PagePool(8)
    pages = pool.pop(3)
    pool.transfer(pages, Holder.OWNER, Holder.ENTRY)  # retired
    pool.share(pages[:1], Holder.READER)  # adopted by a reader
    pool.check({Holder.ENTRY: [pages], Holder.READER: [pages[:1]]})
    with pytest.raises(AssertionError, match="READER references"):
        pool.check({Holder.ENTRY: [pages]})


def test_a_free_page_cannot_be_shared():
    pool = PagePool(4)
    with pytest.raises(RuntimeError, match="free page"):
        pool.share(np.array([2], dtype=np.int32), Holder.READER)
