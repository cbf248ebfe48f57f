"""The real chat text of the ``chat-real`` workload (``data/chat_prompts.json``, package data) and
how a prompt of it becomes token ids (the model's chat template, else plain text)."""

from __future__ import annotations

import functools
import json
from importlib import resources

from vmemkv.engine.core.chat import chat_prompt_ids, has_chat_template

CHAT_PROMPTS = "chat_prompts.json"  # in vmemkv/ab/data/, package data


@functools.cache
def _chat_prompts_text() -> str:
    return resources.files("vmemkv.ab").joinpath("data", CHAT_PROMPTS).read_text(encoding="utf-8")


def load_chat_prompts() -> dict:
    """The stored chat text: ``{"about": ..., "assistants": [{"name", "system", "questions"}]}``
    (a fresh copy each call)."""
    data = json.loads(_chat_prompts_text())
    for assistant in data["assistants"]:
        if not assistant["system"] or not assistant["questions"]:
            raise ValueError(f"{CHAT_PROMPTS}: assistant {assistant.get('name')!r} needs a system "
                             "prompt and questions")
    return data


def plain_chat_text(system: str, question: str) -> str:
    """The conversation as plain text, for a tokenizer without a chat template (the system prompt
    first, so requests that share it share a token prefix)."""
    return f"{system}\n\nUser: {question}\nAssistant:"


def render_chat(tokenizer, system: str, question: str) -> list[int]:
    """Token ids of a system prompt and one user question: through the tokenizer's chat template
    (with the assistant's generation prompt) when it has one, else plain text through the
    tokenizer, else (no tokenizer) the plain text's UTF-8 bytes, the built-in models' vocabulary."""
    if tokenizer is not None and has_chat_template(tokenizer):
        return chat_prompt_ids(tokenizer, [{"role": "system", "content": system},
                                           {"role": "user", "content": question}])
    text = plain_chat_text(system, question)
    if tokenizer is None:
        return list(text.encode("utf-8"))
    return list(tokenizer(text)["input_ids"])
