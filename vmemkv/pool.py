"""The page pool: reference counts, the free queues, and the prefix-cache index.

Every page is in exactly one state:

* **in use**: ``ref > 0``; never handed out again, never evicted.
* **cached**: ``ref == 0`` with a content hash; its bytes are kept, it sits in the LRU queue and can
  be revived by a prefix hit (``acquire``), which takes it out of the queue in O(1).
* **clean**: ``ref == 0`` and no hash; handed out first, lowest page id first, so fresh requests
  get consecutive pages that the mapper coalesces into one call.

Eviction is lazy: a cached page keeps its bytes and hash until ``allocate`` needs it, which drops
the hash then. The pool is mechanism only; the manager decides what to free and in what order.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

from .errors import OutOfPagesError, PageStateError


@dataclass
class PoolCounters:
    num_pages: int
    in_use: int
    cached: int
    clean: int
    evictions: int

    @property
    def free(self) -> int:
        return self.cached + self.clean


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise PageStateError(f"a pool needs at least one page, got num_pages={num_pages}")
        self.num_pages = num_pages
        self.ref = [0] * num_pages
        self.hash_of: list[bytes | None] = [None] * num_pages
        self.page_of_hash: dict[bytes, int] = {}
        self._clean = list(range(num_pages))  # a heap: lowest id first
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages, least recent first
        self.evictions = 0

    # --- counts ----------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages an allocation can take: clean plus cached (evictable)."""
        return len(self._clean) + len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_clean(self) -> int:
        return len(self._clean)

    @property
    def num_in_use(self) -> int:
        return self.num_pages - self.num_free

    def counters(self) -> PoolCounters:
        return PoolCounters(self.num_pages, self.num_in_use, self.num_cached, self.num_clean,
                            self.evictions)

    def free_queue(self) -> list[int]:
        """Cached pages in eviction order (next victim first)."""
        return list(self._lru)

    # --- allocation and references --------------------------------------------------------------
    def peek(self, n: int, exclude: Iterable[int] = ()) -> list[int]:
        """The pages ``allocate(n)`` would hand out, in order, changing nothing, so a caller can
        plan (map them, check every other limit) before taking them. Cached pages in ``exclude``
        are skipped: the caller acquires them before allocating."""
        if n == 1 and self._clean:
            return [self._clean[0]]
        # pop and push back: O(n log N), where nsmallest would scan the whole heap
        pages = [heapq.heappop(self._clean) for _ in range(min(n, len(self._clean)))]
        for page in pages:
            heapq.heappush(self._clean, page)
        if len(pages) < n:
            skip = set(exclude)
            victims = (page for page in self._lru if page not in skip)
            pages += itertools.islice(victims, n - len(pages))
        if len(pages) < n:
            raise OutOfPagesError(self._short_message(n))
        return pages

    def allocate(self, n: int) -> list[int]:
        """Hand out ``n`` pages with ``ref = 1``: clean pages first, then the least recently used
        cached pages, whose hashes are dropped. Raises with no side effect when ``n`` don't fit."""
        if n == 1 and self._clean:  # the decode hot path
            page = heapq.heappop(self._clean)
            self.ref[page] = 1
            return [page]
        if n > self.num_free:
            raise OutOfPagesError(self._short_message(n))
        pages = [heapq.heappop(self._clean) for _ in range(min(n, len(self._clean)))]
        while len(pages) < n:
            page, _ = self._lru.popitem(last=False)
            del self.page_of_hash[self.hash_of[page]]
            self.hash_of[page] = None
            self.evictions += 1
            pages.append(page)
        for page in pages:
            self.ref[page] = 1
        return pages

    def take(self, planned: list[int]) -> list[int]:
        """Allocate the pages an earlier ``peek`` planned; nothing may have changed the pool in
        between (a mismatch is a bug in the caller, and would map the wrong pages)."""
        if not planned:
            return []
        pages = self.allocate(len(planned))
        if pages != planned:
            raise PageStateError(f"planned pages {planned} but allocate gave {pages}: the pool "
                                 "changed between peek and take")
        return pages

    def _short_message(self, n: int) -> str:
        return (f"asked for {n} pages, {self.num_free} free ({self.num_clean} clean + "
                f"{self.num_cached} cached) of {self.num_pages}; free requests or enlarge the pool")

    def acquire(self, pages: Iterable[int]) -> None:
        """Take one more reference on each page (a prefix hit or a fork). A cached page leaves the
        free queue."""
        pages = list(pages)
        for page in pages:
            self._check_page(page)
            if self.ref[page] == 0 and self.hash_of[page] is None:
                raise PageStateError(f"page {page} is clean (free, no content); allocate it instead")
        for page in pages:
            if self.ref[page] == 0:
                del self._lru[page]
            self.ref[page] += 1

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference on each page, in the given order. A page reaching zero joins the
        tail of the LRU queue if hashed (so earlier-released pages are evicted first), else
        goes back to the clean pages. A release below zero raises before anything changes."""
        pages = list(pages)
        drops: dict[int, int] = {}
        for page in pages:
            self._check_page(page)
            drops[page] = drops.get(page, 0) + 1
            if drops[page] > self.ref[page]:
                raise PageStateError(
                    f"page {page} released {drops[page]} time(s) but holds {self.ref[page]} "
                    "reference(s): double free")
        for page in pages:
            self.ref[page] -= 1
            if self.ref[page] == 0:
                if self.hash_of[page] is None:
                    heapq.heappush(self._clean, page)
                else:
                    self._lru[page] = None

    def refcount(self, page: int) -> int:
        return self.ref[page]

    # --- prefix-cache index --------------------------------------------------------------------
    def lookup(self, content_hash: bytes) -> int | None:
        return self.page_of_hash.get(content_hash)

    def register(self, page: int, content_hash: bytes) -> bool:
        """Record that an in-use, full page holds content ``content_hash``. Returns False (and
        leaves the page unhashed) when another page already holds the same content."""
        self._check_page(page)
        if self.ref[page] == 0:
            raise PageStateError(f"page {page} is free; only an in-use page can be registered")
        if self.hash_of[page] is not None:
            if self.hash_of[page] != content_hash:
                raise PageStateError(f"page {page} already holds other hashed content")
            return True
        if content_hash in self.page_of_hash:
            return False
        self.hash_of[page] = content_hash
        self.page_of_hash[content_hash] = page
        return True

    def reset_cache(self) -> int:
        """Forget every cached page's content (they become clean). Returns how many were dropped.
        Hashes of in-use pages are dropped too, so no later request hits them."""
        dropped = len(self._lru)
        for page in self._lru:
            heapq.heappush(self._clean, page)
        self._lru.clear()
        self.page_of_hash.clear()
        self.hash_of = [None] * self.num_pages
        return dropped

    # --- invariants ----------------------------------------------------------------------------
    def check(self) -> None:
        """Assert the pool's invariants; raises AssertionError naming the first one broken."""
        clean, cached = set(self._clean), set(self._lru)
        assert len(clean) == len(self._clean), "a page is twice in the clean heap"
        assert not clean & cached, f"pages both clean and cached: {sorted(clean & cached)[:8]}"
        in_use = {p for p in range(self.num_pages) if self.ref[p] > 0}
        assert not in_use & (clean | cached), "a page with ref > 0 is in a free queue"
        assert len(in_use) + len(cached) + len(clean) == self.num_pages, (
            f"in use {len(in_use)} + cached {len(cached)} + clean {len(clean)} != {self.num_pages}")
        assert all(r >= 0 for r in self.ref), "negative reference count"
        assert all(self.hash_of[p] is None for p in clean), "a clean page has a hash"
        assert all(self.hash_of[p] is not None for p in cached), "a cached page has no hash"
        for h, p in self.page_of_hash.items():
            assert self.hash_of[p] == h, f"index says page {p} holds a hash it does not"
        hashed = sum(h is not None for h in self.hash_of)
        assert hashed == len(self.page_of_hash), "a hashed page is missing from the index"

    def _check_page(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise PageStateError(f"page {page} is outside the pool of {self.num_pages} pages")
