"""The offline API: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import itertools

from tqdm.auto import tqdm

from vmemkv.engine.core.chat import chat_prompt_ids
from vmemkv.engine.core.config import EngineConfig
from vmemkv.engine.core.llm_engine import LLMEngine, run_to_completion
from vmemkv.engine.core.outputs import RequestOutput
from vmemkv.engine.core.sampling_params import SamplingParams
from vmemkv.engine.core.threads import default_threads
from vmemkv.errors import InvalidInputError


class LLM:
    """Offline batch generation on vmemkv. Keyword arguments are ``EngineConfig`` fields;
    ``threads`` defaults to the cores this process may run on less one (``engine/threads.py``).

    >>> llm = LLM(model="tiny-llama")
    >>> outputs = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=8, temperature=0))
    """

    def __init__(self, model: str = "tiny-llama", *, hf_model=None, tokenizer=None, **config):
        config.setdefault("threads", default_threads())
        self.engine = LLMEngine(EngineConfig(model=model, **config), hf_model, tokenizer, stream=False)
        self._ids = itertools.count()
        self._closed = False

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids); outputs in prompt order.
        ``priority``: one int per prompt, lower first (as vLLM's; only with ``policy="priority"``).
        Raises ``RequestTooLongError`` before anything runs if a prompt with its ``max_tokens``
        does not fit in ``max_model_len`` (as vLLM's server answers 400)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [str(next(self._ids)) for _ in prompts]
        requests = list(zip(ids, prompts, params))
        priorities = self._priorities(priority, ids)
        for request in requests:  # all before any runs: a refused one leaves the engine as it was
            self.engine.check_request(*request)
        with tqdm(total=len(prompts), desc="generating", disable=not use_tqdm) as progress:
            final = run_to_completion(self.engine, requests, progress, priorities)
        return [final[i] for i in ids]

    def _priorities(self, priority: list[int] | None, ids: list[str]) -> list[int] | None:
        """``priority`` checked whole before any request is added, so a refusal adds none."""
        if priority is None:
            return None
        if not isinstance(priority, (list, tuple)) or len(priority) != len(ids):
            count = len(priority) if isinstance(priority, (list, tuple)) else type(priority).__name__
            raise InvalidInputError(f"priority must be a list of one int per prompt: {len(ids)} "
                                    f"prompts, priority has {count}")
        for request_id, value in zip(ids, priority):
            self.engine.check_priority(request_id, value)
        return list(priority)

    def chat(self, conversations: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Answer each conversation (a list of ``{"role", "content"}`` messages) through the
        tokenizer's chat template; one conversation or a list of them."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        name = self.engine.model_name
        prompts = [chat_prompt_ids(self.tokenizer, messages, name) for messages in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def close(self) -> None:
        """Give back the engine's KV memory and its share of a shared KV budget (idempotent);
        ``with LLM(...) as llm:`` closes it at the block's end."""
        if not self._closed:
            self._closed = True
            self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def sleep(self, level: int = 1) -> int:
        """Give back every KV page (level 1 also moves the weights to host memory on CUDA;
        level 2 discards them), as vLLM's ``LLM.sleep``; returns the KV bytes given back."""
        return self.engine.sleep(level)

    def wake_up(self) -> None:
        """Undo ``sleep``: weights back (reloaded after level 2), KV pages taken as needed."""
        self.engine.wake_up()

    def is_sleeping(self) -> bool:
        return bool(self.engine.sleep_level)

    @property
    def tokenizer(self):
        return self.engine.tokenizer
