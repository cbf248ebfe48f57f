"""The step's forward: the scheduler's plan carried out, the logits of the rows that sample out.

``StepRunner.run`` takes the scheduler's plan: it packs every scheduled sequence's new tokens
into one ragged batch, asks the addressing strategy (``addressing.py``) for each sequence's span
and the step's attention, maps the lookahead blocks the scheduler gave decoding sequences (slots
only; through the plan's ``KVStep``) on a worker thread while the forward runs (on CPU at once
on the step thread, see ``LookaheadMapper``), and runs the model (``ModelRunner``). It holds no
KV cache manager and decides nothing about the cache: a lookahead mapping refused by the mapping
budget comes back in ``ForwardOutput`` for the scheduler to give back.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from vmemkv.errors import MappingLimitError
from vmemkv.engine.core.addressing import Addressing
from vmemkv.engine.core.model_runner import ModelRunner
from vmemkv.engine.core.scheduler import KVStep, SchedulerOutput
from vmemkv.engine.core.sequence import Sequence
from vmemkv.memory.slots import MapJob


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [len(samplers), vocab]: row i is samplers[i]'s next-token logits
    samplers: list[Sequence]  # sequences whose next token is due (their last token was computed)
    refused_lookahead: list[MapJob] = field(default_factory=list)  # the mapping budget said no


class LookaheadMapper:
    """Overlapped mapping: one worker maps lookahead blocks while the forward pass runs.

    Without overlap (``map_now``, the CPU forward) the blocks are mapped at once on the step
    thread: the CPU forward holds the cores, so the worker hides nothing there, and waking it and
    sharing the GIL with it cost more than the mapping (measured on 2 shared cores, tiny-llama,
    B = 32 and 64: 0.35-0.5 ms per step, 3-5 %). That time counts as waited."""

    def __init__(self):
        self._worker: ThreadPoolExecutor | None = None  # started by the first overlapped start
        self.background_seconds = 0.0  # lookahead mapping (on the worker when overlapped)
        self.wait_seconds = 0.0  # time the step still waited for it

    def map_now(self, kv: KVStep, jobs: list[MapJob]) -> list[MapJob]:
        """Map ``jobs`` (through ``kv``) on the step thread; returns them if the mapping was
        refused, else []."""
        waited = time.perf_counter()
        refused = self._map(kv, jobs)
        self.wait_seconds += time.perf_counter() - waited
        return refused

    def start(self, kv: KVStep, jobs: list[MapJob]) -> Future:
        """Map ``jobs`` (through ``kv``) on the worker (they touch only positions past every sequence's
        reservation, which this step's forward never reads); ``finish`` takes the result."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="vmemkv-map")
        return self._worker.submit(self._map, kv, jobs)

    def finish(self, mapping: Future) -> list[MapJob]:
        """Wait for the worker; returns the jobs if their mapping was refused (it only costs the
        head start: the blocks go back, and are mapped inline when reached), else []."""
        waited = time.perf_counter()
        refused = mapping.result()
        self.wait_seconds += time.perf_counter() - waited
        return refused

    def _map(self, kv: KVStep, jobs: list[MapJob]) -> list[MapJob]:
        start = time.perf_counter()
        try:
            kv.map_lookahead(jobs)
        except MappingLimitError:
            return jobs
        finally:
            self.background_seconds += time.perf_counter() - start
        return []

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)


class StepRunner:
    """Inputs and attention metadata, the lookahead mapping the plan names, the forward."""

    def __init__(self, model_runner: ModelRunner, addressing: Addressing,
                 lookahead: LookaheadMapper | None):
        self.model_runner = model_runner
        self.addressing = addressing
        self.lookahead = lookahead
        self.device = model_runner.device
        # A CPU forward leaves no core idle for the mapping worker: map lookahead blocks inline.
        self.overlap_mapping = self.device.type != "cpu"
        self.attention_seconds = 0.0
        self.attention_copy_seconds = 0.0  # of which gathering K/V (block tables)

    def run(self, plan: SchedulerOutput) -> ForwardOutput:
        """The forward over the plan's scheduled sequences, mapping its lookahead blocks."""
        scheduled, lookahead_jobs = plan.scheduled, plan.lookahead
        spans, input_ids, positions, rows, samplers = [], [], [], [], []
        span_of = self.addressing.span
        for item in scheduled:
            seq, count = item.seq, item.num_new_tokens
            kv = seq.kv
            token_ids, begin, computed = kv.token_ids, len(input_ids), kv.num_computed_tokens
            spans.append(span_of(kv, begin, count, computed))
            if count == 1:  # decode: no slices
                input_ids.append(token_ids[computed])
                positions.append(computed)
            else:
                input_ids += token_ids[computed: computed + count]
                positions += range(computed, computed + count)
            if computed + count == len(token_ids):  # its next token is due
                rows.append(begin + count - 1)
                samplers.append(seq)
        lookahead, refused = self.lookahead, []
        overlap = bool(lookahead_jobs) and self.overlap_mapping
        if lookahead_jobs and not overlap:
            # Inline (CPU): map the lookahead blocks before the attention makes slots readable, so
            # that no filler page goes under a block mapped in the same step (mapping over a page
            # that a batched read has touched costs 2-5x more than over the bare reservation).
            refused = lookahead.map_now(plan.kv, lookahead_jobs)
        attention = self.addressing.attention(spans)
        # Overlapped: the worker maps while the forward runs, after the attention is built.
        mapping = lookahead.start(plan.kv, lookahead_jobs) if overlap else None
        # Every row sampled (all decodes): take all logits, no gather.
        all_rows = len(rows) == len(input_ids)
        logits = self.model_runner.forward(input_ids, positions, attention,
                                           None if all_rows else rows or [len(input_ids) - 1])
        self.attention_seconds += attention.seconds
        self.attention_copy_seconds += attention.copy_seconds
        if mapping is not None:
            refused = lookahead.finish(mapping)
        return ForwardOutput(logits, samplers, refused)

    @property
    def map_background_seconds(self) -> float:
        return self.lookahead.background_seconds if self.lookahead is not None else 0.0

    @property
    def map_wait_seconds(self) -> float:
        return self.lookahead.wait_seconds if self.lookahead is not None else 0.0

    def close(self) -> None:
        if self.lookahead is not None:
            self.lookahead.close()
