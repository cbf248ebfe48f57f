"""The OpenAI-compatible server in uvicorn on a free loopback port, in a background thread, for
tests (import only after `pytest.importorskip("uvicorn")`)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from vmemkv.engine.serving.async_engine import AsyncEngine
from vmemkv.engine.serving.server import build_app


@contextlib.contextmanager
def running_server(async_engine: AsyncEngine, served_name: str, wait_s: float,
                   api_key: str | None = None, **app_options) -> Iterator[str]:
    """Yields the server's base URL (``http://127.0.0.1:PORT``); stops it and the engine after.
    ``app_options`` go to ``build_app`` (``api_keys``, ``cache_salt_per_api_key``)."""
    app = build_app(async_engine, served_name, api_key=api_key, **app_options)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + wait_s
    while not server.started:
        assert time.monotonic() < deadline, f"the server did not start within {wait_s} s"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(wait_s)
        async_engine.shutdown()
        sock.close()
