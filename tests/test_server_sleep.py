"""The server's sleep and wake (vLLM's endpoints): POST /sleep gives every KV page back and the
server answers 503 to completions while asleep, GET /is_sleeping says so, POST /wake_up brings
the same greedy answers back; /sleep is refused (409) while a request runs; /metrics shows the
resident KV bytes. The real engine (tiny-llama) under uvicorn on 127.0.0.1."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("fastapi", reason="the server needs fastapi (pip install fastapi)")
pytest.importorskip("uvicorn", reason="the server needs uvicorn (pip install uvicorn)")
httpx = pytest.importorskip("httpx", reason="these tests send requests with httpx")

from vmemkv.engine import EngineConfig, LLMEngine
from vmemkv.engine.serving.async_engine import AsyncEngine

from serving import running_server  # noqa: E402

WAIT_S = 30.0
PROMPT = [(7 * i + 3) % 500 for i in range(40)]


def complete(http, **extra):
    return http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                              **extra})


def metric(http, name: str) -> float:
    lines = [line for line in http.get("/metrics").text.splitlines() if line.startswith(name + " ")]
    return float(lines[0].split()[1])


def test_sleep_and_wake_up_over_http():
    engine = LLMEngine(EngineConfig(max_model_len=128, max_num_seqs=2))
    with running_server(AsyncEngine(engine), engine.model_name, WAIT_S) as url, \
            httpx.Client(base_url=url, timeout=WAIT_S) as http:
        first = complete(http)
        assert first.status_code == 200, first.text
        assert metric(http, "vmemkv_kv_resident_bytes") > 0
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        slept = http.post("/sleep", params={"level": 2})
        assert slept.status_code == 200 and slept.json()["kv_bytes_released"] > 0
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        assert metric(http, "vmemkv_kv_resident_bytes") == 0
        asleep = complete(http)
        assert asleep.status_code == 503 and "wake_up" in asleep.text
        assert http.post("/sleep").json()["kv_bytes_released"] == 0  # asleep already: nothing to do
        assert http.post("/wake_up").json() == {"sleeping": False}
        again = complete(http)
        assert again.status_code == 200
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]


def test_sleep_is_refused_while_a_request_runs():
    engine = LLMEngine(EngineConfig(max_model_len=256, max_num_seqs=2))
    forward = engine.runner.model_runner.forward

    def slow_forward(*args, **kwargs):  # a step of 20 ms: the request runs for seconds
        time.sleep(0.02)
        return forward(*args, **kwargs)

    engine.runner.model_runner.forward = slow_forward
    with running_server(AsyncEngine(engine), engine.model_name, WAIT_S) as url, \
            httpx.Client(base_url=url, timeout=WAIT_S) as http:
        body = {"prompt": PROMPT, "max_tokens": 150, "temperature": 0, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()  # kept: a dropped iterator closes the stream (an abort)
            next(lines)  # its first event: the request runs in the engine
            refused = http.post("/sleep")
            assert refused.status_code == 409 and "unfinished" in refused.text
        assert http.post("/sleep", params={"level": 3}).status_code == 400
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
