"""What the engine knows about a request: one :class:`Sequence` per completion.

A sequence holds its :class:`vmemkv.KVRequest`, which holds its token ids (prompt + output: the
one list the engine appends sampled tokens to and the KV cache manager reads) and its allocation
(reserved and computed positions, slot, blocks); the sequence keeps no copy of either.

A request is its first sequence. With ``n > 1`` completions the other ``n - 1`` are forks of it,
made when its prompt is computed (as vLLM's parallel sampling forks a request's children): each
has ``parent`` set, and the first lists them in ``forks``. What belongs to the request as a whole
(its error, its cached prompt tokens, its outputs) is kept on the first sequence, ``request``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from vmemkv.cache.request import KVRequest
from vmemkv.engine.core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    kv: KVRequest  # token ids (prompt + output) and KV allocation, shared with the manager
    request_id: str  # the request's id (a fork's KVRequest is named "<id>#<index>")
    prompt: str | None  # the prompt's text, when it was given as text
    params: SamplingParams
    num_prompt_tokens: int
    index: int = 0  # which of the request's n completions
    parent: "Sequence | None" = None  # the request's first sequence, for a fork
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    detokenizer: object | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # The request's, on its first sequence only:
    forks: list["Sequence"] | None = None  # the other n - 1 (none for n = 1), made at its first sample
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held at admission
    error: str | None = None  # why the request failed

    @property
    def request(self) -> "Sequence":
        """The request's first sequence (this one, unless it is a fork)."""
        return self.parent or self

    @property
    def sequences(self) -> list["Sequence"]:
        """The request's sequences made so far, first one first (call on the first)."""
        return [self, *self.forks] if self.forks else [self]

    @property
    def seq_id(self) -> str:
        """The KV cache manager's request id."""
        return self.kv.request_id

    @property
    def token_ids(self) -> list[int]:
        """Prompt + output: the KVRequest's list (append sampled tokens to it)."""
        return self.kv.token_ids

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.kv.token_ids[:self.num_prompt_tokens]

    @property
    def num_computed(self) -> int:
        """Tokens whose K/V is in the cache (0 while waiting)."""
        return self.kv.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        kv = self.kv
        return len(kv.token_ids) - kv.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def request_finished(self) -> bool:
        """The request has ended: it failed, or all ``n`` sequences finished (call on the first)."""
        return self.error is not None or (self.forks is not None  # planned at its first sample
                                          and all(seq.is_finished for seq in self.sequences))

    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: higher priority (lower value) first, then earlier arrival."""
        return (self.priority, self.arrival_time, self.index)
