"""The engine: requests in, one scheduler step and one packed forward at a time, outputs out."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence as Seq

from ..attention import BlockTableAttention, ContiguousAttention, SequenceSpan
from ..attention.choice import AttentionChoice, choose_attention
from ..attention.flash import FlashBlockTableAttention, FlashSlotAttention
from .. import validation as check
from ..errors import MappingLimitError, RequestTooLongError
from ..hashing import CacheKeys
from ..hf_support import check_attention_supported, text_config
from ..manager import KVCacheManager
from .chat import end_of_turn_token_ids
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .metrics import EngineMetrics
from .model_runner import ModelRunner
from .models import load_model
from .outputs import CompletionOutput, RequestOutput
from .sampler import Sampler, make_generator
from .sampling_params import SamplingParams
from .scheduler import ScheduledSeq, Scheduler
from .sequence import Sequence, SequenceGroup, SequenceStatus


class LLMEngine:
    """``stream``: ``step()`` returns every request that progressed, with its text so far; when
    False (offline use) it returns finished requests only, and text is decoded once at the end
    for requests without stop strings."""

    def __init__(self, config: EngineConfig, model=None, tokenizer=None, stream: bool = True):
        self.config = config
        self.stream = stream
        if model is None:
            model, tokenizer = load_model(config.model, config.torch_dtype, config.device, config.seed)
        self.model_name = config.model
        self.tokenizer = tokenizer
        # Before any KV memory is taken: refuse attention the engine would silently get wrong.
        check_attention_supported(model.config, config.max_model_len, replaces_attention=True,
                                  who="the vmemkv engine")
        self.manager = KVCacheManager(config.cache_config(model))
        self.runner = ModelRunner(model)
        self.scheduler = Scheduler(config, self.manager)
        self.attention_choice = self._choose_attention(model)
        self.attention_kernel = self.attention_choice.label  # what runs: flash-bundled, triton, sdpa
        self.decode_kernel = self.attention_choice.kind == "triton"
        self.sampler = Sampler()
        self.metrics = EngineMetrics()
        self.groups: dict[str, SequenceGroup] = {}
        eos = text_config(model.config).eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        # HF generate stops at the generation config's eos too, and a chat model at its
        # template's end-of-turn token (which need not be the config's eos).
        generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos_token_ids |= set(generation_eos if isinstance(generation_eos, list)
                                  else [generation_eos] if generation_eos is not None else [])
        self.eos_token_ids |= set(end_of_turn_token_ids(tokenizer))
        self.step_seconds = 0.0
        self.attention_seconds = 0.0
        self.attention_copy_seconds = 0.0  # of which gathering K/V (block tables)
        self.num_steps = 0
        self.peak_blocks_in_use = 0
        self._fragmentation = [0, 0]  # sums over steps: bytes held past the tokens stored, bytes stored
        # Overlapped mapping: one worker maps lookahead pages while the forward pass runs.
        self._mapper = ThreadPoolExecutor(1, thread_name_prefix="vmemkv-map")
        self.map_background_seconds = 0.0  # mapping done on the worker
        self.map_wait_seconds = 0.0  # time the step still waited for the worker

    def _choose_attention(self, model) -> AttentionChoice:
        """``config.attention`` resolved once for this device, dtype, shapes and KV addressing."""
        layout, text = self.manager.layout, text_config(model.config)
        paged = self.config.kv_backend == "paged"
        return choose_attention(
            self.config.attention, self.runner.device, self.config.kv_backend, layout.dtype,
            text.num_attention_heads, layout.num_kv_heads, layout.head_dim, self.manager.tokens_per_page,
            None if paged else self.manager.kv_views(0))

    # --- requests ----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, keys: CacheKeys | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = list(self.tokenizer.encode(prompt)) if text is not None else list(prompt)
        self._validate_prompt(request_id, token_ids)
        group = SequenceGroup(request_id, text, token_ids, params, priority, keys or CacheKeys())
        group.seqs.append(self._new_sequence(group, 0))
        self.groups[request_id] = group
        self.scheduler.add(group.seqs[0])
        self.metrics.on_request_added(request_id, len(token_ids), time.monotonic())

    def _validate_prompt(self, request_id: str, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        check.token_ids(token_ids, f"request {request_id!r}'s prompt", self.manager.config.vocab_size)
        limit = self.config.max_model_len
        if len(token_ids) >= limit:
            raise RequestTooLongError(
                f"request {request_id!r} has {len(token_ids)} prompt tokens; max_model_len is {limit} "
                "and at least one token must be generated: shorten the prompt or raise max_model_len")
        problem = self.manager.why_never_fits(len(token_ids) + 1)  # the prompt and one new token
        if problem is not None:
            raise RequestTooLongError(f"request {request_id!r}: {problem}")

    def _new_sequence(self, group: SequenceGroup, index: int) -> Sequence:
        seed = None if group.params.seed is None else group.params.seed + index
        seq_id = group.request_id if index == 0 else f"{group.request_id}#{index}"
        return Sequence(seq_id, group, index, list(group.prompt_token_ids),
                        generator=make_generator(seed, self.runner.device),
                        detokenizer=IncrementalDetokenizer.from_params(
                            self.tokenizer, group.prompt_token_ids, group.params,
                            final_only=not self.stream))

    def abort_request(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        for seq in group.seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                seq.finish_reason = "abort"
        self.metrics.on_request_finished(request_id, "abort", time.monotonic())
        self._update_gauges()  # its pages are free now; no step may come to say so

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # --- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        touched: dict[str, SequenceGroup] = {}
        for seq, reason in plan.failed:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "error"
            seq.group.error = reason
            touched[seq.group.request_id] = seq.group
        if plan.scheduled:
            to_sample = self._execute(plan.scheduled)
            generated: dict[str, int] = {}  # tokens per request this step, for the metrics
            for seq, token, logprobs in to_sample:
                self._append_token(seq, token, logprobs)
                request_id = seq.group.request_id
                generated[request_id] = generated.get(request_id, 0) + 1
                touched[request_id] = seq.group
            self.metrics.on_step_tokens(generated, time.monotonic())
        self.step_seconds += time.perf_counter() - start
        self.num_steps += 1
        self._record_memory()
        self._update_gauges()
        return [self._output(group) for group in touched.values()
                if self.stream or group.error is not None or group.is_finished]

    def _update_gauges(self) -> None:
        """Set the metrics' gauges to the scheduler and cache state now: after every step, and
        after an abort, which changes both between steps (the server steps only while requests
        are unfinished, so aborting the last one would leave the gauges stale)."""
        self.metrics.on_step(len(self.scheduler.running), len(self.scheduler.waiting),
                             len(self.scheduler.swapped), self.manager.usage(),
                             self.manager.cache_stats().prefix_hit_rate, self.scheduler.num_preemptions)

    def _execute(self, scheduled: list[ScheduledSeq]) -> list[tuple[Sequence, int, dict | None]]:
        """Run the forward pass for the scheduled tokens, commit them, and sample next tokens."""
        spans, input_ids, positions, rows, samplers = [], [], [], [], []
        paged = self.config.kv_backend == "paged"
        manager = self.manager
        for item in scheduled:
            seq, count = item.seq, item.num_new_tokens
            begin, computed = len(input_ids), seq.num_computed
            table = tuple(manager.block_table(seq.seq_id)) if paged else ()
            spans.append(SequenceSpan(manager.slot_of(seq.seq_id), begin, count, computed, table))
            if count == 1:  # decode: no slices
                input_ids.append(seq.token_ids[computed])
                positions.append(computed)
            else:
                input_ids += seq.token_ids[computed: computed + count]
                positions += range(computed, computed + count)
            if computed + count == len(seq.token_ids):  # its next token is due
                rows.append(begin + count - 1)
                samplers.append(seq)
        attention = self._attention(spans)
        mapping = self._start_lookahead(scheduled)
        # Every row sampled (all decodes): take all logits, no gather.
        all_rows = len(rows) == len(input_ids)
        logits = self.runner.forward(input_ids, positions, attention,
                                     None if all_rows else rows or [len(input_ids) - 1])
        self.attention_seconds += attention.seconds
        self.attention_copy_seconds += attention.copy_seconds
        if mapping is not None:
            self._finish_lookahead(*mapping)
        for item in scheduled:
            item.seq.num_computed += item.num_new_tokens
            manager.commit(item.seq.seq_id)
        if not samplers:
            return []
        seqs = samplers
        if not all(seq.group.forked for seq in samplers):  # a group's first sample: fork n-1
            seqs, logit_rows = [], []
            for row, seq in enumerate(samplers):
                for member in self._fork_group(seq):
                    seqs.append(member)
                    logit_rows.append(row)
            if len(seqs) != len(samplers):
                logits = logits[logit_rows]
        tokens, logprobs = self.sampler.sample(
            logits, [s.group.params for s in seqs], [s.generator for s in seqs])
        return list(zip(seqs, tokens.tolist(), logprobs))

    def _attention(self, spans: list[SequenceSpan]):
        choice, device = self.attention_choice, self.runner.device
        if self.config.kv_backend == "paged":
            if choice.kind == "flash":
                return FlashBlockTableAttention(spans, self.manager.block_views, self.manager.tokens_per_page,
                                                device, choice.kernel)
            return BlockTableAttention(spans, self.manager.block_views, self.manager.tokens_per_page,
                                       device, self.decode_kernel)
        if choice.kind == "flash":
            return FlashSlotAttention(spans, self.manager.kv_views, device, choice.kernel,
                                      choice.rows_per_slot, choice.num_rows)
        return ContiguousAttention(spans, self.manager.kv_views, device, self.decode_kernel,
                                   reads=self.manager.batched_reads())  # batched decode reads (CPU)

    def _start_lookahead(self, scheduled: list[ScheduledSeq]):
        """Give decoding sequences about to cross a page boundary their next page now, and map
        it on the worker while the forward pass runs (it touches only positions past every
        sequence's reservation, which this step's forward never reads)."""
        margin = self.config.lookahead_tokens
        if margin <= 0 or self.config.kv_backend == "paged":  # nothing to map
            return None
        # Only a sequence whose next `margin` positions reach a page past its reservation can
        # get one (the manager skips the others): ask about those alone.
        pages_for, manager = self.manager.blocks_for_tokens, self.manager
        decoding = []
        for item in scheduled:
            seq = item.seq
            if seq.num_computed >= seq.num_prompt_tokens:
                reserved = manager.num_tokens(seq.seq_id)
                if pages_for(reserved + margin) > pages_for(reserved):
                    decoding.append(seq.seq_id)
        if not decoding:
            return None
        jobs = self.manager.allocate_lookahead(decoding, margin, self.scheduler.watermark_blocks)
        return (self._mapper.submit(self._map_in_background, jobs), jobs) if jobs else None

    def _finish_lookahead(self, future, jobs) -> None:
        """Wait for the worker. A mapping it was refused (the mapping budget) only costs the
        head start: the blocks go back, and the pages are mapped inline when reached."""
        waited = time.perf_counter()
        try:
            future.result()
        except MappingLimitError:
            self.manager.cancel_lookahead(jobs)
        self.map_wait_seconds += time.perf_counter() - waited

    def _map_in_background(self, jobs) -> None:
        start = time.perf_counter()
        self.manager.map_lookahead(jobs)
        self.map_background_seconds += time.perf_counter() - start

    def _fork_group(self, seq: Sequence) -> list[Sequence]:
        """At a group's first sample, create its other n-1 sequences as copy-on-write forks
        sharing the prompt's pages. A fork that finds no slot or page waits as a new request
        instead (its prompt will then hit the prefix cache). Returns who samples from this row."""
        group = seq.group
        if group.forked:
            return [seq]
        group.forked = True
        members = [seq]
        for index in range(1, group.params.n):
            child = self._new_sequence(group, index)
            group.seqs.append(child)
            if self.manager.fork(seq.seq_id, child.seq_id):
                child.num_computed, child.num_manager_tokens = seq.num_computed, seq.num_manager_tokens
                child.status = SequenceStatus.RUNNING
                self.scheduler.running.append(child)
                members.append(child)
            else:
                self.scheduler.add(child)
        return members

    def _append_token(self, seq: Sequence, token: int, logprobs: dict | None) -> None:
        """Add a sampled token and check the stop conditions (the step counts it in the
        metrics, once per request per step)."""
        params = seq.group.params
        seq.token_ids.append(token)
        if params.logprobs is not None:
            seq.logprobs.append(logprobs)
        delta = seq.detokenizer.append(token)
        reason, stop_reason = None, None
        if not params.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif params.stop_token_ids and token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        elif (seq.detokenizer.stop
              and (matched := seq.detokenizer.check_stop(new_chars=len(delta))) is not None):
            reason, stop_reason = "stop", matched
        elif (len(seq.token_ids) - seq.num_prompt_tokens >= params.max_tokens
              or len(seq.token_ids) >= self.config.max_model_len):
            reason = "length"
        if reason is not None:
            if stop_reason is None or isinstance(stop_reason, int):
                seq.detokenizer.flush()
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            self.scheduler.remove(seq)

    def _output(self, group: SequenceGroup) -> RequestOutput:
        finished = group.error is not None or group.is_finished
        if finished:
            for seq in group.seqs:
                if not seq.is_finished:  # the rest of a group whose request failed
                    self.scheduler.remove(seq)
                    seq.finish_reason = "error"
            self.groups.pop(group.request_id, None)
            reason = "error" if group.error else group.seqs[0].finish_reason
            self.metrics.on_request_finished(group.request_id, reason, time.monotonic())
        outputs = [CompletionOutput(
            index=seq.index, text=seq.detokenizer.output_text(seq.is_finished),
            token_ids=list(seq.output_token_ids), finish_reason=seq.finish_reason,
            logprobs=list(seq.logprobs) if group.params.logprobs is not None else None,
            stop_reason=seq.stop_reason) for seq in group.seqs]
        return RequestOutput(group.request_id, group.prompt, list(group.prompt_token_ids), outputs,
                             finished, group.error, group.num_cached_tokens)

    # --- introspection -------------------------------------------------------------------------
    def _record_memory(self) -> None:
        """Peak KV pages held, and internal fragmentation: bytes of pages held by running
        sequences beyond the bytes their tokens fill."""
        in_use = self.manager.num_blocks_in_use
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, in_use)
        tokens = sum(self.manager.num_tokens(seq.seq_id) for seq in self.scheduler.running)
        if tokens:
            layout = self.manager.layout
            stored = tokens * layout.token_bytes
            self._fragmentation[0] += max(in_use * layout.block_bytes - stored, 0)
            self._fragmentation[1] += stored

    def stats(self) -> dict:
        wasted, stored = self._fragmentation
        block_bytes = self.manager.block_bytes
        return {**self.manager.snapshot_stats(), "preemptions": self.scheduler.num_preemptions,
                "num_steps": self.num_steps, "attention_seconds": self.attention_seconds,
                "attention_copy_seconds": self.attention_copy_seconds,
                "peak_kv_bytes": self.peak_blocks_in_use * block_bytes,
                "internal_fragmentation": wasted / stored if stored else 0.0,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "swapped": len(self.scheduler.swapped), "step_seconds": self.step_seconds,
                "map_background_seconds": self.map_background_seconds,
                "map_wait_seconds": self.map_wait_seconds,
                "map_hidden_seconds": max(self.map_background_seconds - self.map_wait_seconds, 0.0)}

    def close(self) -> None:
        self._mapper.shutdown(wait=True)
        self.manager.close()


def run_to_completion(engine: LLMEngine, requests: Seq[tuple[str, str | list[int], SamplingParams]],
                      progress=None) -> dict[str, RequestOutput]:
    """Add the requests, step until all finish, return each request's final output."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
                if progress is not None:
                    progress.update(1)
    return final
