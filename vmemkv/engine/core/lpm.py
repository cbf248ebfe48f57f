"""``--policy lpm``: cache-aware admission order (SGLang's longest-prefix-match scheduling) with a
bound on how long a request can be passed over, and in-batch sharing of prefixes being computed.

Each step the scheduler offers waiting requests for admission in the order this module gives:

* **Window.** Only the first ``window`` waiting requests in queue order (priority, then arrival)
  are looked at (``EngineConfig.lpm_window``), so a step's cost is bounded by the window, not by
  the queue. Each is asked ``manager.match_prefix(kv)``: its block-hash chain is extended the
  first time and never recomputed, so after that a request costs one hash-table lookup per cached
  block (and one for the first miss) per step.
* **Order.** Priority first (a sequence's priority outranks the cache; users set one only under
  ``--policy priority``, ``policies.py``); then overdue requests
  (below) in arrival order; then the longest cached prefix; then arrival.
* **In-batch sharing.** A request whose next uncached block is being computed by a running
  request (a prefill under way, or one admitted earlier in the same step) is held back; once that
  block is committed it is a prefix hit, instead of being computed once per request.
* **The bound.** A request is *passed over* in a step when it is held back, or when it stays
  waiting while a request behind it in queue order is admitted. After ``max_passed_over`` such
  steps (``EngineConfig.lpm_max_passed_over``) it is overdue: it is never held back, it goes
  before every request of its priority that is not overdue, and, since admission stops at the
  first request that does not fit, no request behind it in queue order is admitted before it. So
  no request is passed over in more than ``max_passed_over`` steps, except by requests of higher
  priority. ``max_passed_over=0`` is FCFS (within priorities).
"""

from __future__ import annotations

from typing import Callable

from vmemkv.cache.request import KVRequest
from vmemkv.engine.core.sequence import Sequence, SequenceStatus

# the prefix cache's answer for a request: (the cached blocks its prompt hits, its block hashes)
MatchPrefix = Callable[[KVRequest], tuple[list, list[bytes]]]


class LongestPrefixFirst:
    """The admission order of ``--policy lpm``; the scheduler tells it who was admitted."""

    def __init__(self, tokens_per_page: int, window: int, max_passed_over: int):
        self.tokens_per_page = tokens_per_page
        self.window = window
        self.max_passed_over = max_passed_over
        self.passed_over: dict[Sequence, int] = {}  # steps each waiting request was passed over
        self._position: dict[Sequence, int] = {}  # this step's window: place in queue order
        self._cached_blocks: dict[Sequence, int] = {}
        self._next_hash: dict[Sequence, bytes | None] = {}  # its first uncached full block's
        self._in_flight: set[bytes] = set()  # hashes of blocks running requests are computing
        self._held: list[Sequence] = []
        self._prune_at = 2 * window

    def order(self, waiting: list[Sequence], running: list[Sequence], match_prefix: MatchPrefix) -> list[Sequence]:
        """The window of ``waiting`` (sorted by ``Sequence.sort_key``) in admission order, each
        asked ``match_prefix`` (the KV manager's, through the scheduler: the one holder)."""
        window = waiting[: self.window]
        self._position = {seq: index for index, seq in enumerate(window)}
        self._cached_blocks, self._next_hash, self._held = {}, {}, []
        for seq in window:  # only the hit count and the next hash are kept, not the chain
            hits, hashes = match_prefix(seq.kv)
            cached = self._cached_blocks[seq] = len(hits)
            self._next_hash[seq] = hashes[cached] if cached < len(hashes) else None
        self._in_flight = self._blocks_in_flight(running)
        return sorted(window, key=self._rank)

    def holds_back(self, seq: Sequence) -> bool:
        """Whether ``seq`` waits this step for a block another request is computing."""
        if self._is_overdue(seq):
            return False
        cached = self._cached_blocks[seq]
        usable = (len(seq.kv.token_ids) - 1) // self.tokens_per_page  # one token computed
        if cached < usable and self._next_hash[seq] in self._in_flight:
            self._held.append(seq)
            return True
        return False

    def admitted(self, seq: Sequence, num_cached_tokens: int) -> None:
        """``seq`` was admitted: the blocks it computes are in flight for the requests after it."""
        self.passed_over.pop(seq, None)
        self._in_flight.update(seq.kv.block_hashes[num_cached_tokens // self.tokens_per_page:])

    def end_step(self, admitted: list[Sequence]) -> None:
        """Count the step against every window request still waiting that was held back or that
        a request behind it in queue order overtook."""
        last = max((self._position[seq] for seq in admitted), default=-1)
        passed = {seq for seq, index in self._position.items() if index < last}
        passed.update(self._held)
        for seq in passed:
            if seq.status is SequenceStatus.WAITING:  # not admitted (a failed one is pruned later)
                self.passed_over[seq] = self.passed_over.get(seq, 0) + 1
        if len(self.passed_over) > self._prune_at:  # forget requests that left the queue
            self.passed_over = {seq: count for seq, count in self.passed_over.items()
                                if seq.status is SequenceStatus.WAITING}
            self._prune_at = 2 * max(self.window, len(self.passed_over))

    # --- helpers ---------------------------------------------------------------------------------
    def _is_overdue(self, seq: Sequence) -> bool:
        return self.passed_over.get(seq, 0) >= self.max_passed_over

    def _rank(self, seq: Sequence) -> tuple[int, int, int, int]:
        position = self._position[seq]
        if self._is_overdue(seq):
            return (seq.priority, 0, 0, position)
        return (seq.priority, 1, -self._cached_blocks[seq], position)

    def _blocks_in_flight(self, running: list[Sequence]) -> set[bytes]:
        """Hashes of the prompt blocks running requests have reserved but not yet computed."""
        tokens_per_page = self.tokens_per_page
        in_flight: set[bytes] = set()
        for seq in running:
            kv = seq.kv
            if kv.num_computed_tokens + 1 < len(kv.token_ids):  # a prefill under way
                in_flight.update(kv.block_hashes[kv.num_computed_tokens // tokens_per_page:])
        return in_flight
