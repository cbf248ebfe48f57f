"""``--policy lpm``: the scheduler admits the waiting request with the longest cached prefix first,
priority still first; a request passed over ``lpm_max_passed_over`` steps goes next; only the
first ``lpm_window`` waiting requests are ranked; a waiting request is hashed once, not every
step; requests sharing a prefix that is being computed wait for it and hit it.

Scheduler specs run the real scheduler on a real KV cache manager (4-token pages), a step being
"schedule, commit what was scheduled, finish it" (every request generates one token). Engine
tests count prefill tokens and compare greedy tokens with Hugging Face ``generate``."""

from __future__ import annotations

import itertools

import pytest

from conftest import assert_no_leaks, close_manager, tiny_config
from test_engine_correctness import hf_greedy, NEW_TOKENS
from vmemkv import KVCacheManager, KVRequest
from vmemkv.cli import build_parser, engine_config_from_args
from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
from vmemkv.engine.core.scheduler import Scheduler
from vmemkv.engine.core.sequence import Sequence
from vmemkv.errors import ConfigError

PAGE = 4  # tokens per page of tiny_config
PREFIX = list(range(1, 17))  # 4 pages: cached by `warm`


# --- scheduler specs on a real manager ---------------------------------------------------------------
@pytest.fixture
def make():
    """make(policy="lpm", slots=1, **engine) -> Scheduler on a fresh manager (closed afterwards)."""
    managers = []

    def build(policy: str = "lpm", slots: int = 1, num_blocks: int = 64, **engine) -> Scheduler:
        manager = KVCacheManager(tiny_config(num_blocks=num_blocks, max_num_seqs=slots,
                                             max_model_len=128))
        managers.append(manager)
        fields = dict(max_num_seqs=slots, max_model_len=128, max_num_batched_tokens=256,
                      watermark=0.0, policy=policy)
        return Scheduler(EngineConfig(**{**fields, **engine}), manager)

    yield build
    for manager in managers:
        assert_no_leaks(manager)
        close_manager(manager)


_arrivals = itertools.count()


def request(name: str, tokens: list[int], priority: int = 0) -> Sequence:
    return Sequence(KVRequest(name, list(tokens)), name, None, SamplingParams(max_tokens=1), len(tokens),
                    priority=priority, arrival_time=float(next(_arrivals)))


def unique(seed: int, length: int = 18) -> list[int]:
    """Tokens that share no page with PREFIX nor with another seed's."""
    return [100 + seed] + [(seed * 7 + j) % 90 + 1 for j in range(length - 1)]


def step(scheduler: Scheduler, commit: bool = True) -> list[str]:
    """One step: schedule; commit and finish what was admitted (commit=False: a prefill under way
    that never completes, so its blocks stay in flight). Returns the ids admitted, in order."""
    before = set(scheduler.running)
    out = scheduler.schedule()
    assert not out.failed
    admitted = [item.seq for item in out.scheduled if item.seq not in before]
    if commit:
        for item in out.scheduled:
            scheduler.manager.commit(item.seq.kv)
            scheduler.remove(item.seq)
    return [seq.request_id for seq in admitted]


def run_all(scheduler: Scheduler) -> list[str]:
    order = []
    while scheduler.waiting:
        admitted = step(scheduler)
        assert admitted, "a step with requests waiting admitted no one"
        order += admitted
    return order


def warm(scheduler: Scheduler) -> None:
    """Compute PREFIX once, so its 4 pages are in the prefix cache."""
    scheduler.add(request("warm", PREFIX + [99, 98]))
    assert step(scheduler) == ["warm"]


def drain(scheduler: Scheduler) -> None:
    for seq in list(scheduler.running) + list(scheduler.waiting):
        scheduler.remove(seq)


@pytest.mark.parametrize("policy,expected", [("lpm", ["B", "C", "X1", "X2"]),
                                             ("fcfs", ["X1", "B", "X2", "C"])])
def test_lpm_admits_the_longest_cached_prefix_first(make, policy, expected):
    scheduler = make(policy)
    warm(scheduler)
    for seq in (request("X1", unique(1)), request("B", PREFIX + [50, 51, 52]),
                request("X2", unique(2)), request("C", PREFIX[:8] + unique(3))):
        scheduler.add(seq)  # B hits 4 pages, C 2, X1 and X2 none
    assert run_all(scheduler) == expected


def test_priority_ranks_above_the_cached_prefix(make):
    scheduler = make()
    warm(scheduler)
    scheduler.add(request("B-low", PREFIX + [50, 51], priority=1))
    scheduler.add(request("X-high", unique(1), priority=0))  # lower value: higher priority
    scheduler.add(request("C-low", PREFIX[:8] + unique(2), priority=1))
    assert run_all(scheduler) == ["X-high", "B-low", "C-low"]


def stream_past_x(scheduler: Scheduler) -> list[str]:
    """X (nothing cached) arrives first; then a request hitting the cache arrives every step, 8
    in all. Returns the admission order over those 8 steps."""
    warm(scheduler)
    scheduler.add(request("X", unique(1)))
    order = []
    for i in range(8):
        scheduler.add(request(f"B{i}", PREFIX + [50, i + 1]))
        order += step(scheduler)
    return order


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_a_request_passed_over_bound_steps_goes_next(make, bound):
    """X is overtaken in exactly ``bound`` steps, then admitted before every later arrival."""
    scheduler = make(lpm_max_passed_over=bound)
    order = stream_past_x(scheduler) + run_all(scheduler)
    assert order.index("X") == bound
    assert order == [f"B{i}" for i in range(bound)] + ["X"] + [f"B{i}" for i in range(bound, 8)]


def test_without_a_bound_the_cache_keeps_winning(make):
    scheduler = make(lpm_max_passed_over=100)
    assert stream_past_x(scheduler) == [f"B{i}" for i in range(8)]
    assert run_all(scheduler) == ["X"]


def test_the_overdue_request_blocks_later_ones_until_it_fits(make):
    """Overdue X does not fit (the pool is short); nobody behind it is admitted meanwhile."""
    scheduler = make(slots=2, num_blocks=12, lpm_max_passed_over=1)
    warm(scheduler)
    hog = request("hog", unique(9, 24))  # 6 blocks, held (never committed) while it runs
    scheduler.add(hog)
    assert step(scheduler, commit=False) == ["hog"]
    scheduler.add(request("X", unique(1, 28)))  # 7 blocks: fits only once hog is gone
    scheduler.add(request("B", PREFIX + [50, 51]))  # 1 new block: fits now
    assert step(scheduler, commit=False) == ["B"]  # X passed over once: overdue
    scheduler.manager.commit(scheduler.running[-1].kv)
    scheduler.remove(scheduler.running[-1])
    scheduler.add(request("B2", PREFIX + [50, 52]))
    assert step(scheduler, commit=False) == []  # X goes first and does not fit: B2 waits
    scheduler.remove(hog)
    assert run_all(scheduler) == ["X", "B2"]


def test_requests_sharing_a_prefix_being_computed_wait_and_hit_it(make):
    scheduler = make(slots=4)
    shared = unique(5, 16)  # 4 pages nobody has computed
    seqs = [request(f"S{i}", shared + [60 + i, 70 + i]) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    assert step(scheduler) == ["S0"]  # the others wait for its pages
    assert step(scheduler) == ["S1", "S2"]
    assert [seq.num_cached_tokens for seq in seqs] == [0, 16, 16]


def test_a_held_back_request_counts_toward_the_bound(make):
    """R's prefill never completes here; W, sharing its pages, is held back ``bound`` steps, then
    admitted anyway (computing them itself)."""
    scheduler = make(slots=2, lpm_max_passed_over=3)
    shared = unique(5, 16)
    scheduler.add(request("R", shared + [61, 62]))
    scheduler.add(request("W", shared + [71, 72]))
    assert step(scheduler, commit=False) == ["R"]
    assert step(scheduler, commit=False) == []
    assert step(scheduler, commit=False) == []
    assert step(scheduler, commit=False) == ["W"]
    assert scheduler.running[-1].num_cached_tokens == 0
    drain(scheduler)


def test_only_the_window_is_ranked_and_a_waiting_request_is_hashed_once(make):
    scheduler = make(lpm_window=2)
    warm(scheduler)
    hashed = []
    scheduler.manager.hasher.block_hashes = counting(scheduler.manager.hasher.block_hashes, hashed)
    x1, x2, b = request("X1", unique(1)), request("X2", unique(2)), request("B", PREFIX + [50])
    for seq in (x1, x2, b):
        scheduler.add(seq)
    assert step(scheduler) == ["X1"]  # B is third: not ranked yet, not even hashed
    assert b.kv.block_hashes == ()
    assert step(scheduler) == ["B"]
    assert step(scheduler) == ["X2"]
    # every block of every request hashed once: X1, X2 4 each, B's 4 hit PREFIX's chain
    assert len(hashed) == len(set(hashed)) == 4 + 4 + 4


def counting(block_hashes, hashed: list):
    def wrapper(*args, **kwargs):
        result = block_hashes(*args, **kwargs)
        hashed.extend(result)
        return result
    return wrapper


def test_waiting_requests_are_not_rehashed_while_they_wait(make):
    """Five requests wait many steps (the pool is short); their pages were hashed once."""
    scheduler = make(slots=2, num_blocks=12)
    hog = request("hog", unique(9, 40))  # 10 of 12 blocks while it runs
    scheduler.add(hog)
    assert step(scheduler, commit=False) == ["hog"]
    hashed = []
    scheduler.manager.hasher.block_hashes = counting(scheduler.manager.hasher.block_hashes, hashed)
    for i in range(5):
        scheduler.add(request(f"W{i}", unique(i, 17)))  # 4 full pages + 1 token: 5 blocks
    for _ in range(10):
        assert step(scheduler, commit=False) == []
    assert len(hashed) == 5 * 4
    drain(scheduler)


# --- engine: compute a shared prefix once; greedy tokens equal HF -----------------------------------
def prefill_counter(engine: LLMEngine) -> list[int]:
    """[prompt tokens computed]: counted from every step's schedule."""
    counted = [0]
    schedule = engine.scheduler.schedule

    def wrapper():
        out = schedule()
        for item in out.scheduled:
            done = item.seq.num_computed
            counted[0] += max(0, min(item.seq.num_prompt_tokens, done + item.num_new_tokens) - done)
        return out

    engine.scheduler.schedule = wrapper
    return counted


def run_against_hf(engine: LLMEngine, prompts: list[list[int]]) -> list[str]:
    """Run greedy requests to the end; every one's tokens equal HF's, and nothing is left held.
    Returns the request ids in the order they finished."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    for i, prompt in enumerate(prompts):
        assert final[str(i)].outputs[0].token_ids == hf_greedy("tiny-llama", tuple(prompt))
    engine.manager.check()
    assert engine.manager.num_blocks_in_use == 0
    return list(final)


@pytest.mark.parametrize("policy,kv_backend", [("lpm", "vmem"), ("lpm", "paged"), ("fcfs", "vmem")])
def test_a_shared_uncached_system_prompt_is_computed_once(policy, kv_backend):
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_num_seqs=8, max_model_len=256,
                                    policy=policy, kv_backend=kv_backend))
    assert engine.manager.tokens_per_page == 16
    system = [(11 * j) % 250 + 1 for j in range(64)]  # 4 pages
    prompts = [system + [(5 * i + j) % 250 + 1 for j in range(8)] for i in range(6)]
    counted = prefill_counter(engine)
    run_against_hf(engine, prompts)
    questions = 6 * 8
    assert counted[0] == (64 + questions if policy == "lpm" else 6 * 64 + questions)
    engine.close()


def test_lpm_greedy_tokens_equal_hf_under_cache_pressure():
    """Three groups arriving interleaved, one slot, a pool that keeps about one prefix: lpm serves
    the cached group first (the finish order is not the arrival order) and hits more than FCFS
    would; every request's tokens equal HF's."""
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_num_seqs=1, max_model_len=256,
                                    num_blocks=10, max_num_batched_tokens=96, policy="lpm",
                                    lpm_max_passed_over=2))
    systems = [[(13 * j + g) % 250 + 1 for j in range(48)] for g in range(3)]
    # (questions whose greedy tokens never reach eos: HF's min_new_tokens bans it, ignore_eos not)
    prompts = [systems[i % 3] + [(3 * i + 5 * j) % 250 + 1 for j in range(6 + i)] for i in range(8)]
    finished = run_against_hf(engine, prompts)
    assert finished != sorted(finished)  # reordered by the cache
    # FCFS hits one page each for requests 3-7 on this pool (80 tokens): lpm hits 5 x 3 pages
    assert engine.manager.cache_stats().prefix_hit_tokens == 5 * 48
    engine.close()


# --- configuration -----------------------------------------------------------------------------------
def test_cli_policy_lpm_and_its_knobs():
    args = build_parser().parse_args(["generate", "--model", "tiny-llama", "--policy", "lpm",
                                      "--lpm-max-passed-over", "3", "--lpm-window", "16",
                                      "--prompt", "hi"])
    config = engine_config_from_args(args)
    assert (config.policy, config.lpm_max_passed_over, config.lpm_window) == ("lpm", 3, 16)


@pytest.mark.parametrize("fields", [dict(policy="longest"), dict(lpm_max_passed_over=-1),
                                    dict(lpm_window=0), dict(lpm_window=2.5)])
def test_bad_lpm_settings_are_refused(fields):
    with pytest.raises(ConfigError):
        EngineConfig(**fields)


# --- the A/B harness: the prefix-groups workload, the same policy for every variant --------------
@pytest.mark.parametrize("quick", [True, False])
def test_prefix_groups_pool_is_smaller_than_the_groups_working_set(quick):
    from vmemkv.ab.workloads import make_workload, pages

    workload = make_workload("prefix-groups", quick=quick)
    page, engine = workload.tokens_per_page, workload.engine
    groups: dict[str, list[list[int]]] = {}
    for request_id, ids, _ in workload.requests:
        groups.setdefault(request_id.rsplit("-", 1)[0], []).append(ids)
    shared = {name: next(n for n in range(len(group[0]), 0, -1)
                         if all(ids[:n] == group[0][:n] for ids in group))
              for name, group in groups.items()}
    system_pages = {name: n // page for name, n in shared.items()}
    assert len(groups) >= 4 and min(system_pages.values()) >= 4
    longest = max(pages(len(ids) + p.max_tokens, page) for _, ids, p in workload.requests)
    assert engine["num_blocks"] >= engine["max_num_seqs"] * longest  # every slot can run
    # but not every group's prefix (and the running requests' own pages) at once
    own_pages = longest - min(system_pages.values())
    working_set = sum(system_pages.values()) + engine["max_num_seqs"] * own_pages
    assert engine["num_blocks"] < working_set
    order = [request_id.rsplit("-", 1)[0] for request_id, _, _ in workload.requests]
    assert all(a != b for a, b in zip(order, order[1:]))  # groups take turns


def test_ab_runs_every_variant_under_the_policy_asked_and_lpm_hits_more():
    from vmemkv.ab.runner import run_experiment

    hit_rate = {}
    for policy in ("fcfs", "lpm"):
        result = run_experiment(["prefix-groups"], ["vmem", "paged"], repeats=1, quick=True,
                                progress=False, policy=policy)
        assert result["config"]["policy"] == policy and not result["failures"]
        per_variant = result["results"]["prefix-groups"]
        assert per_variant["paged"]["tokens_equal"]
        hit_rate[policy] = per_variant["vmem"]["metrics"]["prefix_hit_rate"]["median"]
    assert hit_rate["lpm"] > hit_rate["fcfs"]
