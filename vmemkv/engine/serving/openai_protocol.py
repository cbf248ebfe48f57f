"""The OpenAI API's shapes for vmemkv's server: request bodies (pydantic models, validated by
FastAPI before a handler runs) and the error every failure is answered with
(``{"error": {"message", "type", "param", "code"}}``). No engine, no I/O."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

MAX_LOGPROBS = 20  # OpenAI allows up to 20 top logprobs in chat; the same cap for completions


# ---- request bodies -------------------------------------------------------------------------

class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
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
    # vLLM's per-request salt for the prefix cache: requests with different salts never share
    # cached pages (nor can time each other's hits). Empty is refused, as vLLM does.
    cache_salt: str | None = Field(default=None, min_length=1)
    # reuse only exact cached KV, never the cold tier's lossy pages (serve --kv-cold-tier)
    kv_exact: bool = False
    # vLLM's scheduling priority: lower first, ties by arrival; other than 0 only under
    # --policy priority (400 otherwise)
    priority: int = 0


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... pass to the template

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
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


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(error.message, error.type, error.param, error.code),
                        status_code=error.status_code)
