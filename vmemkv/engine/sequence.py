"""What the engine knows about a request: one group, ``n`` sequences (one per completion)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ..hashing import CacheKeys
from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: str  # the KV cache manager's request id
    group: "SequenceGroup"
    index: int  # which of the group's n completions
    token_ids: list[int]  # prompt + output
    generator: torch.Generator | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0  # tokens whose K/V is in the cache
    num_manager_tokens: int = 0  # leading token ids the manager has been told
    detokenizer: object | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.group.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

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
