"""From an OpenAI request body to the engine's input: the prompt's token ids (a completion
prompt as text or ids; chat messages through the tokenizer's chat template, or ``role: content``
lines without one), the :class:`SamplingParams` and the prefix cache's keys (the salt). Anything the engine cannot take becomes an
:class:`OpenAIError` (400) here, before the request reaches the engine."""

from __future__ import annotations

from typing import Any

from vmemkv.cache.hashing import CacheKeys
from vmemkv.engine.core.chat import chat_prompt_ids as template_prompt_ids, has_chat_template
from vmemkv.engine.serving.openai_protocol import ChatMessage, OpenAIError, SamplingFields
from vmemkv.engine.core.sampling_params import SamplingParams, check_context_length
from vmemkv.errors import RequestTooLongError


def check_model(model: str | None, served_name: str) -> None:
    if model is not None and model != served_name:
        raise OpenAIError(404, f"the model {model!r} does not exist; this server serves "
                          f"{served_name!r}", param="model", code="model_not_found")


def completion_prompt_ids(tokenizer: Any, prompt: str | list[int] | list[str] | list[list[int]]
                          ) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise OpenAIError(400, f"a list of {len(prompt)} prompts is not supported; send "
                              "one prompt per request", param="prompt")
        prompt = prompt[0]
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    return check_prompt_ids(ids)


def chat_prompt_ids(tokenizer: Any, messages: list[ChatMessage]) -> list[int]:
    conversation = [{**m.model_dump(exclude_none=True), "content": message_text(m)}
                    for m in messages]
    if has_chat_template(tokenizer):
        try:
            ids = template_prompt_ids(tokenizer, conversation)
        except Exception as exc:  # a template may reject a role order, e.g. two user turns
            raise OpenAIError(400, f"the chat template rejected the messages: {exc}",
                              param="messages") from exc
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in conversation) + "assistant: "
        ids = tokenizer.encode(text)
    return check_prompt_ids(list(ids))


def check_prompt_ids(ids: list[int]) -> list[int]:
    if not ids:
        raise OpenAIError(400, "the prompt is empty", param="prompt")
    if any(not isinstance(t, int) or t < 0 for t in ids):
        raise OpenAIError(400, "prompt token ids must be non-negative integers", param="prompt")
    return ids


def message_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part in message.content:
        if part.get("type") != "text":
            raise OpenAIError(400, f"message content of type {part.get('type')!r} is not "
                              "supported; only text", param="messages")
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)


def sampling_params(body: SamplingFields, prompt_ids: list[int], max_tokens: int | None,
                    logprobs: int | None, max_model_len: int) -> SamplingParams:
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise OpenAIError(400, f"{name} is not supported; leave it unset or 0", param=name)
    if max_tokens is None:  # as much as the context allows
        max_tokens = max(1, max_model_len - len(prompt_ids))
    try:  # vLLM's 400, before anything reaches the engine
        check_context_length(len(prompt_ids), max_tokens, max_model_len)
    except RequestTooLongError as exc:
        raise OpenAIError(400, str(exc)) from exc
    try:
        return SamplingParams(
            n=body.n, max_tokens=max_tokens, logprobs=logprobs, seed=body.seed,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            min_p=0.0 if body.min_p is None else body.min_p,
            stop=body.stop, stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output, kv_exact=body.kv_exact)
    except ValueError as exc:
        raise OpenAIError(400, str(exc)) from exc


def cache_keys(body: SamplingFields, tenant_salt: str | None) -> CacheKeys:
    """The prefix-cache keys of a request: its ``cache_salt``, under its tenant's salt (derived
    from the API key in use) when the server salts per key, so no request can pick a salt that
    reaches another tenant's pages."""
    if tenant_salt is None:
        return CacheKeys(cache_salt=body.cache_salt)
    if body.cache_salt is None:
        return CacheKeys(cache_salt=tenant_salt)
    return CacheKeys(cache_salt=f"{tenant_salt}/{body.cache_salt}")
