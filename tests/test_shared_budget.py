"""One KV memory budget shared by several engines (memory/budget.py): what one member takes the
others cannot; a member killed with SIGKILL, even while it holds the lock, gives its bytes back;
managers drawing on one budget never back more blocks than it pays for, evict their own cached
blocks before refusing, change nothing when they refuse, and never see each other's pages."""

import dataclasses
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import close_manager, read_kv_matches, slot_rows, tiny_config, write_kv
from vmemkv import KVCacheManager
from vmemkv.errors import ConfigError
from vmemkv.memory.budget import SharedKVBudget

FP32 = dict(dtype=torch.float32)


@pytest.fixture
def pool_dir(tmp_path, monkeypatch):
    """Budgets of this test live in its own directory (``$VMEMKV_KV_POOL_DIR``)."""
    monkeypatch.setenv("VMEMKV_KV_POOL_DIR", str(tmp_path))
    return tmp_path


def name() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def admit_written(manager, request_id, tokens):
    cached = manager.admit(request_id, tokens)
    if cached is not None:
        write_kv(manager, request_id, cached, len(tokens))
        manager.commit(request_id)
    return cached


def backed_bytes(manager) -> int:
    return manager.kv_bytes_resident


# --- the budget alone ---------------------------------------------------------------------------
def test_members_take_from_one_total_and_leaving_gives_back(pool_dir):
    pool = name()
    a, b = SharedKVBudget(pool, 1000), SharedKVBudget(pool)
    try:
        assert a.take(600) == 600
        assert b.take(600) == 0  # all or nothing by default
        assert b.take(600, need=300) == 400  # at least need, at most what is free
        assert a.stats() == {"total_bytes": 1000, "used_bytes": 1000, "held_bytes": 600, "members": 2}
        a.give(100)
        assert b.take(100) == 100 and b.held == 500
        a.close()
        assert b.free_bytes() == 500 and b.stats()["members"] == 1
    finally:
        a.close()
        b.close()


def test_a_second_member_must_agree_on_the_size(pool_dir):
    pool = name()
    with pytest.raises(ConfigError, match="does not exist yet"):
        SharedKVBudget(pool)
    a = SharedKVBudget(pool, 1000)
    try:
        with pytest.raises(ConfigError, match="holds 1000 bytes"):
            SharedKVBudget(pool, 2000)
        with pytest.raises(ConfigError, match="letters, digits"):
            SharedKVBudget("../etc", 10)
        with pytest.raises(ValueError, match="giving back"):
            a.give(1)
        with pytest.raises(ConfigError, match="VMEMKV_KV_POOL_DIR"):
            SharedKVBudget(pool, 1000, directory=str(pool_dir / "missing"))
    finally:
        a.close()


CHILD = textwrap.dedent("""
    import fcntl, sys, time
    from vmemkv.memory.budget import SharedKVBudget
    budget = SharedKVBudget(sys.argv[1])
    assert budget.take(int(sys.argv[2])) == int(sys.argv[2])
    if sys.argv[3] == "hold-lock":
        fcntl.flock(budget._fd, fcntl.LOCK_EX)  # dies inside the critical section
    print("ready", flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("where", ["idle", "hold-lock"])
def test_a_killed_members_bytes_come_back(pool_dir, where):
    pool = name()
    survivor = SharedKVBudget(pool, 1000)
    child = subprocess.Popen([sys.executable, "-c", CHILD, pool, "700", where], stdout=subprocess.PIPE,
                             env={**os.environ, "VMEMKV_KV_POOL_DIR": str(pool_dir)}, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        if where == "idle":
            assert survivor.take(500) == 0  # the live child holds 700
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        assert survivor.take(1000) == 1000  # its 700 came back (and its lock went with it)
        assert survivor.stats()["members"] == 1
    finally:
        if child.poll() is None:
            child.kill()
        survivor.close()


# --- managers drawing on one budget ---------------------------------------------------------------
def budget_config(pool, total_blocks, **overrides):
    config = tiny_config(**FP32, **overrides)
    block_bytes = config.make_layout().block_bytes
    return tiny_config(**FP32, kv_pool=pool, kv_pool_bytes=total_blocks * block_bytes, **overrides)


@pytest.fixture
def budget_managers(pool_dir):
    """``make(pool, total_blocks, **overrides)``: a manager on the budget ``pool``, checked and
    closed when the test ends."""
    managers = []

    def make(pool, total_blocks, **overrides):
        managers.append(KVCacheManager(budget_config(pool, total_blocks, **overrides)))
        return managers[-1]

    yield make
    for manager in managers:
        close_manager(manager)


def test_a_manager_backs_no_more_than_its_share_and_gives_it_back(budget_managers):
    pool = name()
    manager = budget_managers(pool, 6, num_blocks=16, max_model_len=64)
    assert manager.num_free_blocks == 6  # the pool has 16, the budget pays for 6
    assert admit_written(manager, "a", list(range(1, 18))) == 0  # 5 blocks
    assert manager.admit("b", list(range(100, 110))) is None  # 3 more: refused
    stats = manager.snapshot_stats()
    assert stats["kv_pool_share_bytes"] <= 6 * manager.block_bytes
    manager.free("a")
    assert manager.release_free_memory(cached=True) == 5 * manager.block_bytes
    assert manager.snapshot_stats()["kv_pool_share_bytes"] == 0
    manager.check()
    close_manager(manager)
    joined = SharedKVBudget(pool)
    assert joined.free_bytes() == 6 * manager.block_bytes  # closing gave it all back
    joined.close()


def test_under_the_budget_a_manager_evicts_its_own_cached_blocks_first(budget_managers):
    pool = name()
    manager = budget_managers(pool, 6, num_blocks=16, max_model_len=64)
    admit_written(manager, "a", list(range(1, 18)))  # 4 full blocks cached when it ends
    manager.free("a")
    assert manager.snapshot_stats()["blocks_cached"] == 4
    # 5 blocks: the clean one, one the budget's room backs, then 3 from the cache
    assert admit_written(manager, "b", list(range(100, 117))) == 0
    assert manager.snapshot_stats()["evictions"] == 3
    assert backed_bytes(manager) <= 6 * manager.block_bytes
    manager.check()
    manager.free("b")


def test_a_hybrid_engines_memories_share_the_budgets_last_bytes(pool_dir):
    """An attention memory growing its share first leaves the state memory what the same fork
    needs: the fork that fits the budget runs."""
    from test_state_cache import SPEC, make_manager
    pool = name()
    config = dataclasses.replace(make_manager().config, kv_pool=pool, kv_pool_bytes=64 * 4096)
    with KVCacheManager(config, layer_windows=[SPEC, None, SPEC, None]) as manager:
        assert [memory.budget_block_bytes for memory in manager.memories] == [4096, 4096]
        manager.admit("a", list(range(20)))  # 2 attention blocks, 1 state block
        manager.commit("a")
        manager.release_free_memory()  # no share beyond the blocks backed
        other = SharedKVBudget(pool)
        try:
            other.take(other.free_bytes() - 2 * 4096)  # room for the fork's 1 + 1 blocks, no more
            assert manager.fork("a", "b") is not None, manager.last_refusal
            assert manager.fork("a", "c") is None  # the budget has nothing left
            assert manager.last_refusal.reason == "out_of_blocks"
            manager.check()
        finally:
            other.close()


def test_two_managers_never_see_each_others_pages(budget_managers):
    pool = name()
    a, b = (budget_managers(pool, 12, num_blocks=12, max_model_len=64) for _ in range(2))
    tokens = list(range(1, 20))  # 5 blocks in each
    admit_written(a, "r", tokens)
    assert b.admit("r", tokens) == 0  # no hit across engines
    slot = b.slot_of("r")
    assert not any(slot_rows(b, layer, kv, slot)[: len(tokens)].any()  # b's fresh pages: zeros,
                   for layer in range(b.config.num_layers) for kv in range(2))  # not a's bytes
    write_kv(b, "r", 0, len(tokens))
    b.commit("r")
    assert read_kv_matches(a, "r") and read_kv_matches(b, "r")
    assert backed_bytes(a) + backed_bytes(b) <= 12 * a.block_bytes
    a.free("r")
    b.free("r")


ENGINE_CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[3])
    from conftest import tiny_config
    from vmemkv import KVCacheManager
    import torch
    manager = KVCacheManager(tiny_config(dtype=torch.float32, num_blocks=12, max_model_len=64,
                                         kv_pool=sys.argv[1], kv_pool_bytes=int(sys.argv[2])))
    assert manager.admit("r", list(range(1, 40))) == 0  # 10 blocks backed
    print("ready", flush=True)
    time.sleep(60)
""")


def test_a_killed_engines_pages_come_back_to_the_others(budget_managers, pool_dir):
    pool = name()
    block_bytes = tiny_config(**FP32).make_layout().block_bytes
    child = subprocess.Popen([sys.executable, "-c", ENGINE_CHILD, pool, str(12 * block_bytes),
                              str(Path(__file__).parent)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "VMEMKV_KV_POOL_DIR": str(pool_dir)})
    try:
        assert child.stdout.readline().strip() == "ready"
        survivor = budget_managers(pool, 12, num_blocks=12, max_model_len=64)
        assert survivor.admit("a", list(range(100, 139))) is None  # 10 blocks: 2 are left
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        assert admit_written(survivor, "a", list(range(100, 139))) == 0  # the dead one's came back
        survivor.check()
        survivor.free("a")
    finally:
        if child.poll() is None:
            child.kill()


def snapshot(manager):
    stats = manager.snapshot_stats()
    return ({rid: (manager.block_table(rid), manager.num_tokens(rid)) for rid in manager.request_ids()},
            stats["blocks_in_use"], stats["blocks_cached"], stats["blocks_clean"], stats["blocks_backed"])


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_managers_sharing_a_budget_stay_within_it_and_refusals_change_nothing(seed):
    """Two managers on one budget smaller than both pools: random admissions (sharing system
    prompts), appends, forks, frees and give-backs (with and without the cached blocks). After
    every step the blocks backed in both are within the budget, the budget counts exactly what
    each backs plus its unused share, every running request reads back its own bytes, and a
    refused operation left its manager as it was."""
    import tempfile
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as directory:
        os.environ["VMEMKV_KV_POOL_DIR"] = directory
        try:
            pool = name()
            config = budget_config(pool, 20, num_blocks=16, max_num_seqs=6, max_model_len=40)
            managers = [KVCacheManager(config), KVCacheManager(config)]
            run_walk(rng, managers, 20 * managers[0].block_bytes)
        finally:
            del os.environ["VMEMKV_KV_POOL_DIR"]


def run_walk(rng, managers, total):
    live = [[], []]
    systems = [list(range(1000 * s, 1000 * s + 8)) for s in range(3)]
    fresh = iter(range(10**6, 10**7))
    try:
        for step in range(40):
            i = rng.randrange(2)
            manager, mine = managers[i], live[i]
            before = snapshot(manager)
            op = rng.choice(["admit", "admit", "grow", "fork", "free", "give_back"])
            refused = False
            if op == "admit" and manager.num_free_slots:
                rid = f"r{step}"
                tokens = rng.choice(systems) + [next(fresh) for _ in range(rng.randint(1, 20))]
                refused = admit_written(manager, rid, tokens) is None
                if not refused:
                    mine.append(rid)
            elif op == "grow" and mine:
                rid = rng.choice(mine)
                if manager.num_tokens(rid) < 39:
                    refused = not manager.allocate(rid, 1, [next(fresh)])
                    if not refused:
                        write_kv(manager, rid, manager.num_tokens(rid) - 1, manager.num_tokens(rid))
                        manager.commit(rid)
            elif op == "fork" and mine and manager.num_free_slots:
                child = manager.fork(rng.choice(mine), f"f{step}")
                refused = child is None
                if not refused:
                    mine.append(child.request_id)
            elif op == "free" and mine:
                manager.free(mine.pop(rng.randrange(len(mine))))
            elif op == "give_back":
                manager.release_free_memory(keep_blocks=rng.choice([0, 1]), cached=rng.random() < 0.5)
            if refused:
                assert snapshot(manager) == before, op
            for m, rids in zip(managers, live):
                m.check()
                assert all(read_kv_matches(m, rid) for rid in rids)
            assert sum(backed_bytes(m) for m in managers) <= total
            shares = [m.snapshot_stats()["kv_pool_share_bytes"] for m in managers]
            assert all(share >= backed_bytes(m) for share, m in zip(shares, managers))
            assert managers[0].snapshot_stats()["kv_pool_used_bytes"] == sum(shares) <= total
    finally:
        for m in managers:
            close_manager(m)


# --- what a user can get wrong -------------------------------------------------------------------
@pytest.mark.parametrize("size", [2**64, -1, 0, 1.5, "1000"])
def test_a_size_the_pool_cannot_hold_is_refused_before_any_file_is_made(pool_dir, size):
    pool = name()
    with pytest.raises(ConfigError, match=r"kv_pool_bytes \(--kv-pool-bytes\) must be .* 1 to "
                                          r"18446744073709551615"):
        SharedKVBudget(pool, size)
    assert list(pool_dir.iterdir()) == []
    with pytest.raises(ConfigError, match="does not exist yet"):  # not a 0-byte budget
        SharedKVBudget(pool)


def test_a_budget_smaller_than_one_block_is_refused_with_what_a_block_needs(pool_dir):
    pool = name()
    with pytest.raises(ConfigError, match=rf"--kv-pool-bytes\) 1000 for KV pool '{pool}' \(.*{pool}\) "
                                          r"is less than one KV block of this engine \(4096 bytes\).*"
                                          r"give at least 4096"):
        SharedKVBudget(pool, 1000, block_bytes=4096)
    assert list(pool_dir.iterdir()) == []
    small = SharedKVBudget(pool, 1000)  # made by an engine of smaller blocks
    try:
        with pytest.raises(ConfigError, match=rf"KV pool '{pool}' \({pool_dir}/\S+{pool}\) holds 1000 "
                                              r"bytes, less than one KV block of this engine \(4096 "
                                              r"bytes\).*remove .* kv_pool_bytes of at least 4096"):
            SharedKVBudget(pool, block_bytes=4096)
        assert small.stats()["members"] == 1  # the refused engine did not join
    finally:
        small.close()


def test_an_engine_on_a_budget_of_zero_bytes_is_refused_at_start(pool_dir):
    """A header whose total is 0 (written by an older version that did not check the size)."""
    pool = name()
    SharedKVBudget(pool, 1).close()
    path = pool_dir / f"vmemkv-kv-pool-{pool}"
    with open(path, "r+b") as file:
        file.seek(8)
        file.write((0).to_bytes(8, "little"))
    with pytest.raises(ConfigError, match=rf"\({path}\) holds 0 bytes, less than one KV block"):
        KVCacheManager(tiny_config(**FP32, kv_pool=pool))


def test_a_manager_on_a_budget_below_one_block_is_refused_and_leaves_nothing(pool_dir):
    block_bytes = tiny_config(**FP32).make_layout().block_bytes
    with pytest.raises(ConfigError, match=f"less than one KV block of this engine \\({block_bytes} bytes"):
        KVCacheManager(tiny_config(**FP32, kv_pool=name(), kv_pool_bytes=1000))
    assert list(pool_dir.iterdir()) == []


def test_a_free_row_holding_bytes_is_reclaimed(pool_dir):
    """A row of pid 0 is free: bytes counted there belong to no one and come back when short."""
    pool = name()
    budget = SharedKVBudget(pool, 1000)
    try:
        with budget._locked():
            budget._set_row(budget.index + 1, 0, 700)
        assert budget.free_bytes() == 300
        assert budget.take(1000) == 1000
        assert budget.stats() == {"total_bytes": 1000, "used_bytes": 1000, "held_bytes": 1000, "members": 1}
    finally:
        budget.close()


def test_a_file_that_is_not_a_pool_is_refused_with_its_path(pool_dir):
    pool = name()
    path = pool_dir / f"vmemkv-kv-pool-{pool}"
    path.write_bytes(b"vmemkvB1")  # shorter than a header and its rows
    with pytest.raises(ConfigError, match=rf"{path} holds 8 bytes, less than a KV pool's .*remove {path}"):
        SharedKVBudget(pool)
    path.write_bytes(b"x" * 4096)
    with pytest.raises(ConfigError, match=rf"{path} is not a vmemkv KV pool .*remove {path}"):
        SharedKVBudget(pool, 1000)


def test_a_member_lock_that_cannot_be_opened_is_named_and_the_pool_stays_uncreated(pool_dir):
    pool = name()
    lock = pool_dir / f"vmemkv-kv-pool-{pool}.member0"
    lock.mkdir()
    with pytest.raises(ConfigError, match=rf"cannot open {lock}, the lock file of row 0 .*remove it"):
        SharedKVBudget(pool, 1000)
    with pytest.raises(ConfigError, match="does not exist yet"):  # the refused create left no pool
        SharedKVBudget(pool)
    lock.rmdir()
    budget = SharedKVBudget(pool, 2000)
    assert budget.total_bytes == 2000
    budget.close()


def test_the_cli_answers_a_size_too_large_with_the_option_and_its_limit(pool_dir, capsys):
    from vmemkv.cli import main
    assert main(["generate", "--model", "tiny-llama", "--device", "cpu", "--prompt", "hi", "--max-tokens", "2",
                 "--kv-pool", name(), "--kv-pool-bytes", str(2**64)]) == 2
    assert "--kv-pool-bytes) must be a whole number of bytes from 1 to 18446744073709551615" \
        in capsys.readouterr().err
    assert list(pool_dir.iterdir()) == []


# --- an engine that stops cleanly gives its row back at once ---------------------------------------
def test_closing_an_llm_gives_its_share_back(pool_dir):
    from vmemkv.engine import LLM, SamplingParams
    pool, total = name(), 64 << 20
    with LLM(max_num_seqs=2, max_model_len=64, kv_pool=pool, kv_pool_bytes=total,
             kv_idle_release_s=600) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
        joined = SharedKVBudget(pool)
        assert joined.free_bytes() < total  # the engine holds a share
    assert joined.free_bytes() == total  # given back, not waiting for a reaper
    llm.close()  # again: nothing to do
    joined.close()


def free_port() -> int:
    """A free TCP port of 127.0.0.1 in 8720-8739 (the range these tests may use)."""
    import socket
    for port in range(8720, 8740):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.skip("no free port in 8720-8739")


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_server_stopped_with_a_signal_gives_its_share_back(pool_dir, stop):
    pytest.importorskip("uvicorn", reason="serve needs uvicorn")
    pytest.importorskip("fastapi", reason="serve needs fastapi")
    httpx = pytest.importorskip("httpx")
    pool, total, port = name(), 64 << 20, free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys; from vmemkv.cli import main; sys.exit(main())", "serve",
         "--device", "cpu", "--port", str(port), "--max-num-seqs", "2", "--max-model-len", "64",
         "--kv-pool", pool, "--kv-pool-bytes", str(total), "--kv-idle-release-s", "600"],
        env={**os.environ, "VMEMKV_KV_POOL_DIR": str(pool_dir)}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    joined = None
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            assert server.poll() is None, server.stderr.read()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        answer = httpx.post(f"{url}/v1/completions", timeout=60,
                            json={"model": "tiny-llama", "prompt": "hello", "max_tokens": 2})
        assert answer.status_code == 200, answer.text
        joined = SharedKVBudget(pool)
        assert joined.free_bytes() < total  # the server holds a share
        server.send_signal(stop)
        server.wait(timeout=60)
        assert joined.free_bytes() == total  # given back as it stopped, not reaped later
        assert "Traceback" not in server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        if joined is not None:
            joined.close()
