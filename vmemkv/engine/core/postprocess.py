"""After the forward: commit what it wrote, carry out the planned forks, sample, append, finish,
and build the outputs.

``Postprocessor.process`` takes the scheduler's plan and the runner's logits and, in this order
(each step needs the one before): marks the scheduled positions computed and commits them to the
KV cache (through the plan's ``KVStep``: the postprocessor holds no manager); samples one token
per sampling sequence in one sampler call (a request's forks planned this step included, from
their parent's row, so the global RNG draws once for every unseeded row; the next ``schedule``
forks them, once the prompt is committed); appends the tokens and checks the stop conditions,
finishing sequences. It returns what happened (``StepProgress``: the ``StepResult`` the
scheduler's ``update`` takes, and the requests that progressed); it never touches the scheduler's
queues. ``outputs`` then turns those requests into ``RequestOutput``s and retires finished ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vmemkv.engine.core.config import EngineConfig
from vmemkv.engine.core.metrics import EngineMetrics
from vmemkv.engine.core.outputs import CompletionOutput, RequestOutput
from vmemkv.engine.core.runner import ForwardOutput
from vmemkv.engine.core.sampler import Sampler
from vmemkv.engine.core.scheduler import SchedulerOutput, StepResult
from vmemkv.engine.core.sequence import Sequence, SequenceStatus


@dataclass
class StepProgress:
    result: StepResult  # for the scheduler's update
    touched: dict[str, Sequence] = field(default_factory=dict)  # requests progressed (or failed), by id
    ended: set[str] = field(default_factory=set)  # requests a sequence of which finished or failed


class Postprocessor:
    def __init__(self, config: EngineConfig, metrics: EngineMetrics, requests: dict[str, Sequence],
                 eos_token_ids: set[int], stream: bool):
        self.config = config
        self.metrics = metrics
        self.requests = requests  # the engine's unfinished requests (first sequences), by id
        self.eos_token_ids = eos_token_ids
        self.stream = stream
        self.sampler = Sampler()

    def process(self, plan: SchedulerOutput, forward: ForwardOutput | None) -> StepProgress:
        """Apply one step's results; returns what happened."""
        progress = StepProgress(StepResult())
        for seq, reason in plan.failed:  # already out of the queues
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "error"
            seq.request.error = reason
            progress.touched[seq.request_id] = seq.request
            progress.ended.add(seq.request_id)
        if plan.scheduled:
            progress.result.refused_lookahead = forward.refused_lookahead
            plan.kv.commit(plan.scheduled)
            members = {fork.parent: fork.children for fork in plan.forks}
            generated: dict[str, int] = {}  # tokens per request this step, for the metrics
            for seq, token, logprobs in self._sample(forward, members):
                self._append_token(seq, token, logprobs, progress)
                request_id = seq.request_id
                generated[request_id] = generated.get(request_id, 0) + 1
                progress.touched[request_id] = seq.request
            self.metrics.on_step_tokens(generated, time.monotonic())
        self._finish_failed_requests(progress)
        return progress

    def _sample(self, forward: ForwardOutput,
                members: dict[Sequence, list[Sequence]]) -> list[tuple[Sequence, int, dict | None]]:
        samplers, logits = forward.samplers, forward.logits
        if not samplers:
            return []
        seqs = samplers
        if any(members.values()):  # children sample from their parent's row
            seqs, logit_rows = [], []
            for row, seq in enumerate(samplers):
                for member in [seq, *members.get(seq, ())]:
                    seqs.append(member)
                    logit_rows.append(row)
            logits = logits[logit_rows]
        tokens, logprobs = self.sampler.sample(
            logits, [s.params for s in seqs], [s.generator for s in seqs])
        return list(zip(seqs, tokens.tolist(), logprobs))

    def _append_token(self, seq: Sequence, token: int, logprobs: dict | None,
                      progress: StepProgress) -> None:
        """Add a sampled token and check the stop conditions (``process`` counts it in the
        metrics, once per request per step)."""
        params = seq.params
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
        elif (len(token_ids) - seq.num_prompt_tokens >= params.max_tokens  # output tokens
              or len(token_ids) >= self.config.max_model_len):
            reason = "length"
        if reason is not None:
            if stop_reason is None or isinstance(stop_reason, int):
                seq.detokenizer.flush()
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            self._finish(seq, progress)
            progress.ended.add(seq.request_id)

    @staticmethod
    def _finish(seq: Sequence, progress: StepProgress) -> None:
        """``seq`` is done; the scheduler's update takes it out of the queues and frees its KV."""
        seq.status = SequenceStatus.FINISHED
        progress.result.finished.append(seq)

    def _finish_failed_requests(self, progress: StepProgress) -> None:
        """The other sequences of a request that failed this step end with it."""
        for first in progress.touched.values():
            if first.error is not None:  # set this step: earlier failures are retired
                for seq in first.sequences:
                    if not seq.is_finished:
                        seq.finish_reason = "error"
                        self._finish(seq, progress)

    # --- outputs -----------------------------------------------------------------------------------
    def outputs(self, progress: StepProgress) -> list[RequestOutput]:
        """What ``step()`` returns: every touched request when streaming, else the finished ones
        (only a request a sequence of which ended this step can have finished)."""
        ended = progress.ended
        return [self._output(first) for first in progress.touched.values()
                if self.stream or (first.request_id in ended and first.request_finished)]

    def _output(self, first: Sequence) -> RequestOutput:
        finished = first.request_finished
        if finished:
            self.requests.pop(first.request_id, None)
            reason = "error" if first.error else first.finish_reason
            self.metrics.on_request_finished(first.request_id, reason, time.monotonic())
        outputs = [CompletionOutput(
            index=seq.index, text=seq.detokenizer.output_text(seq.is_finished),
            token_ids=list(seq.output_token_ids), finish_reason=seq.finish_reason,
            logprobs=list(seq.logprobs) if first.params.logprobs is not None else None,
            stop_reason=seq.stop_reason) for seq in first.sequences]
        return RequestOutput(first.request_id, first.prompt, first.prompt_token_ids, outputs,
                             finished, first.error, first.num_cached_tokens)
