"""Scheduling policies are classes in one registry (``engine/core/policies.py``) that the CLI, the
config check and ``vmemkv ab`` read; a user sets a request's priority as in vLLM:
``LLM.generate(..., priority=[...])`` and ``"priority"`` in the OpenAI bodies, lower value first,
ties by arrival, the highest value preempted first, and only under ``--policy priority``.

Order is observed through the policy's own hooks: ``admitted`` (with one slot, admission is
one request at a time) and ``victim`` (whom a page shortage preempts)."""

from __future__ import annotations

import argparse
import threading
import time

import pytest

from test_engine_correctness import hf_greedy
from vmemkv.ab.cli import add_ab_arguments
from vmemkv.cli import build_parser
from vmemkv.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from vmemkv.engine.core.policies import POLICIES, PriorityNotSupportedError
from vmemkv.errors import ConfigError, InvalidInputError

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def prompt(seed: int, length: int = 15) -> list[int]:
    return [(37 * seed + 5 * j) % 250 + 1 for j in range(length)]


def record(engine: LLMEngine, hook: str) -> list[str]:
    """The request ids the scheduling policy's ``hook`` saw (``admitted``) or chose (``victim``)."""
    policy, seen = engine.scheduler.policy, []
    original = getattr(policy, hook)

    def spy(*args):
        result = original(*args)
        seen.append((result if hook == "victim" else args[0]).request_id)
        return result

    setattr(policy, hook, spy)
    return seen


# --- the registry ------------------------------------------------------------------------------------
def test_every_registered_policy_is_a_choice_of_both_clis_and_a_valid_config():
    assert list(POLICIES) == ["fcfs", "priority", "lpm"]
    generate = build_parser().parse_args(["generate", "--prompt", "hi", "--policy", "priority"])
    assert generate.policy == "priority"
    ab = argparse.ArgumentParser()
    add_ab_arguments(ab)
    for name in POLICIES:
        assert ab.parse_args(["--policy", name]).policy == name
        assert EngineConfig(policy=name).policy == name
    with pytest.raises(ConfigError, match="fcfs, priority or lpm"):
        EngineConfig(policy="sjf")


# --- LLM.generate(priority=...) ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def priority_llm():
    return LLM("tiny-llama", policy="priority", max_num_seqs=1, max_model_len=128, threads=1)


def test_lower_priority_value_is_admitted_first_and_ties_go_by_arrival(priority_llm):
    admitted = record(priority_llm.engine, "admitted")
    outputs = priority_llm.generate([prompt(i) for i in range(4)], GREEDY, use_tqdm=False,
                                    priority=[1, 0, 1, 0])
    first = int(outputs[0].request_id)  # ids count up across calls
    assert admitted == [str(first + i) for i in (1, 3, 0, 2)]
    for i, output in enumerate(outputs):  # in prompt order, whatever the admission order
        assert output.outputs[0].token_ids == hf_greedy("tiny-llama", tuple(prompt(i)), 4)


@pytest.mark.parametrize("priority,error", [([0, 1, 2], "2 prompts, priority has 3"),
                                            (3, "priority has int"),
                                            ([0, 1.5], "must be an int")])
def test_a_bad_priority_list_is_refused_and_nothing_is_added(priority_llm, priority, error):
    with pytest.raises(InvalidInputError, match=error):
        priority_llm.generate([prompt(1), prompt(2)], GREEDY, use_tqdm=False, priority=priority)
    assert not priority_llm.engine.has_unfinished_requests()
    assert len(priority_llm.generate(prompt(1), GREEDY, use_tqdm=False)) == 1


def test_the_highest_priority_value_is_preempted_first():
    """Three requests share a pool too small for all to grow: the one with priority 5 (arrived
    second, so not the latest) is the one preempted, and every answer is still HF's."""
    llm = LLM("tiny-llama", policy="priority", max_num_seqs=3, max_model_len=128, num_blocks=6,
              watermark=0.0, enable_prefix_caching=False, threads=1)
    victims = record(llm.engine, "victim")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = llm.generate([prompt(i) for i in range(3)], params, use_tqdm=False, priority=[0, 5, 1])
    assert llm.engine.scheduler.num_preemptions > 0
    assert victims and set(victims) == {outputs[1].request_id}
    for i, output in enumerate(outputs):
        assert output.outputs[0].token_ids == hf_greedy("tiny-llama", tuple(prompt(i)), 24)
    llm.engine.manager.check()
    assert llm.engine.manager.num_blocks_in_use == 0


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_a_priority_is_refused_unless_the_policy_is_priority(policy):
    llm = LLM("tiny-llama", policy=policy, max_num_seqs=2, max_model_len=64, threads=1)
    with pytest.raises(PriorityNotSupportedError, match="--policy priority") as refused:
        llm.generate([prompt(1), prompt(2)], GREEDY, use_tqdm=False, priority=[0, 2])
    assert isinstance(refused.value, ValueError) and f"'{policy}'" in str(refused.value)
    assert not llm.engine.has_unfinished_requests()  # the first prompt was not added either
    with pytest.raises(PriorityNotSupportedError):
        llm.engine.add_request("direct", prompt(1), GREEDY, priority=-1)
    assert len(llm.generate([prompt(1), prompt(2)], GREEDY, use_tqdm=False, priority=[0, 0])) == 2


# --- the server's "priority" field ---------------------------------------------------------------------
@pytest.fixture
def serve():
    """serve(**engine config) -> (base URL, engine, open_gate): the server on a tiny-llama engine
    whose steps wait for ``open_gate()``, so that requests sent meanwhile all wait together."""
    pytest.importorskip("fastapi", reason="the server needs fastapi (pip install fastapi)")
    pytest.importorskip("uvicorn", reason="the server needs uvicorn (pip install uvicorn)")
    from serving import running_server
    from vmemkv.engine.serving.async_engine import AsyncEngine

    servers = []

    def start(**config):
        engine = LLMEngine(EngineConfig(max_num_seqs=1, max_model_len=128, threads=1, **config))
        gate, step = threading.Event(), engine.step

        def gated_step():
            if gate.is_set():
                return step()
            time.sleep(0.005)  # the engine thread goes on applying commands meanwhile
            return []

        engine.step = gated_step
        server = running_server(AsyncEngine(engine), engine.model_name, 10.0)
        servers.append(server)
        return server.__enter__(), engine, gate.set

    yield start
    for server in servers:
        server.__exit__(None, None, None)


def wait_for(condition, what: str, wait_s: float = 10.0) -> None:
    deadline = time.monotonic() + wait_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {wait_s} s"
        time.sleep(0.01)


def test_the_server_admits_by_the_bodies_priority_on_both_endpoints(serve):
    import httpx

    url, engine, open_gate = serve(policy="priority")
    admitted = record(engine, "admitted")
    bodies = [("/v1/completions", {"prompt": prompt(1), "max_tokens": 2, "priority": 2}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 2, "priority": 0}),
              ("/v1/completions", {"prompt": prompt(2), "max_tokens": 2}),  # priority 0 too
              ("/v1/completions", {"prompt": prompt(3), "max_tokens": 2, "priority": -1})]
    answers: dict[int, dict] = {}

    def send(index: int) -> None:
        path, body = bodies[index]
        answers[index] = httpx.post(url + path, json=body, timeout=30.0).json()

    threads = []
    for index in range(len(bodies)):  # one at a time, so that arrival order is known
        threads.append(threading.Thread(target=send, args=(index,)))
        threads[-1].start()
        wait_for(lambda: len(engine.scheduler.waiting) == index + 1, f"request {index} waiting")
    open_gate()
    for thread in threads:
        thread.join(30.0)
    assert admitted == [answers[i]["id"] for i in (3, 1, 2, 0)]
    wait_for(lambda: not engine.has_unfinished_requests(), "the engine going idle")
    assert engine.manager.num_blocks_in_use == 0


def test_the_server_refuses_a_priority_unless_the_policy_is_priority(serve):
    import httpx

    url, engine, open_gate = serve()  # the default policy, lpm
    open_gate()
    for path, body in [("/v1/completions", {"prompt": prompt(1), "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2})]:
        refused = httpx.post(url + path, json={**body, "priority": 1}, timeout=30.0)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "priority" and "--policy priority" in error["message"]
        bad = httpx.post(url + path, json={**body, "priority": "high"}, timeout=30.0)
        assert bad.status_code == 400 and "priority" in bad.json()["error"]["message"]
        served = httpx.post(url + path, json={**body, "priority": 0}, timeout=30.0)
        assert served.status_code == 200, served.text
    assert not engine.has_unfinished_requests()
