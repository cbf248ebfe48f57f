"""From the engine's :class:`RequestOutput` to OpenAI's response pieces: a completion choice,
logprobs in the legacy completions format (parallel lists) and in chat's (one entry per token,
with bytes), usage counts, and the final output of a non-streamed request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from vmemkv.engine.serving.openai_protocol import OpenAIError
from vmemkv.engine.core.outputs import CompletionOutput, RequestOutput


class ResponseFormatter:
    """Response pieces that need the tokenizer (token strings)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def completion_choice(self, completion: CompletionOutput, text: str, token_ids: list[int],
                          logprobs: list[dict[int, float]] | None, text_offset: int,
                          finish_reason: str | None) -> dict:
        return {"index": completion.index, "text": text,
                "logprobs": self.completion_logprobs(token_ids, logprobs, text_offset),
                "finish_reason": finish_reason,
                "stop_reason": completion.stop_reason if finish_reason else None}

    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                            text_offset: int) -> dict | None:
        """The legacy completions format: parallel lists, tokens as strings."""
        if logprobs is None:
            return None
        result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                   "text_offset": []}
        for token_id, entry in zip(token_ids, logprobs):
            token = self.token_text(token_id)
            result["tokens"].append(token)
            result["token_logprobs"].append(entry.get(token_id))
            result["top_logprobs"].append({self.token_text(t): lp for t, lp in entry.items()})
            result["text_offset"].append(text_offset)
            text_offset += len(token)
        return result

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                      top_logprobs: int | None) -> dict | None:
        if logprobs is None or top_logprobs is None:
            return None
        content = []
        for token_id, entry in zip(token_ids, logprobs):
            top = sorted(entry.items(), key=lambda item: -item[1])[:top_logprobs]
            content.append({**self.chat_token(token_id, entry.get(token_id)),
                            "top_logprobs": [self.chat_token(t, lp) for t, lp in top]})
        return {"content": content}

    def chat_token(self, token_id: int, logprob: float | None) -> dict:
        token = self.token_text(token_id)
        return {"token": token, "logprob": logprob,
                "bytes": list(token.encode("utf-8", errors="replace"))}

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def usage(output: RequestOutput) -> dict:
    prompt_tokens = len(output.prompt_token_ids)
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def last_output(first: RequestOutput, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The request's final output (a non-streamed answer); an engine error becomes a 500."""
    final = first
    if not final.finished:
        async for output in outputs:
            final = output
    if final.error is not None:
        raise OpenAIError(500, final.error, type="server_error")
    return final
