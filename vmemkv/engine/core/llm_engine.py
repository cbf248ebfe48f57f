"""The engine: requests in, one step at a time, outputs out.

A step is four one-way calls: the scheduler plans who runs with how many tokens and every KV
change of the step (admission, growth, swap, preemption, the forks of ``n > 1``, lookahead blocks:
``scheduler.py``); the runner carries out the forward, one ragged batch over the KV cache
addressed the way chosen once at construction, mapping the lookahead blocks the plan names
(``runner.py``, ``addressing.py``); the postprocessor commits, samples (the planned children of
``n > 1`` from their parent's row), appends and finishes, and says what happened
(``postprocess.py``); the scheduler's ``update`` takes that, the one place its queues change
after the plan, and the next plan starts by forking those children. The scheduler is the one part
holding the KV cache manager: the runner and the postprocessor change the cache only through
what the plan names (``SchedulerOutput.kv``), the addressing reads a read-only view of it, and
this engine asks the scheduler for the cache's limits and stats. This module holds the requests,
the construction of those parts, and the engine's stats.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence as Seq

from vmemkv import validation as check
from vmemkv.errors import ConfigError, RequestStateError, RequestTooLongError
from vmemkv.cache.hashing import CacheKeys
from vmemkv.engine.models.hf_support import check_attention_supported, text_config
from vmemkv.cache.events import KVEventBuffer
from vmemkv.cache.metrics import KVMetricsCollector
from vmemkv.cache.request import KVRequest
from vmemkv.engine.core.addressing import choose_addressing
from vmemkv.engine.core.chat import end_of_turn_token_ids
from vmemkv.engine.core.config import EngineConfig
from vmemkv.engine.core.detokenizer import IncrementalDetokenizer
from vmemkv.engine.core.elastic import ElasticMemory, check_sleep_level
from vmemkv.engine.core.host_malloc import keep_freed_memory
from vmemkv.engine.core.kv_manager import KVManager, make_kv_manager
from vmemkv.engine.distributed import TensorParallelLeader
from vmemkv.engine.core.threads import apply_threads
from vmemkv.engine.serving.kv_event_publisher import KVEventPublisher
from vmemkv.engine.core.metrics import EngineMetrics
from vmemkv.engine.core.model_runner import ModelRunner
from vmemkv.engine.models.kernel_choice import choose_kernel, label
from vmemkv.engine.models.latent_attention import route_latent_attention
from vmemkv.engine.models.state_mixers import route_state_mixers
from vmemkv.engine.models.native_norm import swap_rms_norms
from vmemkv.engine.models.native_rotary import swap_rotaries
from vmemkv.engine.models.packed_linear import pack_linears, why_not_packed
from vmemkv.engine.models.panel_linear import prefetch_hint
from vmemkv.engine.models.zoo import load_model, recorded_dtype
from vmemkv.engine.core.outputs import RequestOutput
from vmemkv.engine.core.postprocess import Postprocessor
from vmemkv.memory.protect import protect_kv_memory
from vmemkv.engine.core.runner import LookaheadMapper, StepRunner
from vmemkv.engine.core.sampler import make_generator
from vmemkv.engine.core.sampling_params import SamplingParams, check_context_length
from vmemkv.engine.core.scheduler import Scheduler
from vmemkv.engine.core.sequence import Sequence


class LLMEngine:
    """``stream``: ``step()`` returns every request that progressed, with its text so far; when
    False (offline use) it returns finished requests only, and text is decoded once at the end
    for requests without stop strings."""

    def _pack_linears(self, model, loaded_by_name: bool) -> str:
        """Linear layers on packed weights (CPU, a model this engine loaded); returns what
        was done, for stats: "packed N for <kernel> (why that kernel)", or why not."""
        if not self.config.packed_linears:
            return "off"
        if not loaded_by_name or self.config.tensor_parallel_size > 1:
            return "off: " + ("a model object passed in is left as it is" if not loaded_by_name
                              else "tensor parallelism shards the model's own linear layers")
        requested = self.config.linear_kernel
        if reason := why_not_packed(model, None if requested == "auto" else requested):
            return f"off: {reason}"
        self.linear_kernel, hint, why = choose_kernel(model, requested)
        if hint:
            prefetch_hint(hint)
        fused = self.config.fused_projections
        packed = pack_linears(model, fuse=fused, kernel=self.linear_kernel)
        return f"packed {packed} for {label(self.linear_kernel, hint)} ({why})" + (
            " (q|k|v and gate|up fused)" if fused else "")

    def _reload_model(self):
        """The model loaded again by name and built as this engine's was (for a level-2 wake)."""
        config = self.config
        model = load_model(config.model, config.torch_dtype, config.device, config.seed)[0]
        route_latent_attention(model)  # as __init__: MLA's kv_b_proj stays unpacked
        route_state_mixers(model)
        if self.packed_linears.startswith("packed"):
            pack_linears(model, fuse=self.config.fused_projections, kernel=self.linear_kernel)
            swap_rms_norms(model)
            swap_rotaries(model)
        return model

    def __init__(self, config: EngineConfig, model=None, tokenizer=None, stream: bool = True):
        self.stream = stream
        apply_threads(config.threads)  # before the model loads (and its first ops pick threads)
        if config.protect_kv:  # before any KV memory exists
            protect_kv_memory()
        if str(config.device).startswith("cpu"):  # activations reuse freed heap, not fresh pages (host_malloc.py)
            keep_freed_memory()
        loaded_by_name = model is None
        if model is None:
            config, self.dtype_choice = config.with_dtype_for(recorded_dtype(config.model))
            model, tokenizer = load_model(config.model, config.torch_dtype, config.device, config.seed)
        elif config.tensor_parallel_size > 1:
            raise ConfigError("tensor_parallel_size > 1 loads the model on every rank by name: pass "
                              "model=<name or directory>, not a model object")
        else:  # a model object runs in its own dtype
            dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
            self.dtype_choice = f"{dtype} (the given model's)"
            config = dataclasses.replace(config, dtype=dtype)
        # max_model_len within the model's positions (or its default from them), before any use
        config = self.config = config.for_model(model.config)
        self.model_name = config.model
        self.tokenizer = tokenizer
        # MLA models attend from their latent rows; routed before packing, which frees the
        # kv_b_proj weight the absorbed form reads
        route_latent_attention(model)
        route_state_mixers(model)  # recurrent mixers run per sequence over their slot's state
        self.packed_linears = self._pack_linears(model, loaded_by_name)
        # where the linears are packed (a model this engine loaded, on the CPU), so are the norms
        # and the rotary embedding
        packed = self.packed_linears.startswith("packed")
        self.native_norms = swap_rms_norms(model) if packed else 0
        self.native_rotaries = swap_rotaries(model) if packed else 0
        # Before any KV memory is taken: refuse attention the engine would silently get wrong.
        check_attention_supported(model.config, config.max_model_len, replaces_attention=True,
                                  who="the vmemkv engine", max_packed_tokens=config.max_num_batched_tokens)
        # Tensor parallelism: other ranks started, this model sharded (engine/distributed/).
        tp = self.tensor_parallel = (TensorParallelLeader.start(config, model)
                                     if config.tensor_parallel_size > 1 else None)
        # The manager and its backend time their operations and mapping here (stats(), /metrics).
        self.kv_metrics = KVMetricsCollector()
        # KV events: the manager's pool fills the buffer, each step publishes it as one batch.
        self.kv_events = KVEventBuffer() if config.kv_events_endpoint else None
        # Local and global layers (Gemma-2/3, GPT-OSS, Llama-4): one layer group per kind, so the
        # local layers' blocks behind the window go back to their pool (slots or block tables).
        # Under tensor parallelism every rank builds the same groups (distributed/step.py).
        # The scheduler, built below, holds it; the engine keeps no reference of its own.
        manager: KVManager
        if tp is not None:
            manager = tp.shard_manager(model, self.kv_metrics, events=self.kv_events)
        else:
            manager = make_kv_manager(config.cache_config(model), model.config,
                                      max_model_len=config.max_model_len,
                                      chunk_tokens=config.max_num_batched_tokens,
                                      release_behind_window=config.release_behind_window,
                                      metrics=self.kv_metrics, events=self.kv_events)
        self.vocab_size = manager.config.vocab_size  # prompts are checked against it
        self.kv_event_publisher = (KVEventPublisher(config.kv_events_endpoint)
                                   if config.kv_events_endpoint else None)
        model_runner = ModelRunner(model, config.direct_forward) if tp is None else tp.model_runner(model)
        self.direct_forward = model_runner.direct_forward  # "on: ..." or "off: why"
        # The KV addressing (slots or block tables) and its attention, chosen once.
        self.addressing = choose_addressing(config, manager.views(), model_runner.device,
                                            text_config(model.config).num_attention_heads)
        self.attention_choice = self.addressing.choice
        self.attention_kernel = self.attention_choice.label  # what runs: flash-bundled, triton, native, sdpa
        self.decode_kernel = self.attention_choice.decode_kernel
        # Overlapped mapping (slots only): the scheduler gives decoding sequences their next block,
        # the runner maps it during the forward.
        lookahead_tokens = config.lookahead_tokens if self.addressing.uses_lookahead else 0
        self.scheduler = Scheduler(config, manager, self._new_fork, lookahead_tokens)
        self.runner = StepRunner(model_runner, self.addressing,
                                 LookaheadMapper() if lookahead_tokens > 0 else None)
        self.metrics = EngineMetrics(
            kv_metrics=self.kv_metrics, cache_stats=self.scheduler.cache_stats,
            memory_stats=self.scheduler.kv_stats,
            kv_bytes_per_token_per_layer=self.addressing.views.layout.kv_bytes_per_token_per_layer)
        self.requests: dict[str, Sequence] = {}  # unfinished, by id: each one's first sequence
        eos = text_config(model.config).eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        # HF generate stops at the generation config's eos too, and a chat model at its
        # template's end-of-turn token (which need not be the config's eos).
        generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos_token_ids |= set(generation_eos if isinstance(generation_eos, list)
                                  else [generation_eos] if generation_eos is not None else [])
        self.eos_token_ids |= set(end_of_turn_token_ids(tokenizer))
        self.postprocessor = Postprocessor(config, self.metrics, self.requests, self.eos_token_ids, stream)
        # Idle give-back and sleep/wake (elastic.py); level-2 sleep reloads the weights by name.
        reload = self._reload_model if loaded_by_name and tp is None else None
        self.elastic = ElasticMemory(self.scheduler, model, config.idle_release_seconds, reload)
        self.step_seconds = 0.0
        self.num_steps = 0
        self.tokens_computed = 0  # positions the forward passes computed: prompts (less prefix hits), recomputes, decodes
        self.peak_blocks_in_use = 0
        self.peak_kv_bytes = 0  # both layout groups' bytes where there are two
        self._fragmentation = [0, 0]  # sums over steps: bytes held past the tokens stored, bytes stored

    # The runner's counters, under the names stats() reports.
    attention_seconds = property(lambda self: self.runner.attention_seconds)
    attention_copy_seconds = property(lambda self: self.runner.attention_copy_seconds)  # block tables
    map_background_seconds = property(lambda self: self.runner.map_background_seconds)  # on the worker
    map_wait_seconds = property(lambda self: self.runner.map_wait_seconds)  # the step still waited

    @property
    def manager(self) -> KVManager:
        """The KV cache manager, for inspection (tests, benchmarks): the scheduler holds it, and
        the engine itself reaches it only through the scheduler's methods."""
        return self.scheduler.manager

    # --- requests ----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, keys: CacheKeys | None = None) -> None:
        params = params or SamplingParams()
        self.check_priority(request_id, priority)
        self.elastic.check_awake()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self._token_ids(prompt)
        self._validate_prompt(request_id, token_ids)
        seq = Sequence(KVRequest(request_id, token_ids, keys or CacheKeys(), exact=params.kv_exact),
                       request_id, text, params,
                       len(token_ids), priority=priority)
        self._set_up(seq)
        self.requests[request_id] = seq
        self.elastic.busy()
        self.scheduler.add(seq)
        self.metrics.on_request_added(request_id, len(token_ids), time.monotonic())

    def check_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Raise what ``add_request`` would, and ``RequestTooLongError`` if the prompt and all of
        ``max_tokens`` do not fit in ``max_model_len`` (vLLM's server rule; ``add_request`` itself
        lets such a request run and stops it at ``max_model_len``, as vLLM's engine); changes
        nothing. ``LLM.generate`` and ``vmemkv generate`` check every request before adding one."""
        token_ids = self._token_ids(prompt)
        self._validate_prompt(request_id, token_ids)
        try:
            check_context_length(len(token_ids), params.max_tokens, self.config.max_model_len)
        except RequestTooLongError as exc:
            raise RequestTooLongError(f"request {request_id!r}: {exc}") from None

    def _token_ids(self, prompt: str | list[int]) -> list[int]:
        return list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)

    def check_priority(self, request_id: str, priority: int) -> None:
        """Refuse a priority the scheduling policy would ignore (``policies.py``)."""
        self.scheduler.policy.check_priority(request_id, priority)

    def _validate_prompt(self, request_id: str, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        check.token_ids(token_ids, f"request {request_id!r}'s prompt", self.vocab_size)
        limit = self.config.max_model_len
        if len(token_ids) >= limit:
            raise RequestTooLongError(
                f"request {request_id!r} has {len(token_ids)} prompt tokens; max_model_len is {limit} "
                "and at least one token must be generated: shorten the prompt or raise max_model_len")
        # the prompt and one new token (with a sliding window: the window and one prefill chunk)
        problem = self.scheduler.why_never_fits(len(token_ids) + 1)
        if problem is not None:
            raise RequestTooLongError(f"request {request_id!r}: {problem}")

    def _new_fork(self, first: Sequence, index: int) -> Sequence:
        """The request ``first``'s sequence ``index`` (of its n), with the prompt alone."""
        kv = KVRequest(f"{first.request_id}#{index}", first.prompt_token_ids, first.kv.keys, first.kv.exact)
        fork = Sequence(kv, first.request_id, first.prompt, first.params, first.num_prompt_tokens, index,
                        parent=first, priority=first.priority, arrival_time=first.arrival_time)
        self._set_up(fork)
        return fork

    def _set_up(self, seq: Sequence) -> None:
        """Its sampling generator (seeded per completion) and detokenizer."""
        params = seq.params
        seed = None if params.seed is None else params.seed + seq.index
        seq.generator = make_generator(seed, self.runner.device)
        seq.detokenizer = IncrementalDetokenizer.from_params(self.tokenizer, seq.prompt_token_ids, params,
                                                             final_only=not self.stream)

    def abort_request(self, request_id: str) -> None:
        first = self.requests.pop(request_id, None)
        if first is None:
            return
        for seq in first.sequences:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                seq.finish_reason = "abort"
        self.metrics.on_request_finished(request_id, "abort", time.monotonic())
        if not self.requests:
            self.elastic.idle()
        self._update_gauges()  # its blocks are free now; no step may come to say so

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan, run the forward, postprocess, update the queues: one way, each part once."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        forward = self.runner.run(plan) if plan.scheduled else None
        progress = self.postprocessor.process(plan, forward)
        self.scheduler.update(progress.result)
        self.step_seconds += time.perf_counter() - start
        self.num_steps += 1
        self.tokens_computed += sum(item.num_new_tokens for item in plan.scheduled)
        self._record_memory()
        self._update_gauges()
        if self.kv_event_publisher is not None and (batch := self.kv_events.drain()):
            self.kv_event_publisher.publish(batch)
        outputs = self.postprocessor.outputs(progress)  # finished requests leave self.requests
        if not self.requests:
            self.elastic.idle()
        return outputs

    def _update_gauges(self) -> None:
        """Set the metrics' gauges to the scheduler and cache state now: after every step, and
        after an abort, which changes both between steps (the server steps only while requests
        are unfinished, so aborting the last one would leave the gauges stale)."""
        self.metrics.on_step(len(self.scheduler.running), len(self.scheduler.waiting),
                             len(self.scheduler.swapped), self.scheduler.kv_usage(),
                             self.scheduler.num_preemptions)

    # --- elastic memory (elastic.py) -----------------------------------------------------------
    def on_idle(self) -> int:
        """For a loop with nothing to step: once the engine has been idle for
        ``kv_idle_release_s``, give its free KV memory back (once per idle spell). Returns the
        bytes given back; ``seconds_to_idle_release()`` says when to call again."""
        given = self.elastic.on_idle()
        if given:
            if self.tensor_parallel is not None:  # the other ranks give theirs back now too
                self.tensor_parallel.send_log()
            self._update_gauges()
        return given

    def seconds_to_idle_release(self) -> float | None:
        """Seconds until ``on_idle`` has memory to give back (0: now), or None: nothing to come."""
        return self.elastic.seconds_to_release()

    def sleep(self, level: int = 1) -> int:
        """Give back every KV page (the prefix cache too); level 1 also moves the weights to host
        memory on CUDA, level 2 discards them (``wake_up`` loads them again). Refused while
        requests are unfinished. Returns the KV bytes given back."""
        check_sleep_level(level)
        if self.requests:
            raise RequestStateError(f"cannot sleep with {len(self.requests)} unfinished request(s); "
                                    "finish or abort them first")
        if self.tensor_parallel is not None:
            raise ConfigError("sleep is not supported with tensor parallelism yet (the weights of "
                              "every rank would have to move); kv_pool and the idle give-back are")
        given = self.elastic.sleep(level)
        self._update_gauges()
        return given

    def wake_up(self) -> None:
        """Undo ``sleep``: the weights come back; KV pages are taken again as requests need them."""
        self.elastic.wake_up()

    @property
    def sleep_level(self) -> int:
        """0 awake, else the level of ``sleep``."""
        return self.elastic.sleep_level

    # --- introspection -------------------------------------------------------------------------
    def _record_memory(self) -> None:
        """Peak KV blocks and bytes held, and internal fragmentation: bytes of the blocks in use
        beyond the bytes the running sequences' tokens fill (``Scheduler.kv_fragmentation``: an
        estimate), summed over steps."""
        blocks, kv_bytes = self.scheduler.kv_in_use()
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, blocks)
        self.peak_kv_bytes = max(self.peak_kv_bytes, kv_bytes)
        if not self.scheduler.running:
            return
        wasted, stored = self.scheduler.kv_fragmentation()
        self._fragmentation[0] += wasted
        self._fragmentation[1] += stored

    def stats(self) -> dict:
        wasted, stored = self._fragmentation
        # manager_seconds, inline/background_map_seconds (and calls), manager_operations
        timing = self.kv_metrics.snapshot()
        timing["manager_operations"] = timing.pop("operations")
        return {**self.scheduler.kv_stats(), **timing, "preemptions": self.scheduler.num_preemptions,
                # what one token holds per layer: K and V, or an MLA model's latent row (scales included)
                "kv_bytes_per_token_per_layer": self.addressing.views.layout.kv_bytes_per_token_per_layer,
                "kv_cache_dtype": self.config.kv_cache_dtype,
                "num_steps": self.num_steps, "tokens_computed": self.tokens_computed,
                "attention_seconds": self.attention_seconds,
                "attention_copy_seconds": self.attention_copy_seconds,
                "peak_kv_bytes": self.peak_kv_bytes,
                "internal_fragmentation": wasted / stored if stored else 0.0,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "swapped": len(self.scheduler.swapped), "step_seconds": self.step_seconds,
                "map_background_seconds": self.map_background_seconds,
                "map_wait_seconds": self.map_wait_seconds,
                "map_hidden_seconds": max(self.map_background_seconds - self.map_wait_seconds, 0.0),
                "idle_releases": self.elastic.idle_releases,
                "idle_released_bytes": self.elastic.idle_released_bytes,
                "sleep_level": self.elastic.sleep_level}

    def close(self) -> None:
        self.runner.close()
        self.scheduler.close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()


def run_to_completion(engine: LLMEngine, requests: Seq[tuple[str, str | list[int], SamplingParams]],
                      progress=None, priorities: Seq[int] | None = None) -> dict[str, RequestOutput]:
    """Add the requests (with ``priorities``, one per request, if given), step until all finish,
    return each request's final output."""
    for index, (request_id, prompt, params) in enumerate(requests):
        engine.add_request(request_id, prompt, params, priorities[index] if priorities else 0)
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
                if progress is not None:
                    progress.update(1)
    return final
