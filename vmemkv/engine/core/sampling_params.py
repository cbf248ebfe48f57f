"""How to pick tokens and when to stop: one dataclass, validated when it is built."""

from __future__ import annotations

import math
from dataclasses import dataclass

from vmemkv.errors import RequestTooLongError


@dataclass
class SamplingParams:
    """Per-request sampling settings, with the OpenAI / vLLM meanings.

    ``temperature == 0`` is greedy. ``top_k`` of 0 or -1 is off. ``stop`` strings end a sequence
    when they appear in the text (they are cut from the output unless
    ``include_stop_str_in_output``); ``stop_token_ids`` end it when sampled. ``logprobs=k`` returns,
    per generated token, the k most likely tokens plus the sampled one. ``kv_exact``: reuse
    only exact cached KV, never the cold tier's lossy blocks (``EngineConfig.kv_cold_tier``), so
    the request's tokens are what recomputing its prompt would give.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    kv_exact: bool = False

    def __post_init__(self) -> None:
        # Normalise first so every consumer sees lists, never None or a bare string.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    def _validate(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check_number("temperature", self.temperature, minimum=0.0)
        _check_int("top_k", self.top_k, minimum=-1)
        _check_number("top_p", self.top_p, minimum=0.0, maximum=1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p must be in (0, 1], got 0; use temperature=0 for greedy decoding")
        _check_number("min_p", self.min_p, minimum=0.0, maximum=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=-(2**63), maximum=2**64 - 1)
        _check_int("max_tokens", self.max_tokens, minimum=1)
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop must be non-empty strings, got {stop!r}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids entry", token_id, minimum=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "kv_exact"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


def check_context_length(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """Refuse a request whose prompt and ``max_tokens`` together pass ``max_model_len``, in the
    words of vLLM's server (which answers such a request with a 400, not a shorter output)."""
    if prompt_tokens >= max_model_len:
        raise RequestTooLongError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens} tokens in the messages. Please reduce the length of the "
            "messages.")
    if prompt_tokens + max_tokens > max_model_len:
        raise RequestTooLongError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion.")


def _check_int(name: str, value: object, minimum: int | None = None,
               maximum: int | None = None) -> None:
    # bool is an int subclass; True as a token count is a caller bug, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


def _check_number(name: str, value: object, minimum: float | None = None,
                  maximum: float | None = None) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum:g}, got {value:g}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum:g}, got {value:g}")
