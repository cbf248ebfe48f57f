"""The caller-owned request object: ``KVRequest``.

Its token list is the caller's (the manager never copies it; truncate and reorder change it in
place), its hash chain is extended incrementally and survives refusals, free and recompute
preemption (counted here in hashed blocks), its allocation is read-only to the caller, and misuse
of it is refused before anything changes. The random walk of ``test_manager_state_machine`` also
runs with every other request driven by object (``ObjectFormMachine``)."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import manager_state
from hypothesis import settings
from hypothesis.stateful import invariant

import vmemkv
from vmemkv import (CacheKeys, InvalidInputError, KVRequest, RequestStateError,
                    UnknownRequestError)
from vmemkv.cache.config import CacheStats
from vmemkv.cache.hashing import PrefixHasher
from test_manager_state_machine import RUNS, SETTINGS, ManagerMachine


def count_hashed_blocks(manager) -> list[int]:
    """Wrap the manager's hasher; the returned list's one entry counts the blocks it hashes."""
    hashed = [0]
    block_hashes = manager.hasher.block_hashes

    def counting(*args, **kwargs):
        result = block_hashes(*args, **kwargs)
        hashed[0] += len(result)
        return result

    manager.hasher.block_hashes = counting
    return hashed


def test_a_request_by_object_reads_its_allocation_without_the_manager(make_manager):
    m = make_manager()
    prompt = [1, 2, 3, 4, 5, 6]
    req = KVRequest("a", prompt)
    assert req.token_ids is prompt and not req.is_running and req.slot is None
    assert m.admit(req) == 0
    assert m.request("a") is req and m.request_ids() == ["a"]
    with pytest.raises(RequestStateError, match="already admitted"):
        m.admit(req)
    assert (req.slot, req.num_tokens, req.num_computed_tokens) == (m.slot_of("a"), 6, 0)
    assert list(req.block_table) == m.block_table(req) == m.block_table("a")
    m.commit(req)
    assert req.num_computed_tokens == 6 and len(req.block_hashes) == 1  # one full block of 4
    prompt.append(7)  # the caller appends; the manager reads the same list
    assert m.allocate(req, 1)
    m.commit(req)
    assert m.token_ids("a") == [1, 2, 3, 4, 5, 6, 7] and req.num_tokens == 7
    prompt.append(8)
    assert m.allocate(req, 1)
    m.commit(req)
    assert len(req.block_hashes) == 2  # the second block filled at commit
    m.check()
    m.free(req)
    assert not req.is_running and req.num_tokens == req.num_computed_tokens == 0
    assert req.block_table == () and len(req.block_hashes) == 2  # the chain stays
    assert m.request_ids() == []


def test_the_allocation_is_read_only(make_manager):
    req = KVRequest("a", [1, 2, 3])
    for name in ("num_tokens", "num_computed_tokens", "slot", "block_table", "block_hashes",
                 "token_ids", "keys", "request_id"):
        with pytest.raises(AttributeError):
            setattr(req, name, 0)


def test_a_blocked_admission_is_hashed_once_however_often_it_is_retried(make_manager):
    m = make_manager(num_blocks=6)
    hashed = count_hashed_blocks(m)
    assert m.admit("big", list(range(100, 120))) == 0  # 5 of 6 blocks held
    hashed[0] = 0
    waiting = KVRequest("w", list(range(16)))  # 4 blocks: does not fit while "big" runs
    for _ in range(5):
        assert m.admit(waiting) is None
        assert not m.can_admit(waiting)
    assert hashed[0] == 3  # the prompt's 3 full blocks before its last token, once
    m.free("big")
    assert m.admit(waiting) == 0
    m.commit(waiting)
    assert hashed[0] == 4  # the commit hashed only the 4th block
    m.check()


def test_an_id_admission_hashes_each_time_an_object_does_not(make_manager):
    """What the object form saves: by id, every retry of a blocked admission hashes again."""
    m = make_manager(num_blocks=6)
    assert m.admit("big", list(range(100, 120))) == 0
    hashed = count_hashed_blocks(m)
    for _ in range(3):
        assert m.admit("w", list(range(16))) is None
    assert hashed[0] == 3 * 3


def test_decode_commits_hash_each_block_once(make_manager):
    m = make_manager()
    hashed = count_hashed_blocks(m)
    req = KVRequest("a", [1, 2])
    assert m.admit(req) == 0
    m.commit(req)
    for token in range(3, 30):
        req.token_ids.append(token)
        assert m.allocate(req, 1)
        m.commit(req)
    assert hashed[0] == len(req.token_ids) // 4 == len(req.block_hashes) == 7
    assert req.block_hashes == tuple(PrefixHasher(seed=b"vmemkv-tests").block_hashes(
        req.token_ids, 4, CacheKeys()))  # the same chain as hashing all of it at once


def test_recompute_preemption_keeps_the_chain_and_readmission_hits_without_rehashing(make_manager):
    m = make_manager()
    req = KVRequest("a", list(range(1, 11)))
    assert m.admit(req) == 0
    m.commit(req)
    hashed = count_hashed_blocks(m)
    assert m.preempt(req, "recompute") == "recompute"
    assert not req.is_running and len(req.block_hashes) == 2
    assert m.admit(req) == 8  # both full blocks still cached
    assert hashed[0] == 0
    assert m.cache_stats().reprefill_hit_tokens == 8
    m.check()


def test_swap_by_object(make_manager):
    m = make_manager(swap_space_bytes=16 * 4096)
    req = KVRequest("a", [1, 2, 3, 4, 5, 6])
    assert m.admit(req) == 0
    m.commit(req)
    assert m.preempt(req, "swap") == "swap"
    assert req.is_swapped and req.slot is None and m.is_swapped(req)
    with pytest.raises(UnknownRequestError, match="swapped"):
        m.allocate(req, 1)
    assert m.swap_in(req)
    assert req.is_running and not req.is_swapped and req.num_computed_tokens == 6
    m.check()


def test_truncate_and_reorder_change_the_callers_lists_in_place(make_manager):
    m = make_manager()
    a_ids, b_ids = [1, 2, 3, 4, 5, 6], [9, 9, 9, 9, 9]
    a, b = KVRequest("a", a_ids), KVRequest("b", b_ids)
    for req in (a, b):
        assert m.admit(req) is not None
        m.commit(req)
    assert m.truncate(a, 5)
    assert a.token_ids is a_ids and a_ids == [1, 2, 3, 4, 5]
    assert m.reorder([b], [a])
    assert b.token_ids is b_ids and b_ids == [1, 2, 3, 4, 5] and b.num_tokens == 5
    assert b.block_hashes == a.block_hashes
    b_ids.append(6)  # b continues a's content from here, in its own list
    assert m.allocate(b, 1)
    m.commit(b)
    assert a_ids == [1, 2, 3, 4, 5]
    m.check()


def test_fork_into_a_callers_object_or_an_id(make_manager):
    m = make_manager()
    parent = KVRequest("p", [1, 2, 3, 4, 5], CacheKeys(cache_salt="s"))
    assert m.admit(parent) == 0
    m.commit(parent)
    child_ids = [1, 2]  # replaced by a copy of the parent's ids, in this list
    child = KVRequest("c", child_ids)
    assert m.fork(parent, child) is child
    assert child.token_ids is child_ids and child_ids == [1, 2, 3, 4, 5]
    assert child.keys == parent.keys and child.block_hashes == parent.block_hashes
    assert child.num_computed_tokens == 5 and child.slot != parent.slot
    made = m.fork(parent, "d")
    assert isinstance(made, KVRequest) and m.request("d") is made and made.token_ids == child_ids
    child_ids.append(6)
    assert m.allocate(child, 1)
    m.commit(child)
    assert parent.token_ids == [1, 2, 3, 4, 5]
    m.check()


def test_lookahead_by_object(make_manager):
    m = make_manager()
    req = KVRequest("a", [1, 2, 3, 4])
    assert m.admit(req) == 0
    m.commit(req)
    jobs = m.allocate_lookahead([req], 4)
    m.map_lookahead(jobs)
    assert len(req.block_table) == 2 and req.num_tokens == 4
    m.check()


def misuse_cases(m, other) -> dict:
    """Calls that must each raise a vmemkv error and change nothing, by label."""
    a = m.request("a")
    freed = KVRequest("f", [1, 2, 3])
    assert m.admit(freed) == 0
    m.free(freed)
    foreign = KVRequest("x", [1, 2, 3])
    assert other.admit(foreign) == 0
    return dict([
        ("admit_twice", lambda: m.admit(a)),
        ("admit_a_new_object_with_a_running_id", lambda: m.admit(KVRequest("a", [1, 2]))),
        ("admit_with_token_ids_too", lambda: m.admit(KVRequest("n", [1, 2]), [1, 2])),
        ("admit_with_keys_too", lambda: m.admit(KVRequest("n", [1, 2]), keys=CacheKeys())),
        ("admit_an_id_without_token_ids", lambda: m.admit("n")),
        ("admit_another_managers_request", lambda: m.admit(foreign)),
        ("allocate_another_managers_request", lambda: m.allocate(foreign, 1)),
        ("fork_into_another_managers_request", lambda: m.fork(a, foreign)),
        ("fork_into_a_running_request", lambda: m.fork(a, m.request("b"))),
        ("fork_into_a_request_sharing_the_parents_list", lambda: m.fork(a, KVRequest("c", a.token_ids))),
        ("allocate_a_freed_request", lambda: m.allocate(freed, 1)),
        ("commit_a_freed_request", lambda: m.commit(freed)),
        ("slot_of_a_freed_request", lambda: m.slot_of(freed)),
        ("free_a_freed_request", lambda: m.free(freed)),
        ("free_a_request_never_admitted", lambda: m.free(KVRequest("n", [1]))),
        ("request_of_an_unknown_id", lambda: m.request("nope")),
        ("request_not_a_str", lambda: m.request(a)),
        ("allocate_an_int", lambda: m.allocate(7, 1)),
        ("allocate_none", lambda: m.allocate(None, 1)),
        ("reorder_a_bare_object", lambda: m.reorder(a, a)),
        ("lookahead_a_bare_object", lambda: m.allocate_lookahead(a, 4)),
        ("lookahead_a_freed_request", lambda: m.allocate_lookahead([a, freed], 4)),
        ("admit_float_tokens_in_the_list", lambda: m.admit(KVRequest("n", [1, 2, 3, 4, 5.5]))),
        ("can_admit_float_tokens_in_the_list", lambda: m.can_admit(KVRequest("n", [1.5]))),
    ])


MISUSE = ["admit_twice", "admit_a_new_object_with_a_running_id", "admit_with_token_ids_too",
          "admit_with_keys_too", "admit_an_id_without_token_ids", "admit_another_managers_request",
          "allocate_another_managers_request", "fork_into_another_managers_request",
          "fork_into_a_running_request", "fork_into_a_request_sharing_the_parents_list",
          "allocate_a_freed_request", "commit_a_freed_request",
          "slot_of_a_freed_request", "free_a_freed_request", "free_a_request_never_admitted",
          "request_of_an_unknown_id", "request_not_a_str", "allocate_an_int", "allocate_none",
          "reorder_a_bare_object", "lookahead_a_bare_object", "lookahead_a_freed_request",
          "admit_float_tokens_in_the_list", "can_admit_float_tokens_in_the_list"]


@pytest.mark.parametrize("label", MISUSE)
def test_object_misuse_is_refused_before_any_change(make_manager, label):
    m, other = make_manager(), make_manager()
    assert m.admit("a", [1, 2, 3, 4, 5, 6]) == 0
    m.commit("a")
    assert m.admit("b", [1, 2, 3, 4, 9]) == 4
    m.commit("b")
    cases = misuse_cases(m, other)
    assert sorted(cases) == sorted(MISUSE)
    before = manager_state(m)
    with pytest.raises(vmemkv.VmemkvError):
        cases[label]()
    assert manager_state(m) == before


def test_bad_tokens_appended_to_the_list_are_refused_at_commit_before_any_change(make_manager):
    m = make_manager()
    req = KVRequest("a", [1, 2, 3])
    assert m.admit(req) == 0
    m.commit(req)
    req.token_ids.append(2.5)  # the 4th token fills the first block, which commit hashes
    assert m.allocate(req, 1)
    before = manager_state(m)
    with pytest.raises(InvalidInputError):
        m.commit(req)
    assert manager_state(m) == before and req.num_computed_tokens == 3 and req.block_hashes == ()


def test_bad_kvrequest_construction():
    with pytest.raises(InvalidInputError):
        KVRequest("a", (1, 2, 3))  # a tuple cannot be appended to: the request keeps the list
    with pytest.raises(InvalidInputError):
        KVRequest(7, [1])
    with pytest.raises(InvalidInputError):
        KVRequest("a", [1], keys="salt")
    assert KVRequest("a").token_ids == []


def test_the_block_names_are_the_only_names():
    # the names before blocks were called blocks went with the 0.1.0 release's sweep
    for old in ("OutOfPagesError", "PageStateError", "PagePool", "HybridKVCacheManager"):
        assert not hasattr(vmemkv, old)
    assert not hasattr(CacheStats(), "pages_copied") and not hasattr(PrefixHasher(seed=b"s"), "page_hashes")
    assert issubclass(vmemkv.BlockStateError, vmemkv.InvalidStateError)


def test_the_engine_hashes_every_block_once_through_blocked_admissions_and_recompute():
    """Under memory pressure (waiting requests retried every step, recompute preemptions) the
    engine's sequences hold their token ids in their KVRequest only, and every block hashed is
    hashed once: the hashes made equal the chains the sequences end with."""
    from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model="tiny-llama", max_num_seqs=8, max_model_len=256,
                                    num_blocks=12, preemption_mode="recompute", watermark=0.0))
    hashed = count_hashed_blocks(engine.manager)
    seqs = []
    for i in range(6):
        prompt = [(31 * i + 7 * j) % 250 + 1 for j in range(28 + i)]
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        seqs.append(engine.requests[str(i)])
    blocked = 0
    while engine.has_unfinished_requests():
        blocked += len(engine.scheduler.waiting)
        engine.step()
    assert engine.scheduler.num_preemptions and blocked, "no memory pressure: nothing was retried"
    for seq in seqs:
        assert seq.token_ids is seq.kv.token_ids and not hasattr(seq, "num_manager_tokens")
        assert len(seq.output_token_ids) == 20
    assert hashed[0] == sum(len(seq.kv.block_hashes) for seq in seqs)
    engine.manager.check()
    engine.close()


# --- the state machine, every other request by object -------------------------------------------
class ObjectForm:
    """The manager as the state machine sees it, with requests of odd number (``r1``, ``r3``,
    ...) passed as KVRequest objects: admitted as objects (a re-admission after recompute reuses
    the object, hash chain and all), forked into objects, and named by their object in every
    other call. Everything else is the manager's."""

    PER_REQUEST = {"allocate", "commit", "can_allocate", "blocks_needed", "truncate", "free",
                   "discard", "preempt", "estimate_preemption", "swap_in", "slot_of", "num_tokens",
                   "num_computed_tokens", "block_table", "token_ids", "is_swapped"}

    def __init__(self, manager):
        self._manager = manager
        self._objects: dict[str, KVRequest] = {}

    def _by_object(self, request_id) -> bool:
        return isinstance(request_id, str) and int(request_id[1:]) % 2 == 1

    def _named(self, request_id):
        return self._objects.get(request_id, request_id) if self._by_object(request_id) else request_id

    def __getattr__(self, name):
        attr = getattr(self._manager, name)
        if name in self.PER_REQUEST:
            return lambda request, *args, **kwargs: attr(self._named(request), *args, **kwargs)
        return attr

    def admit(self, request_id, token_ids, **kwargs):
        if not self._by_object(request_id):
            return self._manager.admit(request_id, token_ids, **kwargs)
        req = self._objects.get(request_id)
        if req is None or req.token_ids != list(token_ids):
            req = self._objects[request_id] = KVRequest(request_id, list(token_ids))
        return self._manager.admit(req, **kwargs)

    def fork(self, parent, child, slot=None):
        if self._by_object(child):
            self._objects[child] = KVRequest(child)
        return self._manager.fork(self._named(parent), self._named(child), slot)

    def reorder(self, rows, sources):
        return self._manager.reorder([self._named(r) for r in rows], [self._named(s) for s in sources])

    def allocate_lookahead(self, ids, margin, keep_free=0):
        return self._manager.allocate_lookahead([self._named(r) for r in ids], margin, keep_free)


class ObjectFormMachine(ManagerMachine):
    layout = "token_major"
    steps = 0
    examples = 0
    totals = Counter()

    def __init__(self):
        super().__init__()
        self.m = ObjectForm(self.m)

    @invariant()
    def the_objects_agree_with_the_model(self):
        """An object-driven request's object is the manager's, and its read-only view (tokens,
        reservation, state) is the model's; one waiting for re-admission holds nothing."""
        objects, manager = self.m._objects, self.m._manager
        for request_id, token_ids in self.tokens.items():
            if request_id in objects:
                req = objects[request_id]
                assert manager.request(request_id) is req and req.token_ids == token_ids
                assert req.is_swapped == (request_id in self.swapped)
                assert req.is_running == (request_id not in self.swapped)
                if req.is_running:
                    assert req.num_tokens == req.num_computed_tokens == self.reserved[request_id]
        for request_id in self.waiting:
            if request_id in objects:
                req = objects[request_id]
                assert not req.is_running and not req.is_swapped and req.block_table == ()


TestObjectForm = pytest.mark.slow(ObjectFormMachine.TestCase)
TestObjectForm.settings = settings(SETTINGS, max_examples=max(RUNS // 2, 10))
