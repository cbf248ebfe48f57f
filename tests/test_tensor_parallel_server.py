"""``vmemkv serve`` on two tensor-parallel ranks (CPU, gloo): after a rank dies the server
answers 503 and then exits by itself, status 1, with the reason on one log line and no rank left.
Starts a worker process (``spawns``)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the server needs fastapi (pip install fastapi)")
pytest.importorskip("uvicorn", reason="the server needs uvicorn (pip install uvicorn)")
import httpx  # noqa: E402 - after the skips: the server's packages

from test_engine_correctness import make_engine  # noqa: E402
from test_tensor_parallel import TP  # noqa: E402
from vmemkv.engine.serving.server import run_server  # noqa: E402


@pytest.mark.spawns
def test_server_answers_503_and_exits_after_a_rank_dies(caplog):
    """``run_server`` (what ``vmemkv serve`` runs) on two ranks: a request after rank 1 is killed
    gets 503, the server stops by itself with SystemExit(1), the reason is one line in the log,
    and no rank is left."""
    engine = make_engine(**TP)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    exits = []

    def serve() -> None:
        try:
            run_server(engine, port=port)
        except SystemExit as stop:
            exits.append(stop)

    thread = threading.Thread(target=serve, daemon=True)
    try:
        thread.start()
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        body = {"model": engine.model_name, "prompt": [5, 6, 7], "max_tokens": 4}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200
        worker = engine.tensor_parallel.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert answer.status_code == 503
        assert "rank 1 exited with code -9" in answer.json()["error"]["message"]
        thread.join(30)
        assert not thread.is_alive(), "the server kept running after the engine stopped"
        (stop,) = exits  # a message as the code: Python prints it and exits with status 1
        assert isinstance(stop.code, str) and "exiting with status 1" in stop.code
        reasons = [r.getMessage() for r in caplog.records if "the engine stopped" in r.getMessage()]
        assert len(reasons) == 1 and "\n" not in reasons[0] and "rank 1 exited" in reasons[0]
        assert not any(p.is_alive() for p in engine.tensor_parallel.processes)
    finally:
        engine.close()
