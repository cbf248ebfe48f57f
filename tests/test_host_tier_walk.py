"""The prefix cache's host tier under a random walk: requests with shared prefixes and three
tenants through a device pool too small for them (so blocks keep moving to the host tier and
back), with decodes, frees, swap out and in, other traffic and resets. After every step every
running request reads back its own K/V (conftest's patterns: a function of the token prefix and
the tenant, so a promoted block that lost a byte or crossed tenants reads wrong), no device block
or host row leaks (``check``), and the events of each medium rebuild that tier's hashes."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conftest import close_manager, read_kv_matches, tiny_config, write_kv
from test_host_tier import BLOCK_BYTES, FP32, TENANTS, TOKENS_PER_PAGE
from vmemkv import AllBlocksCleared, BlockStored, CacheKeys, KVCacheManager, KVEventBuffer
from vmemkv.cache.events import MEDIUM_DEVICE

PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 9, 9]]


def swap_out_or_in(manager, request, name: str, swapped: set[str]) -> None:
    """Swap ``request`` (``name`` in ``swapped`` while it is out) back in, or out when the host
    store has its rows."""
    if name in swapped:
        if manager.swap_in(request):
            swapped.discard(name)
    elif manager.estimate_preemption(request).swap_fits:
        manager.preempt(request, "swap")
        swapped.add(name)


def apply_event(index: set[bytes], event) -> None:
    """A ``BlockStored`` or ``BlockRemoved`` applied to the hashes rebuilt for its tier."""
    if isinstance(event, BlockStored):
        assert not index & set(event.block_hashes), "stored twice without a removal"
        index.update(event.block_hashes)
    else:
        assert set(event.block_hashes) <= index, "removed a hash never stored"
        index.difference_update(event.block_hashes)


class HostTierMachine(RuleBasedStateMachine):
    """Requests with shared prefixes and three tenants through a device pool too small for them,
    so blocks keep moving to the host tier and back."""

    window: int | None = None  # CacheConfig.sliding_window

    def __init__(self):
        super().__init__()
        config = tiny_config(**{**FP32, "num_blocks": 6, "max_model_len": 24, "max_num_seqs": 2,
                                "host_cache_bytes": 16 * BLOCK_BYTES,
                                "swap_space_bytes": 3 * BLOCK_BYTES, "sliding_window": self.window})
        self.events = KVEventBuffer()
        self.m = KVCacheManager(config, events=self.events)
        self.device_index: set[bytes] = set()
        self.host_index: set[bytes] = set()
        self.salts: dict[str, str | None] = {}  # admitted request -> its tenant
        self.swapped: set[str] = set()
        self.next_id = 0
        self.history: list[tuple[tuple[int, ...], str | None]] = []  # prompts admitted

    def reads_back(self, request_id: str) -> bool:
        """Its K/V reads back bit for bit (with a window: from the next query's window start;
        blocks wholly before it may be released, unmapped)."""
        start = 0
        if self.window:
            start = max(0, self.m.num_computed_tokens(request_id) - self.window + 1)
        return read_kv_matches(self.m, request_id, TENANTS[self.salts[request_id]], start)

    def running(self) -> list[str]:
        return sorted(r for r in self.salts if r not in self.swapped)

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 3), min_size=1, max_size=6),
          salt=st.sampled_from(list(TENANTS)))
    def admit(self, prefix, suffix, salt):
        self.start(prefix + suffix, salt)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), traffic_blocks=st.integers(0, 6))
    def admit_again(self, data, traffic_blocks):
        """A prompt seen before (a chat's next turn re-sends it), after other traffic that may
        have pushed its blocks to the host tier."""
        tokens, salt = data.draw(st.sampled_from(self.history))
        if traffic_blocks:
            self.other_traffic(traffic_blocks)
        self.start(list(tokens), salt)

    def finish_oldest_without_a_free_slot(self):
        """As a server does, requests finish: the oldest makes room when no slot is free."""
        if not self.m.num_free_slots and self.salts:
            self.finish(next(iter(self.salts)))

    def finish(self, request_id):
        self.m.free(request_id)
        del self.salts[request_id]
        self.swapped.discard(request_id)

    def start(self, tokens, salt):
        self.finish_oldest_without_a_free_slot()
        self.next_id += 1
        request_id = f"r{self.next_id}"
        cached = self.m.admit(request_id, tokens, keys=CacheKeys(cache_salt=salt))
        if cached is None:
            return
        self.history.append((tuple(tokens), salt))
        self.salts[request_id] = salt
        assert self.reads_back(request_id)  # the hits, bit for bit
        write_kv(self.m, request_id, cached, len(tokens), TENANTS[salt])
        self.m.commit(request_id)

    @rule(num_blocks=st.integers(1, 6))
    def other_traffic(self, num_blocks):
        """A one-off request of fresh tokens, computed and freed: it pushes cached blocks out."""
        self.finish_oldest_without_a_free_slot()
        self.next_id += 1
        request_id = f"r{self.next_id}"
        tokens = [100 + self.next_id] * (num_blocks * TOKENS_PER_PAGE)
        if self.m.admit(request_id, tokens) is not None:
            write_kv(self.m, request_id, 0, len(tokens))
            self.m.commit(request_id)
            self.m.free(request_id)

    @precondition(lambda self: self.running())
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        request_id = data.draw(st.sampled_from(self.running()))
        length = self.m.num_tokens(request_id)
        if length < 24 and self.m.allocate(request_id, 1, [token]):
            write_kv(self.m, request_id, length, length + 1, TENANTS[self.salts[request_id]])
            self.m.commit(request_id)

    @precondition(lambda self: self.salts)
    @rule(data=st.data())
    def free(self, data):
        self.finish(data.draw(st.sampled_from(sorted(self.salts))))

    @precondition(lambda self: self.salts)
    @rule(data=st.data())
    def swap_out_or_in(self, data):
        """Swap a running request out (when the host store has its rows), or a swapped one in."""
        request_id = data.draw(st.sampled_from(sorted(self.salts)))
        swap_out_or_in(self.m, request_id, request_id, self.swapped)

    @precondition(lambda self: self.m.num_blocks_in_use == 0)
    @rule()
    def reset_both_tiers(self):
        self.m.reset_prefix_cache()
        assert len(self.m.host_tier) == 0 and not self.m.pool.num_cached

    @invariant()
    def every_request_reads_its_own_kv_and_nothing_leaks(self):
        for request_id in self.running():
            assert self.reads_back(request_id)
        self.m.check()  # device blocks and host rows (swapped + tier + free = total)

    @invariant()
    def events_rebuild_each_tier(self):
        batch = self.events.drain()
        for event in batch.events if batch else ():
            if isinstance(event, AllBlocksCleared):
                self.device_index.clear()
                self.host_index.clear()
                continue
            apply_event(self.device_index if event.medium == MEDIUM_DEVICE else self.host_index, event)
        assert self.device_index == set(self.m.pool.block_of_hash)
        assert self.host_index == set(self.m.host_tier.hashes())

    def teardown(self):
        close_manager(self.m)


test_host_tier_random_walk = pytest.mark.filterwarnings("ignore")(HostTierMachine.TestCase)
HostTierMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                             suppress_health_check=[HealthCheck.too_slow])


class WindowedHostTierMachine(HostTierMachine):
    """The same walk for a sliding-window model: blocks behind each request's window go back to
    the pool while it runs (and may be demoted to the host tier from there), windowed prefix hits
    map only the window's blocks."""

    window = 6


test_host_tier_random_walk_with_a_sliding_window = pytest.mark.filterwarnings("ignore")(
    WindowedHostTierMachine.TestCase)
WindowedHostTierMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
