"""The cold tier under a random walk: exact and tolerant requests with shared prefixes through a
device pool too small for them (blocks keep going cold, to the host tier and back), with decodes,
forks, frees, swap out and in and resets. After every step: no block or host row leaks
(``check``); no exact request holds a lossy block, and its K/V reads back bit-exact; a tolerant
request's reads back within the codec's bound (so a decompressed block landed where it belongs,
and swap and fork copied it whole); and a refused admission, growth or fork changed nothing, the
tiers included."""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from conftest import close_manager, manager_state, tiny_config
from test_cold_tier import BLOCK_BYTES, SHAPE, kv_error, write
from vmemkv import InvalidInputError, KVCacheManager, KVEventBuffer, KVRequest
from vmemkv.cache.block_codec import BlockCodec
from vmemkv import AllBlocksCleared
from vmemkv.cache.events import exact_key, is_lossy_key
from test_host_tier_walk import apply_event

PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 9, 9, 9, 9]]
INT8_BOUND = 4 / 254 + 1e-6  # half a step of int8 over values of magnitude <= 4


class ColdTierMachine(RuleBasedStateMachine):
    host_blocks = 0
    cold_format, bound, quantized = "int8", INT8_BOUND, {}

    def __init__(self):
        super().__init__()
        # (a quantized block's codec keeps as many values: the same compressed bytes)
        codec = BlockCodec(self.cold_format, SHAPE["dtype"], BLOCK_BYTES, 64, 256)
        config = tiny_config(**{**SHAPE, "num_blocks": 6, "max_model_len": 24, "max_num_seqs": 3,
                                "cold_tier": self.cold_format, "cold_cache_bytes": 8 * codec.compressed_bytes,
                                "host_cache_bytes": self.host_blocks * BLOCK_BYTES,
                                "swap_space_bytes": 3 * BLOCK_BYTES, **self.quantized})
        self.events = KVEventBuffer()
        self.m = KVCacheManager(config, events=self.events)
        self.media: dict[str, set[bytes]] = {}  # each medium's hashes, rebuilt from the events
        self.requests: dict[str, KVRequest] = {}
        self.swapped: set[str] = set()
        self.count = 0
        self.refused_copies = 0

    def teardown(self):
        stats = self.m.cache_stats()
        event(f"cold promotions: {min(stats.cold_promotions, 3)}+ ; lossy copies refused: {self.refused_copies > 0}")
        close_manager(self.m)

    def _state(self) -> tuple:
        return manager_state(self.m), self.m.cold_tier.hashes(), self.m.host_tier.hashes()

    def _name(self) -> str:
        self.count += 1
        return f"r{self.count}"

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(10, 40), min_size=1, max_size=9),
          exact=st.booleans())
    def admit(self, prefix, tail, exact):
        request = KVRequest(self._name(), prefix + tail, exact=exact)
        before = self._state()
        cached = self.m.admit(request)
        if cached is None:
            assert self._state() == before
            return
        self.requests[request.request_id] = request
        write(self.m, request.request_id, cached, self.m.num_tokens(request))
        self.m.commit(request)

    @initialize()
    def prefixes_gone_cold(self):
        """Every shared prefix computed, then pushed out of the device pool by other traffic."""
        for prefix in PREFIXES[1:]:
            self.traffic(prefix, [10], False)
        self.traffic([], list(range(41, 64)), False)  # six blocks: the whole pool
        assert len(self.m.cold_tier) + len(self.m.host_tier) >= 4

    @rule(prefix=st.sampled_from(PREFIXES[1:]), tail=st.lists(st.integers(10, 40), min_size=1, max_size=9),
          exact=st.booleans())
    def traffic(self, prefix, tail, exact):
        """A request that runs and finishes between two steps: its blocks stay cached, and push
        older cached blocks down to the host and cold tiers."""
        request = KVRequest(self._name(), prefix + tail, exact=exact)
        cached = self.m.admit(request)
        if cached is None:
            return
        write(self.m, request.request_id, cached, self.m.num_tokens(request))
        self.m.commit(request)
        error = kv_error(self.m, request.request_id)
        assert error == 0 if exact else error <= self.bound
        self.m.free(request)

    @precondition(lambda self: self.growable())
    @rule(data=st.data())
    def decode(self, data):
        name = data.draw(st.sampled_from(self.growable()))
        request = self.requests[name]
        before = self._state()
        if not self.m.allocate(request, 1, [data.draw(st.integers(10, 40))]):
            assert self._state() == before
            return
        write(self.m, name, self.m.num_computed_tokens(request), self.m.num_tokens(request))
        self.m.commit(request)

    @precondition(lambda self: self.running())
    @rule(data=st.data(), exact=st.booleans())
    def fork(self, data, exact):
        parent = self.requests[data.draw(st.sampled_from(self.running()))]
        child = KVRequest(self._name(), [], exact=exact)
        before = self._state()
        try:
            forked = self.m.fork(parent, child)
        except InvalidInputError:
            assert exact and parent.allocation.lossy_from is not None
            self.refused_copies += 1
            assert self._state() == before
            return
        if forked is None:
            assert self._state() == before
            return
        self.requests[child.request_id] = child

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free(self, data):
        name = data.draw(st.sampled_from(sorted(self.requests)))
        self.m.free(self.requests.pop(name))
        self.swapped.discard(name)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def swap_out_or_in(self, data):
        name = data.draw(st.sampled_from(sorted(self.requests)))
        request = self.requests[name]
        if name in self.swapped:
            if self.m.swap_in(request):
                self.swapped.discard(name)
        elif self.m.estimate_preemption(request).swap_fits:
            self.m.preempt(request, "swap")
            self.swapped.add(name)

    @precondition(lambda self: not self.requests)
    @rule()
    def reset(self):
        self.m.reset_prefix_cache()
        assert not self.m.cold_tier.hashes()

    def running(self) -> list[str]:
        return sorted(name for name in self.requests if name not in self.swapped)

    def growable(self) -> list[str]:
        limit = self.m.config.max_model_len
        return [name for name in self.running() if self.m.num_tokens(self.requests[name]) < limit]

    @invariant()
    def holds(self):
        self.m.check()
        pool = self.m.pool
        for name in self.running():
            request = self.requests[name]
            if request.exact:
                assert not any(is_lossy_key(pool.hash_of[b]) for b in self.m.block_table(request)), name
                assert request.allocation.lossy_from is None
                assert kv_error(self.m, name) == 0, name
            else:
                assert kv_error(self.m, name) <= self.bound, name

    @invariant()
    def events_rebuild_each_tier(self):
        """Replaying each medium rebuilds its tier: GPU the device's exact hashes, GPU_LOSSY its
        lossy ones, CPU the host tier's, CPU_LOSSY the cold tier's."""
        batch = self.events.drain()
        for event in batch.events if batch else ():
            if isinstance(event, AllBlocksCleared):
                self.media.clear()
                continue
            apply_event(self.media.setdefault(event.medium, set()), event)
        device = set(self.m.pool.block_of_hash)
        assert self.media.get("GPU", set()) == {k for k in device if not is_lossy_key(k)}
        assert self.media.get("GPU_LOSSY", set()) == {exact_key(k) for k in device if is_lossy_key(k)}
        assert self.media.get("CPU", set()) == set(self.m.host_tier.hashes())
        assert self.media.get("CPU_LOSSY", set()) == set(self.m.cold_tier.hashes())


class ColdBelowHostMachine(ColdTierMachine):
    host_blocks = 2  # the full host tier spills to the cold tier


class ColdOverInt8Machine(ColdTierMachine):
    """int8 live KV (rows and scales in the pages) under an int4 cold tier: a tolerant request's
    rows within int4's half step of what was written plus int8's twice (the live rows quantized
    again after decompressing, against the exact rows' own rounding)."""
    cold_format, bound = "int4", 4 / 14 + 2 * 4 / 254 + 1e-6
    quantized = {"kv_cache_dtype": "int8", "max_padding": 3.0}  # padded rows: pages of 4 tokens as above


SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestColdTierWalk = ColdTierMachine.TestCase
TestColdTierWalk.settings = SETTINGS
TestColdBelowHostWalk = ColdBelowHostMachine.TestCase
TestColdBelowHostWalk.settings = SETTINGS
TestColdOverInt8Walk = ColdOverInt8Machine.TestCase
TestColdOverInt8Walk.settings = SETTINGS
