"""OpenAI-compatible HTTP server over an ``AsyncEngine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming over server-sent
events, or not), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).
Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid
JSON, invalid parameters and prompts that are too long; 401 for a wrong or missing API key
(when one is configured); 404 for an unknown model or route; 503 when the engine has stopped.

A client that disconnects, mid-stream or while waiting for a non-streaming answer, has its
request aborted so its KV pages are freed at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from .async_engine import AsyncEngine, EngineDeadError
from .chat import has_chat_template
from .models import is_random_weight, random_weight_notice
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

MAX_LOGPROBS = 20  # OpenAI allows up to 20 top logprobs in chat; the same cap for completions


# ---- request bodies -------------------------------------------------------------------------

class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints (OpenAI's, plus vLLM's top_k, min_p and friends)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... pass to the template

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the model's context length
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


# ---- errors ---------------------------------------------------------------------------------

class OpenAIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status_code, self.message, self.type, self.param, self.code = (
            status_code, message, type, param, code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(error.message, error.type, error.param, error.code),
                        status_code=error.status_code)


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
        return _error_response(exc)

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


class _APIKeyMiddleware:
    """Plain ASGI middleware, so the key is checked before the body is read or validated."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = _error_response(OpenAIError(
                    401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                    code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---- the app --------------------------------------------------------------------------------

def build_app(async_engine: AsyncEngine, served_model_name: str | None = None,
              api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="vmemkv", docs_url=None, redoc_url=None)
    server = _Server(async_engine, served_model_name or async_engine.model_name)
    _add_error_handlers(app)
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_running:
            return JSONResponse(error_body("the engine is not running", "server_error"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(async_engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        entry = {"id": server.model_name, "object": "model", "created": server.created,
                 "owned_by": "vmemkv", "max_model_len": async_engine.max_model_len}
        if is_random_weight(async_engine.model_name):  # say so: its text is gibberish
            entry.update(random_weights=True, notice=random_weight_notice(async_engine.model_name))
        return {"object": "list", "data": [entry]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _cancel_on_disconnect(request, server.completions(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _cancel_on_disconnect(request, server.chat_completions(body))

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
            handler_task.cancel()
    if handler_task.cancelled():
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    return handler_task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _EventStreamResponse(StreamingResponse):
    """Server-sent events whose generator is closed as soon as the stream ends, even when the
    client disconnected, so its ``finally`` (which aborts the request) runs now, not at GC."""

    media_type = "text/event-stream"

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


@dataclass
class _Choice:
    """How much of one completion a stream has sent."""

    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False


class _Server:
    def __init__(self, async_engine: AsyncEngine, model_name: str) -> None:
        self.engine = async_engine
        self.model_name = model_name
        self.created = int(time.time())

    # -- endpoints --

    async def completions(self, body: CompletionRequest) -> Response:
        self._check_model(body.model)
        if body.echo:
            raise OpenAIError(400, "echo is not supported", param="echo")
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
            raise OpenAIError(400, f"logprobs must be between 0 and {MAX_LOGPROBS}, got {body.logprobs}",
                              param="logprobs")
        prompt_ids = self._completion_prompt_ids(body.prompt)
        params = self._sampling_params(body, prompt_ids, body.max_tokens, body.logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        outputs, first = await self._start(request_id, prompt_ids, params)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self._completion_events(request_id, first, outputs, body.logprobs is not None,
                                             include_usage)
            return _EventStreamResponse(events)
        final = await _last(first, outputs)
        return JSONResponse({
            "id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [self._completion_choice(c, c.text, c.token_ids, c.logprobs, 0,
                                                c.finish_reason) for c in final.outputs],
            "usage": _usage(final)})

    async def chat_completions(self, body: ChatCompletionRequest) -> Response:
        self._check_model(body.model)
        if body.top_logprobs is not None:
            if not body.logprobs:
                raise OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
            if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
                raise OpenAIError(400, f"top_logprobs must be between 0 and {MAX_LOGPROBS}, "
                                  f"got {body.top_logprobs}", param="top_logprobs")
        prompt_ids = self._chat_prompt_ids(body.messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self._sampling_params(body, prompt_ids, max_tokens, logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        outputs, first = await self._start(request_id, prompt_ids, params)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self._chat_events(request_id, first, outputs, params.n, logprobs, include_usage)
            return _EventStreamResponse(events)
        final = await _last(first, outputs)
        return JSONResponse({
            "id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                         "logprobs": self._chat_logprobs(c.token_ids, c.logprobs, logprobs),
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                        for c in final.outputs],
            "usage": _usage(final)})

    # -- turning a request body into the engine's input --

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(404, f"the model {model!r} does not exist; this server serves "
                              f"{self.model_name!r}", param="model", code="model_not_found")

    def _completion_prompt_ids(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise OpenAIError(400, f"a list of {len(prompt)} prompts is not supported; send "
                                  "one prompt per request", param="prompt")
            prompt = prompt[0]
        ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self._check_prompt_ids(ids)

    def _chat_prompt_ids(self, messages: list[ChatMessage]) -> list[int]:
        conversation = [{**m.model_dump(exclude_none=True), "content": _message_text(m)}
                        for m in messages]
        tokenizer = self.engine.tokenizer
        if getattr(tokenizer, "chat_template", None):
            try:
                encoded = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                        tokenize=True)
            except Exception as exc:  # a template may reject a role order, e.g. two user turns
                raise OpenAIError(400, f"the chat template rejected the messages: {exc}",
                                  param="messages") from exc
            ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        else:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in conversation) + "assistant: "
            ids = tokenizer.encode(text)
        return self._check_prompt_ids(list(ids))

    @staticmethod
    def _check_prompt_ids(ids: list[int]) -> list[int]:
        if not ids:
            raise OpenAIError(400, "the prompt is empty", param="prompt")
        if any(not isinstance(t, int) or t < 0 for t in ids):
            raise OpenAIError(400, "prompt token ids must be non-negative integers", param="prompt")
        return ids

    def _sampling_params(self, body: _SamplingFields, prompt_ids: list[int], max_tokens: int | None,
                         logprobs: int | None) -> SamplingParams:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name):
                raise OpenAIError(400, f"{name} is not supported; leave it unset or 0", param=name)
        if max_tokens is None:  # as much as the context allows (the engine rejects a full prompt)
            max_tokens = max(1, self.engine.max_model_len - len(prompt_ids))
        try:
            return SamplingParams(
                n=body.n, max_tokens=max_tokens, logprobs=logprobs, seed=body.seed,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=0 if body.top_k is None else body.top_k,
                min_p=0.0 if body.min_p is None else body.min_p,
                stop=body.stop, stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
                skip_special_tokens=body.skip_special_tokens,
                include_stop_str_in_output=body.include_stop_str_in_output)
        except ValueError as exc:
            raise OpenAIError(400, str(exc)) from exc

    async def _start(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                     ) -> tuple[AsyncIterator[RequestOutput], RequestOutput]:
        """Add the request and wait for its first output, so that add_request's errors become
        an HTTP error before any streamed byte is sent."""
        outputs = self.engine.generate(request_id, prompt_ids, params)
        try:
            first = await anext(outputs)
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

    # -- streaming --

    def _completion_events(self, request_id: str, first: RequestOutput,
                           outputs: AsyncIterator[RequestOutput], want_logprobs: bool,
                           include_usage: bool) -> AsyncIterator[str]:
        base = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        choices: dict[int, _Choice] = {}

        def chunk_choices(output: RequestOutput) -> list[dict]:
            result = []
            for completion in output.outputs:
                delta = _take_delta(choices, completion, want_logprobs)
                if delta is not None:
                    text, token_ids, logprobs, offset, finish = delta
                    result.append(self._completion_choice(completion, text, token_ids, logprobs,
                                                          offset, finish))
            return result

        return _stream_events(self.engine, request_id, first, outputs, base, chunk_choices,
                              include_usage)

    def _chat_events(self, request_id: str, first: RequestOutput,
                     outputs: AsyncIterator[RequestOutput], n: int, top_logprobs: int | None,
                     include_usage: bool) -> AsyncIterator[str]:
        base = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name}
        choices: dict[int, _Choice] = {}

        def chunk_choices(output: RequestOutput) -> list[dict]:
            result = []
            for completion in output.outputs:
                delta = _take_delta(choices, completion, top_logprobs is not None)
                if delta is not None:
                    text, token_ids, logprobs, _, finish = delta
                    result.append({"index": completion.index,
                                   "delta": {"content": text} if text else {},
                                   "logprobs": self._chat_logprobs(token_ids, logprobs, top_logprobs),
                                   "finish_reason": finish,
                                   "stop_reason": completion.stop_reason if finish else None})
            return result

        # The role comes first, in its own chunk per choice, as OpenAI sends it.
        role_chunk = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None} for i in range(n)]
        return _stream_events(self.engine, request_id, first, outputs, base, chunk_choices,
                              include_usage, first_choices=role_chunk)

    # -- response pieces --

    def _completion_choice(self, completion: CompletionOutput, text: str, token_ids: list[int],
                           logprobs: list[dict[int, float]] | None, text_offset: int,
                           finish_reason: str | None) -> dict:
        return {"index": completion.index, "text": text,
                "logprobs": self._completion_logprobs(token_ids, logprobs, text_offset),
                "finish_reason": finish_reason,
                "stop_reason": completion.stop_reason if finish_reason else None}

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                             text_offset: int) -> dict | None:
        """The legacy completions format: parallel lists, tokens as strings."""
        if logprobs is None:
            return None
        result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                   "text_offset": []}
        for token_id, entry in zip(token_ids, logprobs):
            token = self._token_text(token_id)
            result["tokens"].append(token)
            result["token_logprobs"].append(entry.get(token_id))
            result["top_logprobs"].append({self._token_text(t): lp for t, lp in entry.items()})
            result["text_offset"].append(text_offset)
            text_offset += len(token)
        return result

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                       top_logprobs: int | None) -> dict | None:
        if logprobs is None or top_logprobs is None:
            return None
        content = []
        for token_id, entry in zip(token_ids, logprobs):
            top = sorted(entry.items(), key=lambda item: -item[1])[:top_logprobs]
            content.append({**self._chat_token(token_id, entry.get(token_id)),
                            "top_logprobs": [self._chat_token(t, lp) for t, lp in top]})
        return {"content": content}

    def _chat_token(self, token_id: int, logprob: float | None) -> dict:
        token = self._token_text(token_id)
        return {"token": token, "logprob": logprob,
                "bytes": list(token.encode("utf-8", errors="replace"))}

    def _token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)


def _take_delta(choices: dict[int, _Choice], completion: CompletionOutput, want_logprobs: bool
                ) -> tuple[str, list[int], list[dict[int, float]] | None, int, str | None] | None:
    """What of this completion has not been streamed yet: (text, token ids, logprobs, text
    offset, finish reason), or None when there is nothing worth a chunk."""
    state = choices.setdefault(completion.index, _Choice())
    if state.finished:
        return None
    text = completion.text[state.text_len:]
    token_ids = completion.token_ids[state.num_tokens:]
    logprobs = completion.logprobs[state.num_tokens:] if completion.logprobs is not None else None
    finish = completion.finish_reason
    if not text and finish is None and not (want_logprobs and token_ids):
        return None  # tokens whose text is still held back
    offset = state.text_len
    state.text_len = max(state.text_len, len(completion.text))
    state.num_tokens = len(completion.token_ids)
    state.finished = finish is not None
    return text, token_ids, logprobs, offset, finish


async def _stream_events(engine: AsyncEngine, request_id: str, first: RequestOutput,
                         outputs: AsyncIterator[RequestOutput], base: dict,
                         chunk_choices: Callable[[RequestOutput], list[dict]],
                         include_usage: bool, first_choices: list[dict] | None = None
                         ) -> AsyncIterator[str]:
    """The SSE events of one request; aborts it if the stream is closed before it finishes.

    ``chunk_choices`` turns an output into the choices of one chunk (none: no chunk).
    """
    if include_usage:
        base = {**base, "usage": None}  # as OpenAI: null on every chunk but the last
    finished = False
    try:
        if first_choices:
            yield _sse({**base, "choices": first_choices})
        output = first
        while True:
            if output.error is not None:
                yield _sse(error_body(output.error, "server_error"))
                break
            choices = chunk_choices(output)
            if choices:
                yield _sse({**base, "choices": choices})
            if output.finished:
                finished = True
                if include_usage:
                    yield _sse({**base, "choices": [], "usage": _usage(output)})
                break
            output = await anext(outputs)
    except (EngineDeadError, StopAsyncIteration) as exc:
        yield _sse(error_body(f"the request ended early: {exc or 'no final output'}", "server_error"))
    finally:
        if not finished:  # client disconnect, error: free the request's pages now
            engine.abort(request_id)
    yield "data: [DONE]\n\n"


async def _last(first: RequestOutput, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = first
    if not final.finished:
        async for output in outputs:
            final = output
    if final.error is not None:
        raise OpenAIError(500, final.error, type="server_error")
    return final


def _message_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part in message.content:
        if part.get("type") != "text":
            raise OpenAIError(400, f"message content of type {part.get('type')!r} is not "
                              "supported; only text", param="messages")
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)


def _usage(output: RequestOutput) -> dict:
    prompt_tokens = len(output.prompt_token_ids)
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def run_server(engine: Any, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               served_model_name: str | None = None) -> None:
    """Serve ``engine`` (an ``LLMEngine``) until interrupted."""
    import uvicorn

    async_engine = AsyncEngine(engine)
    if not has_chat_template(engine.tokenizer):
        print(f"vmemkv: note: {engine.model_name} has no chat template; /v1/chat/completions "
              "formats messages as 'role: content' lines", file=sys.stderr)
    try:
        app = build_app(async_engine, served_model_name or engine.model_name, api_key)
        uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    finally:
        async_engine.shutdown()
