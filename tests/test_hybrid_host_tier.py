"""The prefix cache's host tier on a hybrid model: each layer group demotes its evicted blocks to
its own ``HostTier`` over its own host block store (the host bytes split by layers, so both hold
as many blocks), and an admission promotes a host hit only as far as both groups can. Specs (a
prefix evicted from both groups is promoted in both, bytes exact; a hit one group's tier lacks is
promoted in neither; a refused admission leaves both tiers), the host-tier random walk on the two
groups (every request reads back its own K/V, nothing leaks, each (group, tier)'s events rebuild
its hashes), and the engine against Hugging Face's tokens on both KV backends."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conftest import groups_read_back, write_groups
from test_host_tier_walk import apply_event, swap_out_or_in
from test_hybrid_groups import BACKENDS, P, W, close, make_hybrid
from vmemkv import KVCacheManager
from vmemkv import AllBlocksCleared, CacheKeys, KVEventBuffer, KVRequest
from vmemkv.cache.events import MEDIUM_DEVICE
from vmemkv.cache.window import first_needed_block

GROUP_BLOCK_BYTES = 16 * 4 * 2 * 2 * 16 * 4  # P tokens x 4 layers x K/V x 2 heads x 16 dim x fp32
TENANTS = {None: 0, "tenant-a": 1, "tenant-b": 2}  # cache salt -> K/V pattern salt


def make_tiered(host_blocks: int = 16, **overrides):
    """A hybrid manager whose two host tiers each hold ``host_blocks`` blocks."""
    return make_hybrid(host_cache_bytes=host_blocks * GROUP_BLOCK_BYTES, **overrides)


def promotions(manager: KVCacheManager) -> list[int]:
    """Each group's host promotions so far. The counters are the manager's, shared by both
    groups; a global block (one layer's rows) and a local one (three layers') differ in bytes, so
    the count and the bytes of all promotions give each group's count."""
    stats = manager.cache_stats()
    global_bytes, local_bytes = (group.block_bytes for group in manager.layout_groups)
    assert global_bytes != local_bytes
    local, rest = divmod(stats.host_bytes_promoted - stats.host_promotions * global_bytes,
                         local_bytes - global_bytes)
    assert rest == 0 and 0 <= local <= stats.host_promotions
    return [stats.host_promotions - local, local]


def device_forgot(manager, prompt: list[int]) -> bool:
    """The global group's pool has no block of ``prompt``'s prefix cached."""
    hashes = manager.match_prefix(prompt)[1]
    return not manager.layout_groups[0].cached_blocks(hashes)


def start(manager, request_id: str, tokens: list[int], salt: str | None = None) -> KVRequest | None:
    """Admit, check the hit reads back, write the rest (salted by tenant), commit."""
    req = KVRequest(request_id, list(tokens), CacheKeys(cache_salt=salt))
    cached = manager.admit(req)
    if cached is None:
        return None
    assert reads_back(manager, req, salt, cached)
    write_groups(manager, req.request_id, cached, len(tokens), TENANTS[salt])
    manager.commit(req)
    return req


def reads_back(manager, req: KVRequest, salt: str | None, upto: int | None = None) -> bool:
    """Both groups' computed positions read back their own (tenant's) pattern; the local one
    from the first block it holds."""
    return groups_read_back(manager, req.request_id, TENANTS[salt])


def traffic(manager, name: str, num_blocks: int) -> None:
    """Fresh tokens computed and freed: they push cached blocks out of both device pools."""
    req = start(manager, name, [1000 + sum(map(ord, name))] * (num_blocks * P))
    if req is not None:
        manager.free(req)


def evicted_prefix(manager) -> list[int]:
    """A prompt of three full blocks and a partial one, computed, freed, then pushed out of both
    device pools by other traffic (into the host tiers)."""
    prompt = list(range(3 * P + 5))
    manager.free(start(manager, "a", prompt))
    traffic(manager, "x", 8)
    assert device_forgot(manager, prompt)
    return prompt


def tiers(manager) -> tuple:
    return tuple(group.host_tier.hashes() for group in manager.layout_groups)


@pytest.mark.parametrize("kv_backend", BACKENDS)
def test_a_prefix_evicted_from_both_groups_is_promoted_in_both(kv_backend):
    manager = make_tiered(num_blocks=8, kv_backend=kv_backend)
    try:
        prompt = evicted_prefix(manager)
        assert all(len(hashes) >= 3 for hashes in tiers(manager))
        again = start(manager, "b", prompt + [9])
        assert again.num_computed_tokens == len(prompt) + 1
        behind = first_needed_block(3 * P, W, P)  # the local query at 3P reads from this block on
        assert promotions(manager) == [3, 3 - behind]
        assert manager.cache_stats().prefix_hit_tokens_host == 3 * P
        assert reads_back(manager, again, None)
        manager.check()
    finally:
        close(manager)


@pytest.mark.parametrize("kv_backend", BACKENDS)
def test_the_local_group_promotes_only_the_blocks_its_window_reads(kv_backend):
    """A host hit far longer than the window: the global group copies every block back, the local
    group only those its next query's window reads (the rest would be released at the first
    commit); the ones it skips stay in its host tier, and both groups read back their K/V."""
    manager = make_tiered(num_blocks=16, kv_backend=kv_backend)
    try:
        prompt = list(range(6 * P + 5))
        manager.free(start(manager, "a", prompt))
        traffic(manager, "x", 12)
        traffic(manager, "y", 12)
        assert device_forgot(manager, prompt)
        local_group = manager.layout_groups[1]
        local_tier = set(local_group.host_tier.hashes())
        again = start(manager, "b", prompt + [9])
        assert manager.num_computed_tokens("b") == len(prompt) + 1
        behind = first_needed_block(6 * P, W, P)
        assert behind >= 3  # the window reads the last blocks of the hit only
        assert promotions(manager) == [6, 6 - behind]
        skipped = set(again.block_hashes[:behind]) & local_tier  # host hits behind the window
        assert skipped and all(local_group.pool.lookup(h) is None for h in skipped)  # not copied
        assert again.group_released_blocks(1) >= behind
        assert manager.cache_stats().prefix_hit_tokens_host == 6 * P
        assert reads_back(manager, again, None)
        manager.check()
    finally:
        close(manager)


@pytest.fixture
def tiered():
    manager = make_tiered(num_blocks=8)
    yield manager
    manager.check()
    close(manager)


def test_a_host_hit_one_groups_tier_lacks_is_promoted_in_neither(tiered):
    prompt = evicted_prefix(tiered)
    global_group, local_group = tiered.layout_groups
    held = global_group.host_tier.hashes()
    local_group.host_tier.clear()  # as if the local tier had dropped them
    req = KVRequest("b", prompt + [9])
    assert tiered.admit(req) == 0  # nothing both groups hold: computed again
    assert set(held) <= set(global_group.host_tier.hashes())  # none claimed or promoted
    assert promotions(tiered) == [0, 0]
    tiered.free(req)


def test_a_refused_admission_leaves_both_tiers_as_they_were(tiered):
    prompt = evicted_prefix(tiered)
    running = start(tiered, "busy", list(range(500, 500 + 6 * P)))  # 6 of 8 global blocks
    groups = tiered.layout_groups
    before = tiers(tiered), [group.pool.counters() for group in groups]
    assert tiered.admit(KVRequest("b", prompt + [9])) is None  # 4 blocks, 2 free
    assert (tiers(tiered), [group.pool.counters() for group in groups]) == before
    tiered.free(running)


# --- the host-tier walk on two groups ---------------------------------------------------------------

PREFIXES = [[], list(range(1, 1 + P)), list(range(1, 1 + 2 * P)), [9] * (P + 6)]


class HybridHostTierMachine(RuleBasedStateMachine):
    """Requests with shared prefixes and three tenants through two device pools too small for
    them, so blocks keep moving to both groups' host tiers and back."""

    def __init__(self):
        super().__init__()
        self.events = KVEventBuffer()
        self.m = make_tiered(host_blocks=10, num_blocks=6, max_num_seqs=2, max_model_len=96,
                             swap_space_bytes=3 * GROUP_BLOCK_BYTES, events=self.events)
        self.index: dict[tuple[int, str], set[bytes]] = {}  # (group, medium) -> hashes
        self.running: dict[str, tuple[KVRequest, str | None]] = {}
        self.swapped: set[str] = set()
        self.history: list[tuple[tuple[int, ...], str | None]] = []
        self.next_id = 0

    def begin(self, tokens, salt):
        if not self.m.num_free_slots and self.running:  # the oldest finishes to make room
            self.finish(next(iter(self.running)))
        self.next_id += 1
        req = start(self.m, f"r{self.next_id}", tokens, salt)
        if req is not None:
            self.running[req.request_id] = (req, salt)
            self.history.append((tuple(tokens), salt))

    def finish(self, request_id):
        self.m.free(self.running.pop(request_id)[0])
        self.swapped.discard(request_id)

    @rule(data=st.data(), again=st.booleans(), traffic_blocks=st.integers(0, 5))
    def admit(self, data, again, traffic_blocks):
        """A new prompt, or (``again``) one seen before, after other traffic that may have pushed
        its blocks to the host tiers (a chat's next turn re-sends the conversation)."""
        if again and self.history:
            tokens, salt = data.draw(st.sampled_from(self.history))
            if traffic_blocks:
                self.other_traffic(traffic_blocks)
        else:
            tokens = data.draw(st.sampled_from(PREFIXES)) + data.draw(
                st.lists(st.integers(0, 3), min_size=1, max_size=20))
            salt = data.draw(st.sampled_from(list(TENANTS)))
        self.begin(list(tokens), salt)

    @rule(num_blocks=st.integers(1, 5))
    def other_traffic(self, num_blocks):
        if not self.m.num_free_slots and self.running:
            self.finish(next(iter(self.running)))
        self.next_id += 1
        traffic(self.m, f"t{self.next_id}", num_blocks)

    @precondition(lambda self: set(self.running) - self.swapped)
    @rule(data=st.data(), steps=st.integers(1, 20))
    def decode(self, data, steps):
        request_id = data.draw(st.sampled_from(sorted(set(self.running) - self.swapped)))
        req, salt = self.running[request_id]
        for step in range(steps):
            if req.num_tokens >= 96:
                break
            req.token_ids.append(step % 4)
            if not self.m.allocate(req, 1):
                req.token_ids.pop()
                break
            write_groups(self.m, request_id, req.num_tokens - 1, req.num_tokens, TENANTS[salt])
            self.m.commit(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), action=st.sampled_from(["free", "swap"]))
    def free_or_swap(self, data, action):
        """Free a request, or swap it out (when both host stores have its rows) or back in."""
        request_id = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running[request_id][0]
        if action == "free":
            self.finish(request_id)
        else:
            swap_out_or_in(self.m, req, request_id, self.swapped)

    @invariant()
    def every_request_reads_its_own_kv_and_nothing_leaks(self):
        for request_id, (req, salt) in self.running.items():
            if request_id not in self.swapped:
                assert reads_back(self.m, req, salt)
        self.m.check()

    @invariant()
    def events_rebuild_each_groups_tiers(self):
        batch = self.events.drain()
        for event in batch.events if batch else ():
            assert not isinstance(event, AllBlocksCleared)
            apply_event(self.index.setdefault((event.group_idx, event.medium), set()), event)
        for group_idx, group in enumerate(self.m.layout_groups):
            assert self.index.get((group_idx, MEDIUM_DEVICE), set()) == set(group.pool.block_of_hash)
            assert self.index.get((group_idx, "CPU"), set()) == set(group.host_tier.hashes())

    def teardown(self):
        WALKED["runs"] += 1
        for name, count in zip(("global", "local"), promotions(self.m)):
            WALKED[name] += count
        close(self.m)


WALKED = {"runs": 0, "global": 0, "local": 0}  # walks run, and each group's host promotions
test_host_tier_random_walk_on_two_groups = pytest.mark.filterwarnings("ignore")(
    HybridHostTierMachine.TestCase)
HybridHostTierMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                                   suppress_health_check=[HealthCheck.too_slow])


def test_the_walk_promoted_in_both_groups():
    """Run after the walk (file order): host hits were promoted in both groups."""
    if not WALKED["runs"]:
        pytest.skip("the walk did not run in this test run (run the whole file)")
    assert WALKED["global"] > 0 and WALKED["local"] > 0, WALKED


# --- the engine -----------------------------------------------------------------------------------------

def final_turn(engine, turn: list[int]) -> tuple:
    """Run ``turn`` (request "50") to its end: its final output, and how many of its first three
    pages each group's admission (the first step) copied from its host tier into its device pool
    (each group's promotions: the counters are the manager's, shared by the groups). Groups of
    one shared pool share its host tier too, each under its own keys (``group.keys``)."""
    from test_hybrid_engine import LONG, SamplingParams, run_to_completion

    hashes = engine.manager.match_prefix(turn)[1][:3]
    groups = engine.manager.layout_groups
    tiers = [set(group.host_tier.hashes()) for group in groups]
    engine.add_request("50", turn, SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True))
    assert not any(output.finished for output in engine.step())  # admitted, its last tokens prefilled
    promoted = [sum(key in tier and key not in group.host_tier and group.pool.lookup(key) is not None
                    for key in group.keys(hashes)) for group, tier in zip(groups, tiers)]
    return run_to_completion(engine, [])["50"], promoted


@pytest.mark.parametrize("kv_backend", BACKENDS)
def test_the_engine_hits_an_evicted_prompt_in_both_groups_host_tiers(kv_backend, monkeypatch):
    from test_hybrid_engine import generate, hf_tokens, hybrid_engine
    from test_sliding_window_models import prompts

    shared = prompts((48,), offset=3)[0]  # three full 16-token pages
    others = prompts((40,) * 6, offset=11)
    turn = shared + [7, 8, 9]
    runs = {}
    for host_cache_bytes in (0, 1 << 20):
        engine = hybrid_engine("gemma2", monkeypatch, kv_backend=kv_backend, num_blocks=12,
                               max_num_seqs=2, host_cache_bytes=host_cache_bytes)
        generate(engine, [shared])
        for i in range(0, len(others), 2):  # two at a time: the device pools forget `shared`
            generate(engine, others[i:i + 2], first=10 + i)
        final, promoted = final_turn(engine, turn)
        assert final.outputs[0].token_ids == hf_tokens("gemma2", turn)
        global_group, local_group = engine.manager.layout_groups
        assert local_group.host_tier is global_group.host_tier  # one pool, one tier: keys apart
        runs[host_cache_bytes] = final, engine.manager.cache_stats(), promoted
        window, page = local_group.window, local_group.tokens_per_page
        engine.manager.check()
        assert all(group.num_blocks_in_use == 0 for group in engine.manager.layout_groups)
        engine.close()
    (plain, _, _), (tiered, stats, promoted) = runs[0], runs[1 << 20]
    assert plain.num_cached_tokens == 0 and tiered.num_cached_tokens == 48
    behind = first_needed_block(48, window, page)  # the local layers' window reads only the rest
    assert stats.prefix_hit_tokens_host == 48 and promoted == [3, 3 - behind]
    assert stats.host_promotions == 3 + 3 - behind  # no other promotion in either group
