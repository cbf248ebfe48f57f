"""What the engine knows about a request: one group, ``n`` sequences (one per completion).

A sequence holds its :class:`vmemkv.KVRequest`, which holds its token ids (prompt + output: the
one list the engine appends sampled tokens to and the KV cache manager reads) and its allocation
(reserved and computed positions, slot, blocks); the sequence keeps no copy of either."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from vmemkv.cache.hashing import CacheKeys
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
    group: "SequenceGroup"
    index: int  # which of the group's n completions
    generator: torch.Generator | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    detokenizer: object | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def seq_id(self) -> str:
        """The KV cache manager's request id."""
        return self.kv.request_id

    @property
    def token_ids(self) -> list[int]:
        """Prompt + output: the KVRequest's list (append sampled tokens to it)."""
        return self.kv.token_ids

    @property
    def num_computed(self) -> int:
        """Tokens whose K/V is in the cache (0 while waiting)."""
        return self.kv.num_computed_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.group.prompt_token_ids)

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

    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: higher priority (lower value) first, then earlier arrival."""
        return (self.group.priority, self.group.arrival_time, self.index)


@dataclass(eq=False)
class SequenceGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    keys: CacheKeys = field(default_factory=CacheKeys)
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # the other n-1 sequences exist
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def is_finished(self) -> bool:
        return self.forked and all(seq.is_finished for seq in self.seqs)
