"""OpenAI-compatible HTTP server over an ``AsyncEngine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming over server-sent
events, or not), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).
Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid
JSON, invalid parameters and prompts that are too long; 401 for a wrong or missing API key
(when one is configured); 404 for an unknown model or route; 503 when the engine has stopped.
``run_server`` exits (status 1) after a tensor-parallel engine stopped: a rank died or hung, every
rank is stopped, and no request can run again, so a supervisor should restart the server.

Tenants: several API keys may be accepted. With ``cache_salt_per_api_key`` each key's requests
get a salt derived from the key (a hash of it, never the key itself) in their prefix-cache keys,
so requests under different keys never share cached pages and cannot time each other's prefix
hits; a request's own ``cache_salt`` (vLLM's field) partitions further under its key's salt.

A client that disconnects, mid-stream or while waiting for a non-streaming answer, has its
request aborted so its KV pages are freed at once.

The pieces, one module each: request bodies and the error body in :mod:`.openai_protocol`, turning
a body into prompt ids and sampling parameters in :mod:`.openai_inputs`, response pieces in
:mod:`.openai_outputs`, server-sent events in :mod:`.openai_stream`; this module holds the routes,
error handlers, the API-key check and the endpoints that tie them together.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from vmemkv.cache.hashing import CacheKeys
from vmemkv.engine.serving.async_engine import AsyncEngine, EngineDeadError
from vmemkv.engine.core.chat import has_chat_template
from vmemkv.engine.core.elastic import EngineAsleepError
from vmemkv.errors import ConfigError, RequestStateError
from vmemkv.engine.distributed import TensorParallelError
from vmemkv.engine.models.zoo import is_random_weight, random_weight_notice
from vmemkv.engine.serving.openai_inputs import (cache_keys, chat_prompt_ids, check_model, completion_prompt_ids,
                                                 sampling_params)
from vmemkv.engine.serving.openai_outputs import ResponseFormatter, last_output, usage
from vmemkv.engine.serving.openai_protocol import (MAX_LOGPROBS, ChatCompletionRequest, CompletionRequest, OpenAIError,
                                                   error_body, error_response)
from vmemkv.engine.serving.openai_stream import EventStreamResponse, chat_events, completion_events
from vmemkv.engine.core.outputs import RequestOutput
from vmemkv.engine.core.policies import PriorityNotSupportedError
from vmemkv.engine.core.sampling_params import SamplingParams

__all__ = ["OpenAIError", "build_app", "error_body", "run_server"]


# ---- errors and the API key ------------------------------------------------------------------

def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return f"invalid JSON in the request body: {err.get('ctx', {}).get('error', err['msg'])}"
        location = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{location or 'body'}: {err['msg']}")
    return "invalid request: " + "; ".join(parts)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(_validation_message(exc)), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {exc!r}", "server_error"), status_code=500)


def tenant_salt(api_key: str) -> str:
    """The prefix-cache salt of an API key's requests: a hash of the key, so the key itself is
    never kept in the cache's keys."""
    return "api-key:" + hashlib.sha256(api_key.encode()).hexdigest()


class _APIKeyMiddleware:
    """Plain ASGI middleware, so the key is checked before the body is read or validated. Every
    accepted key is compared (in constant time each), so the time taken does not tell which key
    came close. With ``salt_per_key`` the key's salt goes to the handler in the request state."""

    def __init__(self, app, api_keys: list[str], salt_per_key: bool) -> None:
        self.app = app
        self.expected = [(f"Bearer {key}".encode(), tenant_salt(key) if salt_per_key else None)
                         for key in api_keys]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            matches = [salt for expected, salt in self.expected
                       if hmac.compare_digest(given, expected)]
            if not matches:
                response = error_response(OpenAIError(
                    401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                    code="invalid_api_key"))
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant_salt"] = matches[0]
        await self.app(scope, receive, send)


def _accepted_keys(api_key: str | None, api_keys: Sequence[str], cache_salt_per_api_key: bool
                   ) -> list[str]:
    keys = ([api_key] if api_key else []) + [key for key in api_keys if key]
    if cache_salt_per_api_key and not keys:
        raise ValueError("cache_salt_per_api_key needs at least one API key (--api-key or "
                         "--api-keys-file)")
    return keys


# ---- the app --------------------------------------------------------------------------------

def build_app(async_engine: AsyncEngine, served_model_name: str | None = None,
              api_key: str | None = None, api_keys: Sequence[str] = (),
              cache_salt_per_api_key: bool = False) -> FastAPI:
    """``api_key`` and ``api_keys``: the keys accepted (none: no check); with
    ``cache_salt_per_api_key`` each key is a tenant with its own prefix-cache salt."""
    keys = _accepted_keys(api_key, api_keys, cache_salt_per_api_key)
    app = FastAPI(title="vmemkv", docs_url=None, redoc_url=None)
    server = _Server(async_engine, served_model_name or async_engine.model_name)
    _add_error_handlers(app)
    if keys:
        app.add_middleware(_APIKeyMiddleware, api_keys=keys, salt_per_key=cache_salt_per_api_key)

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_running:
            return JSONResponse(error_body("the engine is not running", "server_error"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(async_engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # Sleep and wake (engine/core/elastic.py), as vLLM's server: POST /sleep?level=1|2 gives back
    # every KV page (and offloads or drops the weights), POST /wake_up undoes it.
    @app.post("/sleep")
    async def sleep(level: int = 1) -> Response:
        try:
            given = await async_engine.call(lambda engine: engine.sleep(level))
        except RequestStateError as exc:  # requests still running
            raise OpenAIError(409, str(exc)) from exc
        except ConfigError as exc:
            raise OpenAIError(400, str(exc), param="level") from exc
        return JSONResponse({"sleeping": True, "level": level, "kv_bytes_released": given})

    @app.post("/wake_up")
    async def wake_up() -> Response:
        await async_engine.call(lambda engine: engine.wake_up())
        return JSONResponse({"sleeping": False})

    @app.get("/is_sleeping")
    async def is_sleeping() -> Response:
        return JSONResponse({"is_sleeping": bool(async_engine.engine.sleep_level)})

    @app.get("/v1/models")
    async def models() -> dict:
        entry = {"id": server.model_name, "object": "model", "created": server.created,
                 "owned_by": "vmemkv", "max_model_len": async_engine.max_model_len}
        if is_random_weight(async_engine.model_name):  # say so: its text is gibberish
            entry.update(random_weights=True, notice=random_weight_notice(async_engine.model_name))
        return {"object": "list", "data": [entry]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        keys = cache_keys(body, getattr(request.state, "tenant_salt", None))
        return await _cancel_on_disconnect(request, server.completions(body, keys))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        keys = cache_keys(body, getattr(request.state, "tenant_salt", None))
        return await _cancel_on_disconnect(request, server.chat_completions(body, keys))

    return app


async def _cancel_on_disconnect(request: Request, handler: Awaitable[Response]) -> Response:
    """Run the handler, cancelling it (and so aborting its request) if the client goes away.

    Starlette does not cancel a handler on disconnect; a streaming response watches for it
    itself once it has started, this covers the time before that.
    """
    handler_task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({handler_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not handler_task.done():
            handler_task.cancel()  # takes effect at the handler's next await: wait for it
            await asyncio.wait({handler_task})
    if handler_task.cancelled():
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    return handler_task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Server:
    def __init__(self, async_engine: AsyncEngine, model_name: str) -> None:
        self.engine = async_engine
        self.model_name = model_name
        self.created = int(time.time())

    @property
    def formatter(self) -> ResponseFormatter:
        return ResponseFormatter(self.engine.tokenizer)

    async def completions(self, body: CompletionRequest, keys: CacheKeys) -> Response:
        check_model(body.model, self.model_name)
        if body.echo:
            raise OpenAIError(400, "echo is not supported", param="echo")
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
            raise OpenAIError(400, f"logprobs must be between 0 and {MAX_LOGPROBS}, got {body.logprobs}",
                              param="logprobs")
        prompt_ids = completion_prompt_ids(self.engine.tokenizer, body.prompt)
        params = sampling_params(body, prompt_ids, body.max_tokens, body.logprobs,
                                 self.engine.max_model_len)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        outputs, first = await self._start(request_id, prompt_ids, params, keys, body.priority)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return EventStreamResponse(completion_events(
                self.engine, self.formatter, self.model_name, request_id, first, outputs,
                body.logprobs is not None, include_usage))
        final = await last_output(first, outputs)
        return JSONResponse({
            "id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [self.formatter.completion_choice(c, c.text, c.token_ids, c.logprobs, 0,
                                                         c.finish_reason) for c in final.outputs],
            "usage": usage(final)})

    async def chat_completions(self, body: ChatCompletionRequest, keys: CacheKeys) -> Response:
        check_model(body.model, self.model_name)
        if body.top_logprobs is not None:
            if not body.logprobs:
                raise OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
            if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
                raise OpenAIError(400, f"top_logprobs must be between 0 and {MAX_LOGPROBS}, "
                                  f"got {body.top_logprobs}", param="top_logprobs")
        prompt_ids = chat_prompt_ids(self.engine.tokenizer, body.messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(body, prompt_ids, max_tokens, logprobs, self.engine.max_model_len)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        outputs, first = await self._start(request_id, prompt_ids, params, keys, body.priority)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return EventStreamResponse(chat_events(
                self.engine, self.formatter, self.model_name, request_id, first, outputs,
                params.n, logprobs, include_usage))
        final = await last_output(first, outputs)
        return JSONResponse({
            "id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                         "logprobs": self.formatter.chat_logprobs(c.token_ids, c.logprobs, logprobs),
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                        for c in final.outputs],
            "usage": usage(final)})

    async def _start(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     keys: CacheKeys, priority: int
                     ) -> tuple[AsyncIterator[RequestOutput], RequestOutput]:
        """Add the request and wait for its first output, so that add_request's errors become
        an HTTP error before any streamed byte is sent."""
        outputs = self.engine.generate(request_id, prompt_ids, params, priority,
                                       keys=None if keys == CacheKeys() else keys)
        try:
            first = await anext(outputs)
        except EngineAsleepError as exc:
            raise OpenAIError(503, str(exc), type="server_error") from exc
        except PriorityNotSupportedError as exc:  # not under --policy priority
            raise OpenAIError(400, str(exc), param="priority") from exc
        except ValueError as exc:  # RequestTooLongError is a ValueError too
            raise OpenAIError(400, str(exc), param="prompt") from exc
        except EngineDeadError as exc:
            raise OpenAIError(503, str(exc), type="server_error") from exc
        except StopAsyncIteration as exc:
            raise OpenAIError(500, "the engine ended the request without output",
                              type="server_error") from exc
        if first.finished and first.error is not None:
            raise OpenAIError(500, first.error, type="server_error")
        return outputs, first


def _closing_server(config, async_engine: AsyncEngine):
    """uvicorn's server, closing the engine as it shuts down (SIGINT, SIGTERM): uvicorn raises a
    caught SIGTERM again once it is done, which ends the process before run_server's own cleanup."""
    import uvicorn

    class ClosingServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            await super().shutdown(sockets=sockets)
            async_engine.shutdown(close_engine=True)

    return ClosingServer(config)


def run_server(engine: Any, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               served_model_name: str | None = None, api_keys: Sequence[str] = (),
               cache_salt_per_api_key: bool = False) -> None:
    """Serve ``engine`` (an ``LLMEngine``, or a function that builds one: then it is built on the
    engine thread, ``AsyncEngine``) until interrupted. Raises ``SystemExit(1)`` once the
    server has stopped after a tensor-parallel engine failed (requests meanwhile get 503; the
    engine's log says which rank failed and why, on one line)."""
    import uvicorn

    server: uvicorn.Server | None = None
    ranks_failed: list[TensorParallelError] = []

    def stop_if_ranks_failed(error: BaseException) -> None:  # on the engine thread
        if isinstance(error, TensorParallelError):
            ranks_failed.append(error)
            if server is not None:
                server.should_exit = True  # uvicorn's main loop polls it, then shuts down

    async_engine = AsyncEngine(engine, on_failure=stop_if_ranks_failed)
    engine = async_engine.engine
    if not has_chat_template(engine.tokenizer):
        print(f"vmemkv: note: {engine.model_name} has no chat template; /v1/chat/completions "
              "formats messages as 'role: content' lines", file=sys.stderr)
    try:
        app = build_app(async_engine, served_model_name or engine.model_name, api_key, api_keys,
                        cache_salt_per_api_key)
        server = _closing_server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                                timeout_graceful_shutdown=5), async_engine)
        if not ranks_failed:
            server.run()
    finally:
        async_engine.shutdown(close_engine=True)
    if ranks_failed:
        raise SystemExit("vmemkv serve: exiting with status 1: the tensor-parallel engine "
                         "stopped (every rank is stopped; restart the server)")
