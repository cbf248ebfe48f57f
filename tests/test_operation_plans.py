"""The plan an operation executes is the plan its callers are shown (``plans.py``).

``HybridKVCacheManager`` plans each layout group's operation once (``_plan_admit``,
``_plan_grow``, ``_plan_fork``, ``_plan_swap_in``), shows the plans to the mapping budget of both
groups (``hybrid_budget.planned``, ``check_budget``) before either changes, and then has each group
execute the plan it was given (``_execute_admit``, ``_execute_grow``, ...). If the plan budgeted
and the plan carried out ever differed, the budget check would approve mappings nobody makes and
miss the ones made. A random walk over a hybrid model records, per operation and per group, the
plan objects budgeted and executed (the same object), the jobs handed to the budget check, the
jobs the group's mapper is then told to map, the pages behind the window it unmaps, and the pages
the backend actually maps, and asserts they agree. Then: planning changes
nothing, the ``plan_*`` methods check their arguments, and ``fit_or_reclaim``'s three outcomes.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

import vmemkv.hybrid
from conftest import manager_state
from test_hybrid_groups import close, make_hybrid, reads_back, write
from vmemkv import InvalidInputError, KVRequest, MappingLimitError
from vmemkv.plans import fit_or_reclaim
from vmemkv.slots import MapJob

PLANNED_OPERATIONS = ("admit", "allocate", "fork", "swap in")


class Recorder:
    """What a hybrid operation asked the budget for and what each group then did to its slots."""

    def __init__(self, manager, monkeypatch):
        self.groups = {"global": manager.global_group, "local": manager.local_group}
        self.reset()
        check_budget, planned = vmemkv.hybrid.check_budget, vmemkv.hybrid.planned

        def recording_planned(group, plan):
            self.plan_objects[self.name_of(group)] = plan
            return planned(group, plan)

        def recording_check_budget(plans, what):
            for group, jobs, behind in plans:
                self.planned[self.name_of(group)] = (list(jobs), behind)
            self.what = what
            check_budget(plans, what)

        monkeypatch.setattr(vmemkv.hybrid, "check_budget", recording_check_budget)
        monkeypatch.setattr(vmemkv.hybrid, "planned", recording_planned)
        for name, group in self.groups.items():
            self._wrap(name, group.slots, group.backend, monkeypatch)
            self._wrap_execution(name, group, monkeypatch)

    def reset(self) -> None:
        self.what = None
        self.planned: dict[str, tuple[list[MapJob], int]] = {}
        self.plan_objects: dict = {}  # group name -> the Plan shown to the budget
        self.executed: dict = {}  # group name -> the Plan the group carried out
        self.told = {name: [] for name in self.groups}  # MapJobs the mapper was told to map
        self.behind = {name: [] for name in self.groups}  # unmap_behind page counts
        self.backend_pairs = {name: [] for name in self.groups}  # (virtual, physical) mapped
        self._depth = 0

    def name_of(self, group) -> str:
        return next(name for name, g in self.groups.items() if g is group)

    def _wrap_execution(self, name, group, monkeypatch) -> None:
        """Record the plan each group's binding step (admit, fork, swap in) or growth executes."""
        map_and_bind, execute_grow = group._map_and_bind, group._execute_grow

        def recording_map_and_bind(plan):
            self.executed[name] = plan
            return map_and_bind(plan)

        def recording_execute_grow(req, plan, *args):
            self.executed[name] = plan
            return execute_grow(req, plan, *args)

        monkeypatch.setattr(group, "_map_and_bind", recording_map_and_bind)
        monkeypatch.setattr(group, "_execute_grow", recording_execute_grow)

    def _wrap(self, name, slots, backend, monkeypatch) -> None:
        map_blocks, map_jobs, unmap_behind, backend_map = (slots.map_blocks, slots.map_jobs,
                                                           slots.unmap_behind, backend.map)

        def outermost(record, call):  # map_blocks calls map_jobs: record the outer call only
            def wrapper(*args, **kwargs):
                if self._depth == 0:
                    record(*args, **kwargs)
                self._depth += 1
                try:
                    return call(*args, **kwargs)
                finally:
                    self._depth -= 1
            return wrapper

        def record_blocks(slot, first, blocks, keep=0):
            if blocks:
                self.told[name].append(MapJob(slot, first, list(blocks), keep))

        def record_jobs(jobs):
            self.told[name].extend(MapJob(j.slot, j.first, list(j.blocks), j.keep) for j in jobs if j.blocks)

        def record_behind(slot, num_pages, first=0):
            self.behind[name].append((slot, num_pages))

        def recording_backend_map(vrange, virtual, physical):
            backend_map(vrange, virtual, physical)  # recorded only once it succeeded
            self.backend_pairs[name] += zip(np.asarray(virtual).tolist(), np.asarray(physical).tolist())

        monkeypatch.setattr(slots, "map_blocks", outermost(record_blocks, map_blocks))
        monkeypatch.setattr(slots, "map_jobs", outermost(record_jobs, map_jobs))
        monkeypatch.setattr(slots, "unmap_behind", outermost(record_behind, unmap_behind))
        monkeypatch.setattr(backend, "map", recording_backend_map)

    def assert_executed_as_planned(self, binds: bool) -> None:
        """Each group mapped exactly the jobs the budget was asked about; a binding operation
        also unmapped the planned pages behind the window of the planned slot; the backend
        mapped only planned pages, and every planned page maps its planned block now."""
        assert set(self.planned) == set(self.groups), f"{self.what}: not every group was planned"
        for name, group in self.groups.items():
            assert self.executed[name] is self.plan_objects[name], (
                f"{self.what} in the {name} group: executed another plan than the one budgeted")
            jobs, behind = self.planned[name]
            assert self.told[name] == jobs, (
                f"{self.what} in the {name} group: planned {jobs}, mapped {self.told[name]}")
            if binds:
                assert self.behind[name] == [(jobs[0].slot, behind)], (
                    f"{self.what} in the {name} group: planned {behind} pages behind the window of "
                    f"slot {jobs[0].slot}, unmapped {self.behind[name]}")
            planned_virtual, planned_physical = group.slots._job_pages(jobs)
            planned_pairs = set(zip(planned_virtual.tolist(), planned_physical.tolist()))
            assert set(self.backend_pairs[name]) <= planned_pairs, (
                f"{self.what} in the {name} group: the backend mapped pages nobody planned")
            for job in jobs:
                mapped = group.slots.mapped_blocks(job.slot, job.first + len(job.blocks))
                assert mapped[job.first:].tolist() == job.blocks

    def assert_nothing_mapped(self) -> None:
        for name in self.groups:
            assert not self.told[name] and not self.backend_pairs[name], f"{name} group mapped"


def hybrid_walk(manager, recorder: Recorder, rng: random.Random, steps: int) -> Counter:
    """A random walk of admissions (with shared prefixes), decodes, forks, swaps, recomputes and
    frees; right after each planned operation (before its K/V is written and committed, which
    releases pages behind the window), the plan is compared with what was done."""
    running: dict[str, KVRequest] = {}
    swapped: dict[str, KVRequest] = {}
    compared: Counter = Counter()
    for step in range(steps):
        op = rng.choice(["admit", "admit", "decode", "decode", "decode", "fork", "swap", "swap_in",
                         "recompute", "free"])
        name = rng.choice(sorted(running)) if running else None
        recorder.reset()
        computed = None  # the request whose new positions are written and committed after
        if op == "admit":
            prefix = rng.randrange(3)  # three shared prompt heads: prefix hits
            req = KVRequest(f"r{step}", [prefix * 97 + i for i in range(rng.randrange(1, 60))])
            done = manager.admit(req) is not None
            if done:
                running[req.request_id] = computed = req
        elif op == "decode" and name:
            req, count = running[name], rng.choice([1, 1, rng.randrange(2, 24)])  # or a chunk
            done = manager.allocate(req, count, [rng.randrange(40) for _ in range(count)])
            if done:
                computed = req
        elif op == "fork" and name:
            child = manager.fork(running[name], KVRequest(f"r{step}", []))
            done = child is not None
            if done:
                running[child.request_id] = child
        elif op == "swap_in" and swapped:
            key = rng.choice(sorted(swapped))
            done = manager.swap_in(swapped[key])
            if done:
                running[key] = swapped.pop(key)
        else:
            if op == "swap" and name and manager.estimate_preemption(running[name]).swap_fits:
                manager.preempt(running[name], "swap")
                swapped[name] = running.pop(name)
            elif op in ("recompute", "free") and name:
                manager.free(running.pop(name))
            continue
        if done:
            recorder.assert_executed_as_planned(binds=recorder.what != "allocate")
            compared[recorder.what] += any(jobs for jobs, _ in recorder.planned.values())
            compared["behind the window"] += any(behind for _, behind in recorder.planned.values())
        elif recorder.what is None:  # refused before planning (no slot, no block)
            recorder.assert_nothing_mapped()
        if computed is not None:
            write(manager, computed, computed.num_computed_tokens, computed.num_tokens)
            manager.commit(computed)
        manager.check()
    for req in running.values():
        assert reads_back(manager, req)
    return compared


@pytest.mark.parametrize("seed", range(4))
def test_the_hybrid_budget_is_asked_the_plan_each_group_then_executes(seed, monkeypatch):
    manager = make_hybrid(num_blocks=16)
    try:
        recorder = Recorder(manager, monkeypatch)
        compared = hybrid_walk(manager, recorder, random.Random(seed), steps=160)
        # the walk compared plans that map something, of every kind, and windowed ones
        assert all(compared[what] for what in PLANNED_OPERATIONS + ("behind the window",)), compared
    finally:
        monkeypatch.undo()
        close(manager)


def test_a_budget_plan_that_drifted_from_the_groups_is_caught(monkeypatch):
    """The check above can fail: a budget shown a fork plan that names another block for the
    copy of the partial page than the group's fork takes is caught at the first fork."""
    manager = make_hybrid()
    try:
        recorder = Recorder(manager, monkeypatch)
        planned = vmemkv.hybrid.planned

        def drifted_planned(group, plan):
            group, jobs, behind = planned(group, plan)
            other = group.pool.peek(2)[1]
            return group, [MapJob(j.slot, j.first, j.blocks[:-1] + [other], j.keep) for j in jobs], behind

        monkeypatch.setattr(vmemkv.hybrid, "planned", drifted_planned)
        parent = KVRequest("a", list(range(23)))  # a partial last page: the fork copies it
        assert manager.admit(parent) == 0
        write(manager, parent, 0, parent.num_tokens)
        manager.commit(parent)
        recorder.reset()
        assert manager.fork(parent, KVRequest("b", [])) is not None
        with pytest.raises(AssertionError, match="fork in the global group: planned"):
            recorder.assert_executed_as_planned(binds=True)
    finally:
        monkeypatch.undo()
        close(manager)


# --- the plan methods on one manager --------------------------------------------------------------

def test_planning_changes_nothing_and_the_operation_executes_the_plan(make_manager):
    manager = make_manager(num_blocks=12, swap_space_bytes=1 << 20)
    a = KVRequest("a", list(range(10)))  # 4 tokens a page: two full pages and a partial one
    plan = manager.plan_admit([], 10)
    before = manager_state(manager)
    assert manager.plan_admit([], 10) == plan and manager_state(manager) == before
    assert manager.admit(a) == 0
    assert (a.slot, list(a.block_table)) == (plan.slot, plan.mapped) and plan.take == plan.mapped
    manager.commit(a)

    grow = manager.plan_grow(a, 3)  # crosses into a fourth page
    assert manager.plan_grow(a, 1) is None  # stays inside the third
    assert manager.allocate(a, 3, [1, 2, 3])
    assert list(a.block_table) == plan.mapped + grow.take
    assert grow.jobs == [MapJob(a.slot, 3, grow.take, keep=3)] and grow.share == []
    manager.commit(a)

    fork = manager.plan_fork(a)
    b = manager.fork(a, "b")
    assert (b.slot, list(b.block_table)) == (fork.slot, fork.mapped)
    assert fork.share == list(a.block_table[:3]) and fork.take == list(b.block_table[3:])

    assert manager.preempt(b, "swap") == "swap"
    swap_in = manager.plan_swap_in(b)
    before = manager_state(manager)
    assert manager.plan_swap_in(b) == swap_in and manager_state(manager) == before
    assert manager.swap_in(b)
    assert (b.slot, list(b.block_table)) == (swap_in.slot, swap_in.mapped)


def test_plan_methods_check_their_arguments(make_manager):
    manager = make_manager()
    a = KVRequest("a", list(range(6)))
    manager.admit(a)
    manager.commit(a)
    with pytest.raises(InvalidInputError, match="hits must be a list of block ids"):
        manager.plan_admit([99], 8)
    with pytest.raises(InvalidInputError, match="num_tokens"):
        manager.plan_admit([], -1)
    with pytest.raises(InvalidInputError, match="num_new_tokens"):
        manager.plan_grow(a, 1.5)
    with pytest.raises(KeyError, match="no request 'nobody'"):
        manager.plan_fork("nobody")
    with pytest.raises(InvalidInputError, match="slot"):
        manager.plan_fork(a, slot=17)
    with pytest.raises(KeyError, match="not swapped out"):
        manager.plan_swap_in(a)


# --- fit, else reclaim stale mappings, else refuse -------------------------------------------------

class FakeMapper:
    def __init__(self):
        self.reclaimed = []

    def reclaim_stale(self, keep):
        self.reclaimed.append(keep)


def test_fit_or_reclaim_reclaims_only_when_needed_and_refuses_after_that():
    jobs = [MapJob(1, 0, [5, 6]), MapJob(1, 4, [7]), MapJob(2, 0, [8])]
    mapper = FakeMapper()
    fit_or_reclaim(lambda: None, [(mapper, jobs)], "admit")
    assert mapper.reclaimed == []  # it fits: nothing reclaimed

    answers = iter(["short", None])  # fits once stale mappings are gone
    fit_or_reclaim(lambda: next(answers), [(mapper, jobs)], "admit")
    assert mapper.reclaimed == [{1: 5, 2: 1}]  # each slot keeps the most any job keeps

    mapper.reclaimed.clear()
    with pytest.raises(MappingLimitError, match="refused to fork: it needs 3; nothing was changed"):
        fit_or_reclaim(lambda: "it needs 3", [(mapper, jobs)], "fork")
    assert len(mapper.reclaimed) == 1
