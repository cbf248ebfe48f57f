"""The step's forward: scheduled sequences in, the logits of the rows that sample out.

``StepRunner.run`` packs every scheduled sequence's new tokens into one ragged batch, asks the
addressing strategy (``addressing.py``) for each sequence's span and the step's attention, gives
decoding sequences about to cross a block boundary their next block and maps it on a worker thread
while the forward runs (slots only; on CPU at once on the step thread, see ``LookaheadMapper``), and
runs the model (``ModelRunner``). It changes nothing the
step's postprocessing (``postprocess.py``) owns: no commit, no fork, no token appended.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from vmemkv.errors import MappingLimitError
from vmemkv.cache.manager import KVCacheManager
from vmemkv.engine.core.addressing import Addressing
from vmemkv.engine.core.model_runner import ModelRunner
from vmemkv.engine.core.scheduler import ScheduledSeq
from vmemkv.engine.core.sequence import Sequence


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [len(samplers), vocab]: row i is samplers[i]'s next-token logits
    samplers: list[Sequence]  # sequences whose next token is due (their last token was computed)


class LookaheadMapper:
    """Overlapped mapping: one worker maps lookahead blocks while the forward pass runs. A mapping
    the worker is refused (the mapping budget) is cancelled on the step thread.

    Without overlap (``start(..., overlap=False)``, the CPU forward) the blocks are mapped at once
    on the step thread: the CPU forward holds the cores, so the worker hides nothing there, and
    waking it and sharing the GIL with it cost more than the mapping (measured on 2 shared cores,
    tiny-llama, B = 32 and 64: 0.35-0.5 ms per step, 3-5 %). That time counts as waited."""

    def __init__(self, manager: KVCacheManager, margin_tokens: int, keep_free: int):
        self.manager = manager
        self.margin = margin_tokens
        self.keep_free = keep_free
        self.tokens_per_block = manager.layout.tokens_per_page  # as manager.blocks_for_tokens
        self._worker: ThreadPoolExecutor | None = None  # started by the first overlapped start
        self.background_seconds = 0.0  # lookahead mapping (on the worker when overlapped)
        self.wait_seconds = 0.0  # time the step still waited for it

    def start(self, scheduled: list[ScheduledSeq], overlap: bool = True):
        """Give decoding sequences about to cross a block boundary their next block now, and map
        it on the worker (it touches only positions past every sequence's reservation, which this
        step's forward never reads), or here when not ``overlap``. Returns what ``finish`` takes,
        or None."""
        # Only a sequence whose next `margin` positions reach a block past its reservation can
        # get one (the manager skips the others): ask about those alone.
        manager, margin, size = self.manager, self.margin, self.tokens_per_block
        decoding = []
        for item in scheduled:
            seq = item.seq
            kv = seq.kv
            reserved = kv.num_tokens
            # blocks_for_tokens(reserved + margin) > blocks_for_tokens(reserved), inlined and
            # asked first (true for about one sequence in tokens_per_block / margin): this loop
            # runs over every running sequence each step
            if (-(-(reserved + margin) // size) > -(-reserved // size)
                    and kv.num_computed_tokens >= seq.num_prompt_tokens):
                decoding.append(kv)
        if not decoding:
            return None
        jobs = manager.allocate_lookahead(decoding, margin, self.keep_free)
        if not jobs:
            return None
        if not overlap:
            waited = time.perf_counter()
            try:
                self._map(jobs)
            except MappingLimitError:
                manager.cancel_lookahead(jobs)
            self.wait_seconds += time.perf_counter() - waited
            return None
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="vmemkv-map")
        return self._worker.submit(self._map, jobs), jobs

    def finish(self, future, jobs) -> None:
        """Wait for the worker. A mapping it was refused only costs the head start: the blocks
        go back, and are mapped inline when reached."""
        waited = time.perf_counter()
        try:
            future.result()
        except MappingLimitError:
            self.manager.cancel_lookahead(jobs)
        self.wait_seconds += time.perf_counter() - waited

    def _map(self, jobs) -> None:
        start = time.perf_counter()
        self.manager.map_lookahead(jobs)
        self.background_seconds += time.perf_counter() - start

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)


class StepRunner:
    """Inputs and attention metadata, the overlapped lookahead mapping, the forward."""

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

    def run(self, scheduled: list[ScheduledSeq]) -> ForwardOutput:
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
        lookahead, overlap = self.lookahead, self.overlap_mapping
        if lookahead is not None and not overlap:
            # Inline (CPU): map the lookahead blocks before the attention makes slots readable, so
            # that no filler page goes under a block mapped in the same step (mapping over a page
            # that a batched read has touched costs 2-5x more than over the bare reservation).
            lookahead.start(scheduled, overlap=False)
        attention = self.addressing.attention(spans)
        # Overlapped: the worker maps while the forward runs, after the attention is built.
        mapping = lookahead.start(scheduled) if lookahead is not None and overlap else None
        # Every row sampled (all decodes): take all logits, no gather.
        all_rows = len(rows) == len(input_ids)
        logits = self.model_runner.forward(input_ids, positions, attention,
                                           None if all_rows else rows or [len(input_ids) - 1])
        self.attention_seconds += attention.seconds
        self.attention_copy_seconds += attention.copy_seconds
        if mapping is not None:
            self.lookahead.finish(*mapping)
        return ForwardOutput(logits, samplers)

    @property
    def map_background_seconds(self) -> float:
        return self.lookahead.background_seconds if self.lookahead is not None else 0.0

    @property
    def map_wait_seconds(self) -> float:
        return self.lookahead.wait_seconds if self.lookahead is not None else 0.0

    def close(self) -> None:
        if self.lookahead is not None:
            self.lookahead.close()
