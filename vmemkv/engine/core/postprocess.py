"""After the forward: commit what it wrote, fork, sample, append, finish, and build the outputs.

``Postprocessor.process`` takes the scheduler's plan and the runner's logits and, in this order
(each step needs the one before): marks the scheduled positions computed and commits them to the
KV cache manager; at a group's first sample, forks its other ``n - 1`` sequences (a fork shares
the parent's *committed* blocks and copies its partial last block, so it follows the commit); samples
one token per sampling sequence in one sampler call (children included, so the global RNG draws
once for every unseeded row); appends the tokens and checks the stop conditions, finishing
sequences. ``outputs`` then turns the groups that progressed into ``RequestOutput``s and retires
finished requests.
"""

from __future__ import annotations

import time
from typing import Callable

from vmemkv.cache.manager import KVCacheManager
from vmemkv.engine.core.config import EngineConfig
from vmemkv.engine.core.metrics import EngineMetrics
from vmemkv.engine.core.outputs import CompletionOutput, RequestOutput
from vmemkv.engine.core.runner import ForwardOutput
from vmemkv.engine.core.sampler import Sampler
from vmemkv.engine.core.scheduler import Scheduler, SchedulerOutput
from vmemkv.engine.core.sequence import Sequence, SequenceGroup, SequenceStatus


class Postprocessor:
    def __init__(self, config: EngineConfig, manager: KVCacheManager, scheduler: Scheduler,
                 metrics: EngineMetrics, groups: dict[str, SequenceGroup], eos_token_ids: set[int],
                 new_sequence: Callable[[SequenceGroup, int], Sequence], stream: bool):
        self.config = config
        self.manager = manager
        self.scheduler = scheduler
        self.metrics = metrics
        self.groups = groups  # the engine's unfinished requests, by id
        self.eos_token_ids = eos_token_ids
        self.new_sequence = new_sequence
        self.stream = stream
        self.sampler = Sampler()
        self._ended: set[str] = set()

    def process(self, plan: SchedulerOutput, forward: ForwardOutput | None) -> list[SequenceGroup]:
        """Apply one step's results; returns the groups that progressed (or failed)."""
        touched: dict[str, SequenceGroup] = {}
        self._ended: set[str] = set()  # groups a sequence of which finished or failed this step
        for seq, reason in plan.failed:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "error"
            seq.group.error = reason
            touched[seq.group.request_id] = seq.group
            self._ended.add(seq.group.request_id)
        if not plan.scheduled:
            return list(touched.values())
        # every reserved position: exactly the scheduled ones; in one call where the manager has
        # it (one call per sequence costs more through the timing wrapper), else one by one
        commit_all = getattr(self.manager, "commit_all", None)
        if commit_all is not None:
            commit_all([item.seq.kv for item in plan.scheduled])
        else:
            for item in plan.scheduled:
                self.manager.commit(item.seq.kv)
        generated: dict[str, int] = {}  # tokens per request this step, for the metrics
        for seq, token, logprobs in self._sample(forward):
            self._append_token(seq, token, logprobs)
            request_id = seq.group.request_id
            generated[request_id] = generated.get(request_id, 0) + 1
            touched[request_id] = seq.group
        self.metrics.on_step_tokens(generated, time.monotonic())
        return list(touched.values())

    def _sample(self, forward: ForwardOutput) -> list[tuple[Sequence, int, dict | None]]:
        samplers, logits = forward.samplers, forward.logits
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

    def _fork_group(self, seq: Sequence) -> list[Sequence]:
        """At a group's first sample, create its other n-1 sequences as copy-on-write forks
        sharing the prompt's blocks. A fork that finds no slot or block waits as a new request
        instead (its prompt will then hit the prefix cache). Returns who samples from this row."""
        group = seq.group
        if group.forked:
            return [seq]
        group.forked = True
        members = [seq]
        for index in range(1, group.params.n):
            child = self.new_sequence(group, index)
            group.seqs.append(child)
            if self.manager.fork(seq.kv, child.kv):  # the child's list becomes a copy of seq's
                self.scheduler.add_running(child)
                members.append(child)
            else:
                self.scheduler.add(child)
        return members

    def _append_token(self, seq: Sequence, token: int, logprobs: dict | None) -> None:
        """Add a sampled token and check the stop conditions (``process`` counts it in the
        metrics, once per request per step)."""
        group = seq.group
        params = group.params
        token_ids = seq.kv.token_ids  # the one list (seq.token_ids), looked up once per token
        token_ids.append(token)
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
        elif (len(token_ids) - len(group.prompt_token_ids) >= params.max_tokens  # output tokens
              or len(token_ids) >= self.config.max_model_len):
            reason = "length"
        if reason is not None:
            if stop_reason is None or isinstance(stop_reason, int):
                seq.detokenizer.flush()
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            self.scheduler.remove(seq)
            self._ended.add(group.request_id)

    # --- outputs -----------------------------------------------------------------------------------
    def outputs(self, touched: list[SequenceGroup]) -> list[RequestOutput]:
        """What ``step()`` returns: every touched group when streaming, else the finished ones
        (only a group a sequence of which ended this step can have finished)."""
        ended = self._ended
        return [self._output(group) for group in touched
                if self.stream or (group.request_id in ended
                                   and (group.error is not None or group.is_finished))]

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
