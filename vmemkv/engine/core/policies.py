"""Scheduling policies: in what order waiting requests are offered for admission, and whom a page
shortage preempts. ``POLICIES`` maps each ``--policy`` name to its class, once: the CLI's choices,
``EngineConfig``'s check and the A/B harness read it.

The scheduler (``scheduler.py``) calls, each step: ``order_waiting`` on the waiting queue;
``victim`` while a running sequence cannot grow; then, for each request ``admission_order``
yields, ``holds_back`` (skip it this step), ``admitted`` once it is in, and ``end_step`` after
the last. Admission stops at the first request that does not fit.

This module loads no torch (``vmemkv --help`` reads the registry): sequences are only used
through their attributes, and ``lpm``'s module is imported when the policy is built.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar

from vmemkv.errors import InvalidInputError

if TYPE_CHECKING:
    from vmemkv.engine.core.config import EngineConfig
    from vmemkv.engine.core.lpm import MatchPrefix
    from vmemkv.engine.core.sequence import Sequence


def _sort_key(seq: "Sequence") -> tuple:
    """``Sequence.sort_key`` (whose module loads torch): lower priority value, then arrival."""
    return seq.sort_key()


class PriorityNotSupportedError(InvalidInputError):
    """A request priority other than 0 under a policy other than ``priority`` (as vLLM refuses it)."""


class SchedulingPolicy:
    """What the scheduler asks a policy; the defaults are first come, first served."""

    name: ClassVar[str]
    # whether a request may set its priority: as in vLLM, only under the priority policy
    accepts_priority: ClassVar[bool] = False

    def __init__(self, config: "EngineConfig", tokens_per_page: int) -> None:
        self.config = config

    def check_priority(self, request_id: str, priority: int) -> None:
        """Refuse a priority this policy would ignore (as vLLM does), or one that is not an int."""
        if type(priority) is not int:
            raise InvalidInputError(f"request {request_id!r}: priority must be an int, got {priority!r}")
        if priority != 0 and not self.accepts_priority:
            raise PriorityNotSupportedError(
                f"request {request_id!r} has priority {priority}, but the scheduling policy is "
                f"{self.name!r}, which takes no priority from requests (only 0): start the "
                "engine with --policy priority (policy='priority') to set priorities")

    def order_waiting(self, waiting: list["Sequence"]) -> None:
        """Put the waiting queue in order at the start of a step (in place); FCFS keeps arrival
        order, preempted requests at its head."""

    def admission_order(self, waiting: list["Sequence"], running: list["Sequence"],
                        match_prefix: "MatchPrefix") -> Iterable["Sequence"]:
        """The waiting requests offered for admission this step, in order: the queue's head, until
        the scheduler stops taking it away. ``match_prefix``: the prefix cache's hits for a
        request (the scheduler's manager holds the cache; a policy holds no manager)."""
        return _head_of_queue(waiting)

    def holds_back(self, seq: "Sequence") -> bool:
        """Whether ``seq`` skips this step's admission though it may fit."""
        return False

    def admitted(self, seq: "Sequence", num_cached_tokens: int) -> None:
        """``seq`` was admitted, ``num_cached_tokens`` of its prompt from the prefix cache."""

    def end_step(self, admitted: list["Sequence"]) -> None:
        """This step's admissions are over; ``admitted`` in the order they were admitted."""

    def victim(self, running: list["Sequence"]) -> "Sequence":
        """Whom to preempt for room: the running queue is in ``Sequence.sort_key`` order, so the
        last is the lowest-priority (highest value), latest arrival."""
        return running[-1]


def _head_of_queue(waiting: list["Sequence"]) -> Iterator["Sequence"]:
    while waiting:
        yield waiting[0]


class FirstComeFirstServed(SchedulingPolicy):
    """``--policy fcfs``: waiting requests in arrival order."""

    name = "fcfs"


class PriorityFirst(SchedulingPolicy):
    """``--policy priority``: waiting requests by priority (lower value first), then arrival."""

    name = "priority"
    accepts_priority = True

    def order_waiting(self, waiting: list["Sequence"]) -> None:
        waiting.sort(key=_sort_key)


class LongestPrefixMatch(SchedulingPolicy):
    """``--policy lpm``: the longest cached prefix first within a priority, with a bound on how long
    a request is passed over and in-batch sharing of prefixes being computed (``lpm.py``)."""

    name = "lpm"

    def __init__(self, config: "EngineConfig", tokens_per_page: int) -> None:
        super().__init__(config, tokens_per_page)
        from vmemkv.engine.core.lpm import LongestPrefixFirst  # loads torch: not at import

        self.ranking = LongestPrefixFirst(tokens_per_page, config.lpm_window, config.lpm_max_passed_over)

    def order_waiting(self, waiting: list["Sequence"]) -> None:
        waiting.sort(key=_sort_key)  # the window is taken from the queue's head in this order

    def admission_order(self, waiting, running, match_prefix):
        return self.ranking.order(waiting, running, match_prefix)

    def holds_back(self, seq):
        return self.ranking.holds_back(seq)

    def admitted(self, seq, num_cached_tokens):
        self.ranking.admitted(seq, num_cached_tokens)

    def end_step(self, admitted):
        self.ranking.end_step(admitted)


POLICIES: dict[str, type[SchedulingPolicy]] = {
    policy.name: policy for policy in (FirstComeFirstServed, PriorityFirst, LongestPrefixMatch)}


def policy_names() -> str:
    """``"fcfs, priority or lpm"``: the registry's names, for messages."""
    *first, last = POLICIES
    return f"{', '.join(first)} or {last}"
