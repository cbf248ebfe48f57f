"""Streaming over server-sent events: the chunks of a completion or chat completion as the
engine produces tokens (only what was not sent yet, text held back by the detokenizer waits),
the usage chunk, ``data: [DONE]``, and aborting the request when the stream is closed early (a
client disconnect) so its KV pages are freed at once."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi.responses import StreamingResponse

from vmemkv.engine.serving.async_engine import AsyncEngine, EngineDeadError
from vmemkv.engine.serving.openai_outputs import ResponseFormatter, usage
from vmemkv.engine.serving.openai_protocol import error_body
from vmemkv.engine.core.outputs import CompletionOutput, RequestOutput


class EventStreamResponse(StreamingResponse):
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


def completion_events(engine: AsyncEngine, formatter: ResponseFormatter, model_name: str,
                      request_id: str, first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                      want_logprobs: bool, include_usage: bool) -> AsyncIterator[str]:
    choices: dict[int, _Choice] = {}

    def chunk_choices(output: RequestOutput) -> list[dict]:
        return [formatter.completion_choice(completion, text, token_ids, logprobs, offset, finish)
                for completion, (text, token_ids, logprobs, offset, finish)
                in _deltas(choices, output, want_logprobs)]

    return _stream_events(engine, request_id, first, outputs,
                          _chunk_base(request_id, "text_completion", model_name), chunk_choices,
                          include_usage)


def chat_events(engine: AsyncEngine, formatter: ResponseFormatter, model_name: str,
                request_id: str, first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                n: int, top_logprobs: int | None, include_usage: bool) -> AsyncIterator[str]:
    choices: dict[int, _Choice] = {}

    def chunk_choices(output: RequestOutput) -> list[dict]:
        return [{"index": completion.index,
                 "delta": {"content": text} if text else {},
                 "logprobs": formatter.chat_logprobs(token_ids, logprobs, top_logprobs),
                 "finish_reason": finish,
                 "stop_reason": completion.stop_reason if finish else None}
                for completion, (text, token_ids, logprobs, _, finish)
                in _deltas(choices, output, top_logprobs is not None)]

    # The role comes first, in its own chunk per choice, as OpenAI sends it.
    role_chunk = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                   "finish_reason": None} for i in range(n)]
    return _stream_events(engine, request_id, first, outputs,
                          _chunk_base(request_id, "chat.completion.chunk", model_name),
                          chunk_choices, include_usage, first_choices=role_chunk)


def _chunk_base(request_id: str, kind: str, model_name: str) -> dict:
    """The fields every chunk of one stream repeats."""
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model_name}


def _deltas(choices: dict[int, _Choice], output: RequestOutput, want_logprobs: bool):
    """``(completion, delta)`` for each completion of ``output`` with something new to send
    (see :func:`_take_delta`)."""
    for completion in output.outputs:
        delta = _take_delta(choices, completion, want_logprobs)
        if delta is not None:
            yield completion, delta


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
                    yield _sse({**base, "choices": [], "usage": usage(output)})
                break
            output = await anext(outputs)
    except (EngineDeadError, StopAsyncIteration) as exc:
        yield _sse(error_body(f"the request ended early: {exc or 'no final output'}", "server_error"))
    finally:
        if not finished:  # client disconnect, error: free the request's pages now
            engine.abort(request_id)
    yield "data: [DONE]\n\n"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
