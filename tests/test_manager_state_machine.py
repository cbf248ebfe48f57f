"""A random walk over the whole manager API against a small reference model.

Rules: admit (with shared system prompts, so prefixes hit; sometimes chunked), continue a chunked
prefill, decode (allocate + commit with a token id), lookahead (margins up to and past
``max_model_len``, mapped as the engine's worker does), truncate, fork, beam reorder, free,
preempt (swap, recompute, auto), re-admit after recompute, swap in, reset the prefix cache, and
a mapping budget that a rule tightens and loosens during the run. The model knows which requests
exist, their token ids and reserved lengths, and which are swapped or waiting to be re-admitted;
K/V contents follow from the token ids (conftest.kv_patterns). After every step:
``manager.check()``, the model agrees with the manager, and every running request reads back
exactly its own K/V. The pool is small (12 blocks of 4 tokens, 4 slots, 6 host blocks) and the
budget often has no mapping to spare, so every kind of refusal happens (pages, slots, swap
space, the mapping budget); each must leave the whole ownership state as it was.

The windowed machines run the same walk with a sliding window of 6 tokens
(``CacheConfig.sliding_window``): blocks wholly behind each request's window are released as it
runs (and unmapped: reading them would fault), so every path meets released blocks; K/V are read
back from the first resident position, and a truncation behind the window must be refused with
nothing changed. The chunked machine runs it with chunked local attention of 6 tokens
(``CacheConfig.attention_chunk_size``, Llama-4's: a query reads only its own chunk), whose chunk
boundaries fall inside blocks of 4 tokens. The latent machines run it on multi-head latent
attention's memory (``CacheConfig.latent``: one row per token per layer, the MLA group), in both
layouts. The state machines run it on hybrids with layers of recurrent state
(``RecurrentStateSpec``: their own group beside the attention group), in three layouts
(``STATE_LAYOUTS``): an attention layer and a state layer (Qwen3-Next, LFM2), one layer in both
groups (Falcon-H1), and those with a layer that holds no memory (Nemotron-H). Each request's
state is written before every commit as a function of its computed prefix (``prefix_mark``), and
saved at every page (``state_cache_interval``); it must read back after forks (copied), swaps and
prefix hits (the saved state of the hit's prefix, or zero without a hit), and every refusal leaves
the state group as it was too; its reorders and truncations are refused (a state is not rewound).
They have a host tier (saved states demoted there and loaded back on a hit, beside the attention
blocks). Each memory has its own backend under the mapping budget, the state group's too, and the walks
count each refusal by its kind (``last_refusal``: no free slot, out of blocks; out of swap space;
the mapping budget): each state walk must meet every kind (out of swap space: one of the four).

The quantized machines run it on int8 rows (token-major) and fp8 rows (per-layer)
(``CacheConfig.kv_cache_dtype``): each row's float32 scale sits in the page beside the values, and
the K/V patterns cover the scales too, so every copy (fork, copy-on-write, swap, prefix hit) must
carry them.

Both layouts, 2 x 100 runs of up to 80 steps (>= 10,000 steps in all, ~2-3 ms each here). A longer
run is one command away: ``VMEMKV_MACHINE_RUNS=1000 python -m pytest -q
tests/test_manager_state_machine.py`` (2 x 1000 runs, > 100,000 steps).
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vmemkv import (CacheConfig, ConfigError, KVCacheManager, MappingLimitError,
                    PrefixCacheBusyError, RequestStateError, RequestTooLongError)
from vmemkv.cache.kv_spec import NO_MEMORY, RecurrentStateSpec, StatePart
from vmemkv.cache.swap import OutOfSwapSpaceError
from vmemkv.memory.vmm import CpuBackend

from conftest import assert_no_leaks, close_manager, manager_state, read_kv_matches, write_kv

TOKENS_PER_PAGE = 4
MAX_LEN = 24
SYSTEM_PROMPTS = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 9], list(range(20, 32))]
suffixes = st.lists(st.integers(0, 3), max_size=10)
# a conv window and a delta-rule state, as a gated delta net layer keeps them
STATE_SPEC = RecurrentStateSpec((StatePart("conv", (6, 3), torch.bfloat16),
                                 StatePart("recurrent", (2, 4, 4), torch.float32)))


# The layers of the walks with a state group (``ManagerMachine.state``): each a layer_windows list
# (the attention layers first, so conftest's K/V patterns address them as layers 0..n-1) and the
# layers that keep a state.
STATE_LAYOUTS = {
    "beside": ([None, STATE_SPEC], (1,)),  # an attention layer, a state layer (Qwen3-Next, LFM2)
    "both": ([(None, STATE_SPEC)], (0,)),  # one layer in both groups (Falcon-H1)
    "no_memory": ([None, NO_MEMORY, STATE_SPEC], (2,)),  # and an MLP-only layer (Nemotron-H)
}


def prefix_mark(token_ids: list[int]) -> int:
    """The state a recurrent layer holds after ``token_ids`` (0 before any): one small integer
    (exact in bfloat16), a function of the whole prefix, as a real state is."""
    return 1 + hash(tuple(token_ids)) % 200 if token_ids else 0


def make_config(layout: str, sliding_window: int | None = None,
                attention_chunk_size: int | None = None, latent: bool = False,
                kv_cache_dtype: str = "auto") -> CacheConfig:
    # 1 layer x 2 heads x 128 dim x fp32 (or one latent row of 256): 4 tokens a block in both layouts;
    # quantized (a byte a value and a scale a row: 528 B a token), rows padded to the same 4 tokens a page
    shape = dict(num_kv_heads=1, head_dim=256, latent=True) if latent else dict(num_kv_heads=2, head_dim=128)
    padding = {} if kv_cache_dtype == "auto" else dict(kv_cache_dtype=kv_cache_dtype, max_padding=3.0)
    config = CacheConfig(num_layers=1, **shape, **padding, dtype=torch.float32,
                         tokens_per_page=TOKENS_PER_PAGE, num_blocks=12, max_num_seqs=4,
                         max_model_len=MAX_LEN, layout=layout,
                         hash_seed=b"state-machine", sliding_window=sliding_window,
                         attention_chunk_size=attention_chunk_size)
    return dataclasses.replace(config, swap_space_bytes=6 * config.make_layout().block_bytes)


class ManagerMachine(RuleBasedStateMachine):
    layout = "token_major"
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    latent = False  # MLA: one latent row per token per layer
    state: str | None = None  # a layout of STATE_LAYOUTS: layers of recurrent state (their own group)
    kv_cache_dtype = "auto"  # "int8" / "fp8": quantized rows, their scales in the pages (patterns too)
    steps = 0  # rules run, over all examples of this class
    examples = 0
    totals: Counter  # what the runs exercised, set per subclass

    def __init__(self):
        super().__init__()
        type(self).examples += 1
        type(self).steps -= 1  # the invariant also runs once before the first rule
        config = make_config(self.layout, self.sliding_window, self.attention_chunk_size, self.latent,
                             self.kv_cache_dtype)
        self.backends: list[CpuBackend] = []  # one a memory, each under the mapping budget
        if self.state:
            layer_windows, self.state_layers = STATE_LAYOUTS[self.state]
            # a state saved at every page: prefix hits continue from saved states
            # and a host tier, shared by the pools' bytes: saved states wait there too
            config = dataclasses.replace(config, num_layers=len(layer_windows),
                                         state_cache_interval=TOKENS_PER_PAGE,
                                         host_cache_bytes=config.swap_space_bytes)
            self.m = KVCacheManager(config, layer_windows=layer_windows, backends=self.new_backend)
            assert [type(g.spec).__name__ for g in self.m.groups] == ["FullAttentionSpec", "RecurrentStateSpec"]
        else:
            self.m = KVCacheManager(config, backends=self.new_backend)
        assert self.m.tokens_per_page == TOKENS_PER_PAGE
        assert (type(self.m.spec).__name__ == "MLALatentSpec") == self.latent
        self.tokens: dict[str, list[int]] = {}  # running and swapped requests: all token ids
        self.reserved: dict[str, int] = {}  # positions reserved (and computed) per running request
        self.swapped: set[str] = set()
        self.waiting: dict[str, list[int]] = {}  # preempted by recompute, to be re-admitted
        self.next_id = 0

    # --- helpers ---
    def new_backend(self, config: CacheConfig) -> CpuBackend:
        layout = config.make_layout()
        self.backends.append(CpuBackend(layout.page_size, config.num_blocks * layout.pages_per_block))
        return self.backends[-1]

    def count_refusal(self) -> None:
        """Count a refused call by what stopped it (``last_refusal``), the pool's group named."""
        refusal = self.m.last_refusal
        kind = refusal.reason
        if kind == "out_of_blocks":
            kind += "_state" if refusal.group and "recurrent state" in refusal.group else ""
        self.totals["refusals"] += 1
        self.totals[f"refused_{kind}"] += 1

    def new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def running(self) -> list[str]:
        return sorted(r for r in self.tokens if r not in self.swapped)

    def decodable(self) -> list[str]:
        return [r for r in self.running() if self.reserved[r] == len(self.tokens[r])]

    def prefilling(self) -> list[str]:
        return [r for r in self.running() if self.reserved[r] < len(self.tokens[r])]

    def snapshot(self) -> tuple:
        """``manager_state`` and, with a state group, its pool and each request's state blocks."""
        state = manager_state(self.m)
        if not self.state:
            return state
        group = self.m.groups[1]
        tables = {r: (group.block_table(self.m.request(r)), self.m.is_swapped(r)) for r in self.m.request_ids()}
        return state, tables, list(group.pool.ref), group.pool.free_queue(), group.swap.num_free

    def holds_state(self, request_id: str, token_ids: list[int]) -> bool:
        """Whether the request's state is the one its computed ``token_ids`` give."""
        slot = self.m.slot_of(request_id)
        return all(bool((view[slot] == prefix_mark(token_ids)).all())
                   for layer in self.state_layers for view in self.m.state_views(layer))

    def write_state(self, request_id: str, token_ids: list[int]) -> None:
        """Write the state computing ``token_ids`` gives (before the commit that may save it)."""
        if self.state:
            slot = self.m.slot_of(request_id)
            for layer in self.state_layers:
                for view in self.m.state_views(layer):
                    view[slot] = prefix_mark(token_ids)

    def refused_without_change(self, call) -> None:
        before = self.snapshot()
        assert not call()
        assert self.snapshot() == before
        self.count_refusal()

    def budgeted(self, call):
        """``(True, None)`` if the mapping budget refused ``call`` (which must then have changed
        nothing), else ``(False, its result)``."""
        before = self.snapshot()
        try:
            return False, call()
        except MappingLimitError:
            assert self.snapshot() == before
            self.totals["mapping_refusals"] += 1
            return True, None

    def admit_into_model(self, request_id, token_ids, budget) -> bool:
        m = self.m
        can = m.can_admit(token_ids) if budget is None else None
        before = self.snapshot()
        refused, cached = self.budgeted(lambda: m.admit(request_id, token_ids, token_budget=budget))
        if refused:
            return False
        if can is not None:
            assert (cached is not None) == can
        if cached is None:
            assert self.snapshot() == before
            self.count_refusal()
            return False
        assert cached % TOKENS_PER_PAGE == 0 and (cached < len(token_ids) or not token_ids)
        if self.state:  # zero, or the state saved where its prefix hit ends
            assert self.holds_state(request_id, token_ids[:cached]), f"{request_id}: not its prefix's state"
            self.totals["state_hits"] += cached > 0
        write_kv(m, request_id, cached, m.num_tokens(request_id))
        self.write_state(request_id, token_ids[:m.num_tokens(request_id)])
        m.commit(request_id)
        self.tokens[request_id] = list(token_ids)
        self.reserved[request_id] = m.num_tokens(request_id)
        return True

    # --- rules ---
    @rule(system=st.sampled_from(range(len(SYSTEM_PROMPTS))), suffix=suffixes,
          budget=st.none() | st.integers(1, 6))
    def admit(self, system, suffix, budget):
        token_ids = SYSTEM_PROMPTS[system] + suffix
        if len(token_ids) > MAX_LEN:
            with pytest.raises(RequestTooLongError):
                self.m.admit(self.new_id(), token_ids)
            return
        self.admit_into_model(self.new_id(), token_ids, budget)

    @precondition(lambda self: self.prefilling())
    @rule(data=st.data(), chunk=st.integers(1, 8))
    def continue_prefill(self, data, chunk):
        request_id = data.draw(st.sampled_from(self.prefilling()))
        start = self.reserved[request_id]
        chunk = min(chunk, len(self.tokens[request_id]) - start)
        can = self.m.can_allocate(request_id, chunk)
        if not can:
            self.refused_without_change(lambda: self.m.allocate(request_id, chunk))
            return
        refused, _ = self.budgeted(lambda: self.m.allocate(request_id, chunk))
        if refused:
            return
        write_kv(self.m, request_id, start, start + chunk)
        self.write_state(request_id, self.tokens[request_id][:start + chunk])
        self.m.commit(request_id)
        self.reserved[request_id] = start + chunk

    @precondition(lambda self: self.decodable())
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        request_id = data.draw(st.sampled_from(self.decodable()))
        m = self.m
        n = self.reserved[request_id]
        if n + 1 > MAX_LEN:
            before = self.snapshot()
            with pytest.raises(RequestTooLongError):
                m.allocate(request_id, 1, [token])
            assert self.snapshot() == before
            return
        blocks = m.block_table(request_id)  # lookahead blocks included
        needed = max(-(-(n + 1) // TOKENS_PER_PAGE) - len(blocks), 0)
        assert m.blocks_needed(request_id, 1) == needed
        if not m.can_allocate(request_id, 1):
            assert needed and m.pool.num_free == 0
            self.refused_without_change(lambda: m.allocate(request_id, 1, [token]))
            return
        refused, _ = self.budgeted(lambda: m.allocate(request_id, 1, [token]))
        if refused:
            return
        assert m.block_table(request_id)[: len(blocks)] == blocks
        assert len(m.block_table(request_id)) == len(blocks) + needed
        write_kv(m, request_id, n, n + 1)
        self.write_state(request_id, self.tokens[request_id] + [token])
        m.commit(request_id)
        self.tokens[request_id].append(token)
        self.reserved[request_id] = n + 1

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.running()))
        m = self.m
        partial = self.reserved[parent] % TOKENS_PER_PAGE != 0
        expected = m.num_free_slots > 0 and (not partial or m.pool.num_free > 0)
        child = self.new_id()
        if not expected:
            self.refused_without_change(lambda: m.fork(parent, child))
            return
        copied = m.stats.blocks_copied
        refused, forked = self.budgeted(lambda: m.fork(parent, child))
        if refused:
            return
        assert forked
        state_blocks = m.groups[1].state_blocks if self.state else 0
        assert m.stats.blocks_copied == copied + partial + state_blocks
        parent_blocks, child_blocks = m.block_table(parent), m.block_table(child)
        shared = -(-self.reserved[parent] // TOKENS_PER_PAGE) - partial  # lookahead not shared
        assert child_blocks[:shared] == parent_blocks[:shared]
        self.tokens[child] = list(self.tokens[parent])
        self.reserved[child] = self.reserved[parent]

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def reorder(self, data):
        running = self.running()
        rows = data.draw(st.permutations(running))[: data.draw(st.integers(1, len(running)))]
        picks = data.draw(st.lists(st.integers(0, len(running) - 1), min_size=len(rows),
                                   max_size=len(rows)))
        sources = [running[i] for i in picks]
        before = self.snapshot()
        if self.state:
            with pytest.raises(ConfigError):
                self.m.reorder(rows, sources)
            assert self.snapshot() == before
            return
        copied = self.m.stats.blocks_copied
        refused, reordered = self.budgeted(lambda: self.m.reorder(rows, sources))
        if refused:
            return
        if not reordered:
            assert self.snapshot() == before
            return
        # a partial page is copied for every taker but the one that keeps or moves it
        partial_takers = {}
        for row, source in zip(rows, sources):
            if self.reserved[source] % TOKENS_PER_PAGE:
                partial_takers.setdefault(source, []).append(row)
        expected_copies = sum(len(takers) - (source in rows) for source, takers in partial_takers.items())
        assert self.m.stats.blocks_copied == copied + expected_copies
        snapshot = {s: (list(self.tokens[s]), self.reserved[s]) for s in sources}
        for row, source in zip(rows, sources):
            self.tokens[row], self.reserved[row] = list(snapshot[source][0]), snapshot[source][1]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free(request_id)
        del self.tokens[request_id]
        self.reserved.pop(request_id, None)
        self.swapped.discard(request_id)

    @precondition(lambda self: self.running())
    @rule(data=st.data(), mode=st.sampled_from(["swap", "recompute", "auto"]))
    def preempt(self, data, mode):
        request_id = data.draw(st.sampled_from(self.running()))
        m = self.m
        before = self.snapshot()
        try:
            used = m.preempt(request_id, mode)
        except OutOfSwapSpaceError:
            assert mode in ("swap", "auto")
            assert self.snapshot() == before
            self.totals["refused_swap_space"] += 1
            return
        assert mode == "auto" or used == mode
        if used == "swap":
            assert m.is_swapped(request_id)
            self.swapped.add(request_id)
        else:
            assert request_id not in m.request_ids()
            self.waiting[request_id] = self.tokens.pop(request_id)
            del self.reserved[request_id]

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def readmit(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.waiting)))
        reprefill = self.m.stats.reprefill_queried_tokens
        if self.admit_into_model(request_id, self.waiting[request_id], None):
            assert self.m.stats.reprefill_queried_tokens == reprefill + len(self.tokens[request_id])
            del self.waiting[request_id]

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.swapped)))
        before = self.snapshot()
        refused, swapped_in = self.budgeted(lambda: self.m.swap_in(request_id))
        if swapped_in:
            self.swapped.discard(request_id)
        elif not refused:
            assert self.snapshot() == before
            self.count_refusal()

    @precondition(lambda self: self.running())
    @rule(data=st.data(), margin=st.integers(1, MAX_LEN + 8), keep_free=st.integers(0, 3))
    def lookahead(self, data, margin, keep_free):
        """Blocks ahead of the reservation, mapped as the engine's worker does; a refused
        mapping is cancelled and leaves everything as it was."""
        m = self.m
        ids = data.draw(st.lists(st.sampled_from(self.running()), unique=True, min_size=1))
        before = self.snapshot()
        jobs = m.allocate_lookahead(ids, margin, keep_free)
        for job in jobs:  # never past the slot's end
            assert job.first + len(job.blocks) <= -(-MAX_LEN // TOKENS_PER_PAGE)
        try:
            m.map_lookahead(jobs)
        except MappingLimitError:
            m.cancel_lookahead(jobs)
            assert self.snapshot() == before
            self.totals["mapping_refusals"] += 1
            return
        self.totals["lookahead_blocks"] += sum(len(job.blocks) for job in jobs)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def truncate(self, data):
        request_id = data.draw(st.sampled_from(self.running()))
        if self.reserved[request_id] != len(self.tokens[request_id]):
            return  # mid-prefill: truncate wants every reserved token computed
        n = data.draw(st.integers(0, self.reserved[request_id]))
        before = self.snapshot()
        if self.state:
            assert not self.m.can_truncate([request_id], n)
            with pytest.raises(ConfigError):
                self.m.truncate(request_id, n)
            assert self.snapshot() == before
            return
        released = self.m.request(request_id).num_released_blocks
        if released and self.first_read(n) < released * TOKENS_PER_PAGE:
            with pytest.raises(RequestStateError):  # a query at n would read a released block
                self.m.truncate(request_id, n)
            assert self.snapshot() == before
            self.totals["truncations_behind_window"] += 1
            return
        refused, done = self.budgeted(lambda: self.m.truncate(request_id, n))
        if refused:
            return
        if not done:
            assert self.m.pool.num_free == 0 and self.snapshot() == before
            self.totals["refusals"] += 1
            return
        del self.tokens[request_id][n:]
        self.reserved[request_id] = n

    @rule(extra=st.none() | st.integers(0, 4))
    def mapping_budget(self, extra):
        """Tighten or loosen the mapping budget: ``extra`` more VMAs than in use now, or none."""
        for backend in self.backends:
            backend.max_mappings = None if extra is None else backend.mappings_in_use + extra

    @precondition(lambda self: self.m.pool.num_cached)  # something to forget
    @rule()
    def reset_prefix_cache(self):
        m = self.m
        if any(memory.pool.num_in_use for memory in m.memories):  # a state group's too
            before = self.snapshot()
            with pytest.raises(PrefixCacheBusyError):
                m.reset_prefix_cache()
            assert self.snapshot() == before
        else:
            assert m.reset_prefix_cache() >= 0
            assert m.pool.num_cached == 0 and m.pool.block_of_hash == {}

    # --- after every step ---
    @invariant()
    def manager_agrees_with_the_model(self):
        type(self).steps += 1
        m = self.m
        m.check()
        assert sorted(m.request_ids()) == sorted(self.tokens)
        for request_id, token_ids in self.tokens.items():
            assert m.token_ids(request_id) == token_ids
            assert m.is_swapped(request_id) == (request_id in self.swapped)
        for request_id in self.running():
            assert m.num_tokens(request_id) == m.num_computed_tokens(request_id) == self.reserved[request_id]
            released = m.request(request_id).num_released_blocks
            # every position its next query reads is resident
            assert released * TOKENS_PER_PAGE <= self.first_read(self.reserved[request_id])
            assert read_kv_matches(m, request_id, start=released * TOKENS_PER_PAGE), (
                f"{request_id} reads K/V it did not write")
            if self.state:
                assert self.holds_state(request_id, self.tokens[request_id][:self.reserved[request_id]]), (
                    f"{request_id} reads a state it did not write")

    def first_read(self, position: int) -> int:
        """The reference rule: the first key position a query at ``position`` reads."""
        if self.sliding_window:
            return max(0, position - self.sliding_window + 1)
        if self.attention_chunk_size:
            return position - position % self.attention_chunk_size
        return 0

    def teardown(self):
        stats = self.m.snapshot_stats()
        for key in ("prefix_hit_tokens", "reprefill_hit_tokens", "evictions", "forks",
                    "blocks_copied", "preemptions_swap", "preemptions_recompute", "swap_in_bytes",
                    "blocks_released_behind_window", "states_saved", "state_host_hits",
                    "host_demotions", "host_promotions"):
            self.totals[key] += stats[key]
        try:
            assert_no_leaks(self.m)
        finally:
            close_manager(self.m)


pytestmark = pytest.mark.slow  # ~2 min: eleven machines of 100 runs each

RUNS = int(os.environ.get("VMEMKV_MACHINE_RUNS", "100"))
SETTINGS = settings(max_examples=RUNS, stateful_step_count=80, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


class TokenMajorMachine(ManagerMachine):
    layout = "token_major"
    totals = Counter()


class PerLayerMachine(ManagerMachine):
    layout = "per_layer"
    totals = Counter()


class TokenMajorWindowMachine(ManagerMachine):
    layout = "token_major"
    sliding_window = 6
    totals = Counter()


class PerLayerWindowMachine(ManagerMachine):
    layout = "per_layer"
    sliding_window = 6
    totals = Counter()


class TokenMajorChunkedMachine(ManagerMachine):
    layout = "token_major"
    attention_chunk_size = 6
    totals = Counter()


class TokenMajorLatentMachine(ManagerMachine):
    layout = "token_major"
    latent = True
    totals = Counter()


class PerLayerLatentMachine(ManagerMachine):
    layout = "per_layer"
    latent = True
    totals = Counter()


class TokenMajorInt8Machine(ManagerMachine):
    layout = "token_major"
    kv_cache_dtype = "int8"
    totals = Counter()


class PerLayerFp8Machine(ManagerMachine):
    layout = "per_layer"
    kv_cache_dtype = "fp8"
    totals = Counter()


class TokenMajorStateMachine(ManagerMachine):
    layout = "token_major"
    state = "beside"
    totals = Counter()


class PerLayerStateMachine(ManagerMachine):
    layout = "per_layer"
    state = "beside"
    totals = Counter()


class BothGroupsStateMachine(ManagerMachine):
    layout = "token_major"
    state = "both"
    totals = Counter()


class NoMemoryStateMachine(ManagerMachine):
    layout = "per_layer"
    state = "no_memory"
    totals = Counter()


TestTokenMajor = TokenMajorMachine.TestCase
TestTokenMajor.settings = SETTINGS
TestPerLayer = PerLayerMachine.TestCase
TestPerLayer.settings = SETTINGS
TestTokenMajorWindow = TokenMajorWindowMachine.TestCase
TestTokenMajorWindow.settings = SETTINGS
TestPerLayerWindow = PerLayerWindowMachine.TestCase
TestPerLayerWindow.settings = SETTINGS
TestTokenMajorChunked = TokenMajorChunkedMachine.TestCase
TestTokenMajorChunked.settings = SETTINGS
TestTokenMajorLatent = TokenMajorLatentMachine.TestCase
TestTokenMajorLatent.settings = SETTINGS
TestPerLayerLatent = PerLayerLatentMachine.TestCase
TestPerLayerLatent.settings = SETTINGS
TestTokenMajorInt8 = TokenMajorInt8Machine.TestCase
TestTokenMajorInt8.settings = SETTINGS
TestPerLayerFp8 = PerLayerFp8Machine.TestCase
TestPerLayerFp8.settings = SETTINGS
TestTokenMajorState = TokenMajorStateMachine.TestCase
TestTokenMajorState.settings = SETTINGS
TestPerLayerState = PerLayerStateMachine.TestCase
TestPerLayerState.settings = SETTINGS
TestBothGroupsState = BothGroupsStateMachine.TestCase
TestBothGroupsState.settings = SETTINGS
TestNoMemoryState = NoMemoryStateMachine.TestCase
TestNoMemoryState.settings = SETTINGS


def test_the_machines_ran_enough_steps(request):
    """Runs last in this file: the two machines ran at least 50 steps a run on average (10,000
    steps with the default 2 x 100 runs)."""
    ran = TokenMajorMachine.steps + PerLayerMachine.steps
    if TokenMajorMachine.steps == 0 or PerLayerMachine.steps == 0:
        pytest.skip("the state machines did not run in this pytest run (selected out)")
    print(f"state machines: {ran} steps in {TokenMajorMachine.examples + PerLayerMachine.examples} "
          f"runs; {dict(TokenMajorMachine.totals + PerLayerMachine.totals)}")
    assert ran >= 2 * 50 * RUNS, f"only {ran} steps ran"


def test_the_windowed_machines_released_blocks():
    """Runs last: the windowed walks released blocks behind windows and met them in prefix hits,
    swaps and refused truncations (else they tested nothing new)."""
    totals = TokenMajorWindowMachine.totals + PerLayerWindowMachine.totals
    if not TokenMajorWindowMachine.steps or not PerLayerWindowMachine.steps:
        pytest.skip("the windowed state machines did not run in this pytest run (selected out)")
    print(f"windowed state machines: {dict(totals)}")
    for key in ("blocks_released_behind_window", "prefix_hit_tokens", "preemptions_swap",
                "swap_in_bytes", "truncations_behind_window", "forks"):
        assert totals[key] > 0, f"the windowed walks never exercised {key}"


def test_the_chunked_machine_released_blocks():
    """Runs last: the chunked walk released the blocks of finished chunks and met them in prefix
    hits, swaps and refused truncations."""
    totals = TokenMajorChunkedMachine.totals
    if not TokenMajorChunkedMachine.steps:
        pytest.skip("the chunked state machine did not run in this pytest run (selected out)")
    print(f"chunked state machine: {dict(totals)}")
    for key in ("blocks_released_behind_window", "prefix_hit_tokens", "preemptions_swap",
                "swap_in_bytes", "truncations_behind_window", "forks"):
        assert totals[key] > 0, f"the chunked walk never exercised {key}"


def test_the_latent_machines_shared_swapped_and_hit():
    """Runs last: the latent walks (the MLA group) met prefix hits, forks, swaps and refusals."""
    totals = TokenMajorLatentMachine.totals + PerLayerLatentMachine.totals
    if not TokenMajorLatentMachine.steps or not PerLayerLatentMachine.steps:
        pytest.skip("the latent state machines did not run in this pytest run (selected out)")
    print(f"latent state machines: {dict(totals)}")
    for key in ("prefix_hit_tokens", "forks", "preemptions_swap", "swap_in_bytes", "refusals"):
        assert totals[key] > 0, f"the latent walks never exercised {key}"


def test_the_quantized_machines_shared_swapped_and_hit():
    """Runs last: the quantized walks (int8 and fp8 rows, their scales in the pages) met prefix
    hits, forks, copy-on-write copies, swaps and refusals, every copy checked to carry the
    scales with the values."""
    totals = TokenMajorInt8Machine.totals + PerLayerFp8Machine.totals
    if not TokenMajorInt8Machine.steps or not PerLayerFp8Machine.steps:
        pytest.skip("the quantized state machines did not run in this pytest run (selected out)")
    print(f"quantized state machines: {dict(totals)}")
    for key in ("prefix_hit_tokens", "forks", "blocks_copied", "preemptions_swap", "swap_in_bytes", "refusals"):
        assert totals[key] > 0, f"the quantized walks never exercised {key}"


STATE_MACHINES = [TokenMajorStateMachine, PerLayerStateMachine, BothGroupsStateMachine, NoMemoryStateMachine]


@pytest.mark.parametrize("machine", STATE_MACHINES, ids=lambda machine: machine.__name__)
def test_the_state_machines_forked_swapped_and_met_every_refusal(machine):
    """Runs last: each walk with a state group forked and swapped states, dropped them by
    recompute, hit saved states, and met every kind of refusal: no free slot, out of blocks, the
    mapping budget, and (over the four walks) out of swap space, each checked to change nothing
    where it happened. The
    state group's pool is sized for every slot's state (and as many saved ones, evictable), so
    its refusals are the mapping budget's: its backend is budgeted like the attention group's."""
    if not machine.steps:
        pytest.skip(f"{machine.__name__} did not run in this pytest run (selected out)")
    totals = machine.totals
    print(f"{machine.__name__}: {dict(totals)}")
    for key in ("forks", "preemptions_swap", "swap_in_bytes", "preemptions_recompute", "state_hits",
                "states_saved", "host_demotions", "refused_no_free_slot", "refused_out_of_blocks",
                "mapping_refusals"):
        assert totals[key] > 0, f"{machine.__name__} never exercised {key}"
    # out of swap space is rarer (the host tier's rows come free for swaps): over the four walks
    ran = [other for other in STATE_MACHINES if other.steps]
    if len(ran) == len(STATE_MACHINES):
        assert sum(other.totals["refused_swap_space"] for other in ran) > 0, "no walk ran out of swap space"


class _Draws:
    """Stands in for hypothesis' ``data`` in a replayed run: hands out the given values in order."""

    def __init__(self, *values):
        self.values = list(values)

    def draw(self, strategy, label=None):
        return self.values.pop(0)


@pytest.mark.filterwarnings("ignore")
def test_a_windowed_reorder_refused_its_unmaps_changes_nothing():
    """A run the machine found: under a tight mapping budget, reorder mapped a row's new blocks,
    then was refused the unmap behind another row's new window, leaving a page mapped behind a
    window. The budget is now asked for both before anything is mapped."""
    machine = TokenMajorWindowMachine()
    steps = [lambda: machine.mapping_budget(extra=4),
             lambda: machine.admit(budget=None, suffix=[0], system=0),
             lambda: machine.admit(budget=None, suffix=[0] * 10, system=0),
             lambda: machine.lookahead(data=_Draws(["r2"]), keep_free=0, margin=11),
             lambda: machine.fork(data=_Draws("r1")),
             lambda: machine.free(data=_Draws("r1")),
             lambda: machine.reorder(data=_Draws(["r2", "r3"], 2, [1, 0]))]
    for step in steps:
        step()
        machine.manager_agrees_with_the_model()
    machine.teardown()


def test_can_admit_reaches_a_saved_state_on_the_host_tier():
    """A run the machine found: a prompt whose first block is on the device (another request
    holds it) and whose saved state there is on the host tier. ``admit`` reached that state
    and needed one fresh attention block, the one left; ``can_admit`` looked at the device
    only, found no saved state, so no hit, and said two blocks were needed. It now asks about
    admit's own admission."""
    machine = TokenMajorStateMachine()
    prefill = lambda request_id, chunk: machine.continue_prefill(data=_Draws(request_id), chunk=chunk)
    steps = [lambda: machine.admit(budget=4, suffix=[0], system=1),  # [1, 2, 3, 4]'s state saved
             lambda: prefill("r1", 1),
             lambda: machine.admit(budget=4, suffix=[0] * 10, system=4),
             *[lambda: prefill("r2", 4)] * 4, lambda: prefill("r2", 2),  # saves that push it out
             lambda: machine.admit(budget=4, suffix=[1] * 4, system=3),
             lambda: prefill("r3", 4), lambda: prefill("r3", 1)]
    for step in steps:
        step()
        machine.manager_agrees_with_the_model()
    m = machine.m
    assert m.pool.num_free == 1 and len(m.memories[1].host_tier) > 0
    assert m.can_admit(SYSTEM_PROMPTS[2])
    machine.admit(budget=None, suffix=[], system=2)  # admit agrees, with [1, 2, 3, 4] cached
    assert machine.reserved["r4"] == 8 and m.stats.state_hits == 1
    machine.manager_agrees_with_the_model()
    machine.teardown()
