"""The scheduler: who runs this step, with how many tokens, and who is preempted.

Continuous batching under a per-step token budget (prefill is chunked to fit it). Each step:
running sequences first, in priority order; when one cannot grow, the policy's victim (the
lowest-priority, latest sequence) is preempted (swap or recompute, as configured) until it can.
Then swapped sequences come back; then, only if none are left swapped, waiting sequences are
admitted while slots, the budget and a free-block watermark allow, in the order the scheduling
policy gives (``policies.py``): arrival (``fcfs``), priority then arrival (``priority``), or
longest cached prefix first with a bound on how long a request is passed over (``lpm``,
``lpm.py``). Then the step's KV plan is completed: a request whose prompt completes this step
gets its other ``n - 1`` sequences planned as forks (a slot each and a copy of the prompt's
partial last block, from what admission left and above the watermark; children without room
wait as new requests), and decoding sequences about to cross a block boundary get their next
block as lookahead (slots only), for the runner to map during the forward.

The plan (``SchedulerOutput``) is carried out by the runner (the forward, the lookahead mapping)
and the postprocessor (commit; sampling, the planned children from their parent's row); what
the step did comes back as one ``StepResult`` to ``update``, the only place the queues change
between two schedules (besides requests added and aborted). The next ``schedule`` first forks
the planned children from their parent, whose prompt is committed by then: every change of a
request's KV is made here, the runner's and postprocessor's only being the commit and the
mapping the plan names, through the plan's ``KVStep``. The KV cache manager does what it is told.

The scheduler is the one engine object holding the manager (as in vLLM v1 and nano-vllm): the
engine asks it for the cache's limits, usage and stats, and the elastic memory asks it for
give-backs (the methods at the end of ``Scheduler``); the addressing reads a read-only view of
the cache (``KVCacheManager.views``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from vmemkv.errors import MappingLimitError
from vmemkv.engine.core.kv_manager import KVManager
from vmemkv.engine.core.config import EngineConfig
from vmemkv.engine.core.policies import POLICIES
from vmemkv.engine.core.sequence import Sequence, SequenceStatus
from vmemkv.memory.slots import MapJob

if TYPE_CHECKING:
    from vmemkv.cache.config import CacheStats


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


@dataclass(slots=True)
class Fork:
    """A request's other sequences, which sample from ``parent``'s row at its prompt's last token and
    are forked from it at the next ``schedule`` (its prompt committed by then)."""
    parent: Sequence
    children: list[Sequence]


class KVStep:
    """What a plan lets the runner and the postprocessor do to the KV cache, and nothing more:
    map the lookahead blocks it gave (the runner, maybe on its mapping worker) and commit the
    positions it scheduled (the postprocessor)."""

    __slots__ = ("_manager",)

    def __init__(self, manager: KVManager):
        self._manager = manager

    def map_lookahead(self, jobs: list[MapJob]) -> None:
        self._manager.map_lookahead(jobs)

    def commit(self, scheduled: list[ScheduledSeq]) -> None:
        # every reserved position: exactly the scheduled ones, in one call (one call per
        # sequence costs more through the timing wrapper)
        self._manager.commit_all([item.seq.kv for item in scheduled])


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    failed: list[tuple[Sequence, str]]  # sequences that can never fit, with the reason
    forks: list[Fork] = field(default_factory=list)  # room counted: carried out after the commit
    lookahead: list[MapJob] = field(default_factory=list)  # blocks given, for the runner to map
    kv: KVStep | None = None  # carries out the lookahead mapping and the commit


@dataclass
class StepResult:
    """What a step did that the queues follow (``Scheduler.update``)."""
    finished: list[Sequence] = field(default_factory=list)  # out of the queues, blocks given back
    refused_lookahead: list[MapJob] = field(default_factory=list)  # mapping refused: blocks back


class Scheduler:
    """``new_fork(first, index)`` makes the request ``first``'s sequence ``index`` (for ``n > 1``);
    ``lookahead_tokens``: how far ahead decoding sequences get their next block (0: never)."""

    def __init__(self, config: EngineConfig, manager: KVManager,
                 new_fork: Callable[[Sequence, int], Sequence] | None = None,
                 lookahead_tokens: int = 0):
        self.config = config
        self.manager = manager  # the one engine part holding it
        self.kv_step = KVStep(manager)  # what every plan lets the runner and postprocessor do
        self.new_fork = new_fork
        self.lookahead_tokens = lookahead_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.num_preemptions = 0
        self._forks: list[Fork] = []  # planned last step: forked at the start of the next
        self.watermark_blocks = int(config.watermark * manager.num_blocks)
        self.policy = POLICIES[config.policy](config, manager.tokens_per_page)  # admission order, whom to preempt

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and give its blocks back (finish or abort)."""
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self.manager.discard(seq.kv)  # whatever it holds, even as a preempted request
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        self._fork_planned()
        out = SchedulerOutput([], [], kv=self.kv_step)
        budget = self.config.max_num_batched_tokens
        self.policy.order_waiting(self.waiting)
        self.running.sort(key=Sequence.sort_key)
        budget = self._schedule_running(budget, out)
        budget = self._schedule_swapped(budget, out)
        if not self.swapped:
            self._schedule_waiting(budget, out)
        fork_blocks = self._plan_forks(out)
        if self.lookahead_tokens:
            out.lookahead = self._plan_lookahead(out.scheduled, self.watermark_blocks + fork_blocks)
        self._forks = out.forks
        return out

    def update(self, result: StepResult) -> None:
        """Follow what the step did: the one place the queues change after ``schedule``."""
        if result.refused_lookahead:  # first: the requests' block lists still end with those blocks
            self.manager.cancel_lookahead(result.refused_lookahead)
        for seq in result.finished:
            self.remove(seq)

    # --- the three queues ------------------------------------------------------------------------
    def _schedule_running(self, budget: int, out: SchedulerOutput) -> int:
        scheduled = out.scheduled
        index, budget = self._grow_running(budget, scheduled)
        while index < len(self.running) and budget > 0:  # from the first that did not fit
            seq = self.running[index]
            kv = seq.kv
            count = self._chunk(kv, budget)
            while not self._allocate(seq, count):
                victim = self.policy.victim(self.running)
                problem = self._never_fits(seq, seq.num_computed + count) if victim is seq else None
                if problem is not None:
                    self.running.remove(seq)
                    self.manager.free(seq.kv)
                    out.failed.append((seq, problem))
                    break
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, count))
                budget -= count
                index += 1
        return budget

    def _grow_running(self, budget: int, scheduled: list[ScheduledSeq]) -> tuple[int, int]:
        """Schedule the running sequences in order, their positions reserved in one manager call
        (``allocate_each``), up to the first one that does not fit; returns (its index, the
        budget left). The caller's loop goes on from there, preempting for it: the same outcome
        as one ``allocate`` per sequence, which costs more (measured 2-3 % of a B = 32-64 decode
        step with commits)."""
        planned, growing, counts = [], [], []
        remaining = budget
        for seq in self.running:
            if remaining <= 0:
                break
            kv = seq.kv
            count = self._chunk(kv, remaining)
            reserved = kv.num_tokens - kv.num_computed_tokens  # a chunk reserved at admission
            if count > reserved:
                growing.append(kv)
                counts.append(count - reserved)
            planned.append((seq, count, count > reserved))
            remaining -= count
        granted = self.manager.allocate_each(growing, counts) if growing else 0
        for index, (seq, count, grows) in enumerate(planned):
            if grows:
                if granted == 0:
                    return index, budget  # refused: the loop preempts for it
                granted -= 1
            scheduled.append(ScheduledSeq(seq, count))
            budget -= count
        return len(planned), budget

    def _schedule_swapped(self, budget: int, out: SchedulerOutput) -> int:
        while self.swapped and budget > 0 and self.manager.num_free_slots:
            seq = self.swapped[0]
            if not self._mapped(self.manager.swap_in, seq.kv):
                break
            self.swapped.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            count = self._chunk(seq.kv, budget)
            if self._allocate(seq, count):
                out.scheduled.append(ScheduledSeq(seq, count))
                budget -= count
        return budget

    def _schedule_waiting(self, budget: int, out: SchedulerOutput) -> None:
        if not self.waiting or budget <= 0 or not self.manager.num_free_slots:
            return  # no one can be admitted (nor passed over)
        policy = self.policy
        admitted: list[Sequence] = []
        for seq in policy.admission_order(self.waiting, self.running, self.manager.match_prefix):
            if budget <= 0 or not self.manager.num_free_slots:
                break
            if policy.holds_back(seq):
                continue  # lpm: its next block is being computed: it will hit it instead
            # what it will hold at most: with a sliding window, blocks behind it are released
            needed = self.manager.blocks_for_tokens(len(seq.token_ids), self.config.max_num_batched_tokens)
            if self.running and self.manager.num_free_blocks - needed < self.watermark_blocks:
                break
            problem = self._never_fits(seq, len(seq.token_ids))
            if problem is not None:
                self.waiting.remove(seq)
                out.failed.append((seq, problem))
                continue
            try:
                # the KVRequest's hash chain survives refusals and preemption: never re-hashed
                cached = self.manager.admit(seq.kv, token_budget=budget)
            except MappingLimitError as error:
                if self.running or out.scheduled:
                    break  # mapping pressure: wait for running requests to leave
                self.waiting.remove(seq)  # alone and still refused: it can never be mapped
                out.failed.append((seq, str(error)))
                continue
            if cached is None:
                break
            self.waiting.remove(seq)
            seq.request.num_cached_tokens = max(seq.request.num_cached_tokens, cached)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            count = seq.kv.num_tokens - cached
            out.scheduled.append(ScheduledSeq(seq, count))
            budget -= count
            admitted.append(seq)
            policy.admitted(seq, cached)
        policy.end_step(admitted)

    # --- forks of n > 1 ------------------------------------------------------------------------------
    def _fork_planned(self) -> None:
        """Fork last step's planned children from their parent, whose prompt is committed now (a
        fork shares its committed blocks and copies the partial last one), each keeping the token
        it sampled from the parent's row. A child that finished on that token holds nothing; one
        whose parent has ended, or that the manager refuses (the mapping budget), waits as a new
        request (its prompt then hits the prefix cache)."""
        forks, self._forks = self._forks, []
        for fork in forks:
            for child in fork.children:
                if child.is_finished:
                    continue
                if fork.parent.status is SequenceStatus.RUNNING and self._fork(fork.parent, child):
                    child.status = SequenceStatus.RUNNING
                    self.running.append(child)
                else:
                    self.add(child)

    def _fork(self, parent: Sequence, child: Sequence) -> bool:
        tokens = child.kv.token_ids
        prompt = parent.num_prompt_tokens
        sampled = tokens[prompt:]
        try:
            if self.manager.fork(parent.kv, child.kv) is None:  # copies the parent's token ids
                return False
        except MappingLimitError:
            return False
        tokens[prompt:] = sampled  # the child's own token, not computed yet
        return True

    # --- the rest of the plan ---------------------------------------------------------------------
    def _plan_forks(self, out: SchedulerOutput) -> int:
        """At a request's first sample (the step computing its prompt's last token), plan its other
        ``n - 1`` sequences as forks of its first: each takes a slot and a copy of the
        prompt's partial last block, out of what admission left and above the watermark. Children
        without room wait as new requests (their prompt then hits the prefix cache). Returns the
        blocks the planned forks take."""
        slots = self.manager.num_free_slots
        spare = self.manager.num_free_blocks - self.watermark_blocks
        taken = 0
        for item in out.scheduled:
            seq = item.seq
            if seq.forks is not None or seq.parent is not None \
                    or seq.num_computed + item.num_new_tokens < len(seq.token_ids):
                continue
            children = seq.forks = [self.new_fork(seq, index) for index in range(1, seq.params.n)]
            blocks_each = int(len(seq.token_ids) % self.manager.tokens_per_page != 0)
            room = spare // blocks_each if blocks_each else len(children)
            fit = max(min(len(children), slots, room), 0)
            if fit:
                out.forks.append(Fork(seq, children[:fit]))
            for child in children[fit:]:
                self.add(child)
            slots, spare, taken = slots - fit, spare - fit * blocks_each, taken + fit * blocks_each
        return taken

    def _plan_lookahead(self, scheduled: list[ScheduledSeq], keep_free: int) -> list[MapJob]:
        """Give decoding sequences about to cross a block boundary their next block now, while
        ``keep_free`` blocks stay free; the runner maps them during the forward (they lie past
        every reservation, which the forward never reads)."""
        # Only a sequence whose next `margin` positions reach a block past its reservation can
        # get one (the manager skips the others): ask about those alone.
        margin, size = self.lookahead_tokens, self.manager.tokens_per_page
        decoding = []
        for item in scheduled:
            seq = item.seq
            kv = seq.kv
            reserved = kv.num_tokens
            # blocks_for_tokens(reserved + margin) > blocks_for_tokens(reserved), inlined and
            # asked first (true for about one sequence in tokens_per_block / margin): this loop
            # runs over every running sequence each step
            if (-(-(reserved + margin) // size) > -(-reserved // size)
                    and kv.num_computed_tokens >= seq.num_prompt_tokens):
                decoding.append(kv)
        return self.manager.allocate_lookahead(decoding, margin, keep_free) if decoding else []

    # --- mechanics -------------------------------------------------------------------------------
    def _chunk(self, kv, budget: int) -> int:
        """The tokens a sequence computes this step: its uncomputed ones within ``budget``, the
        chunk ending where a recurrent state is saved (the manager's ``aligned_chunk_end``)."""
        computed, num_tokens = kv.num_computed_tokens, len(kv.token_ids)
        end = min(num_tokens, computed + budget)
        if end - computed <= 1:  # a decode step: nothing to cut (and no call per sequence)
            return end - computed
        return self.manager.aligned_chunk_end(computed, end, num_tokens) - computed

    def _allocate(self, seq: Sequence, count: int) -> bool:
        """Reserve positions for ``count`` more tokens (their ids are in the KVRequest's list)."""
        kv = seq.kv
        reserved = kv.num_tokens - kv.num_computed_tokens
        if reserved >= count:  # a chunk reserved at admission
            return True
        return self._mapped(self.manager.allocate, kv, count - reserved)

    @staticmethod
    def _mapped(call, *args) -> bool:
        """A manager call whose refusal by the OS mapping budget (nothing changed) counts as
        memory pressure, like a short pool: preempting someone frees mappings to reclaim."""
        try:
            return call(*args)
        except MappingLimitError:
            return False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        mode = self.config.preemption_mode
        if mode == "swap" and not self.manager.estimate_preemption(seq.kv).swap_fits:
            mode = "recompute"
        used = self.manager.preempt(seq.kv, mode)  # recompute: the KVRequest keeps its hashes
        self.num_preemptions += 1
        if used == "swap":
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
        else:
            seq.status = SequenceStatus.WAITING
            self.waiting.insert(0, seq)

    def _never_fits(self, seq: Sequence, num_tokens: int) -> str | None:
        """Why ``seq`` holding ``num_tokens`` tokens can never run, even alone; None if it can."""
        problem = self.why_never_fits(num_tokens)
        return None if problem is None else f"request {seq.request_id!r}: {problem}"

    # --- the KV cache as the engine asks about it (no one else holds the manager) -------------------
    def why_never_fits(self, num_tokens: int) -> str | None:
        """Why a request of ``num_tokens`` tokens, computed in chunks of the step's token
        budget, can never run, even alone (which limit, what to change); None if it can."""
        return self.manager.why_never_fits(num_tokens, self.config.max_num_batched_tokens)

    def kv_usage(self) -> float:
        """Fraction of KV blocks held by requests (of the fullest pool)."""
        return self.manager.usage()

    def kv_in_use(self) -> tuple[int, int]:
        """(KV blocks held by requests in the first group's pool, bytes held in every pool)."""
        return self.manager.num_blocks_in_use, self.manager.kv_bytes_in_use

    def kv_fragmentation(self) -> tuple[int, int]:
        """(Bytes of the blocks in use beyond the bytes the running sequences' tokens fill, those
        bytes): ``KVCacheManager.fragmentation`` over the running sequences."""
        return self.manager.fragmentation([seq.kv for seq in self.running])

    def cache_stats(self) -> "CacheStats":
        return self.manager.cache_stats()

    def kv_stats(self) -> dict:
        """The manager's counters, pool and mapping counts (``snapshot_stats``)."""
        return self.manager.snapshot_stats()

    def release_free_memory(self, cached: bool = False) -> int:
        """Give the free KV blocks' memory back (``cached``: cached ones too); returns the bytes."""
        return self.manager.release_free_memory(cached=cached)

    def reset_prefix_cache(self) -> int:
        return self.manager.reset_prefix_cache()

    def close(self) -> None:
        """Close the KV cache manager (the engine's close, after the runner's)."""
        self.manager.close()
