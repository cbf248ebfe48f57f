"""Engine configuration: one dataclass, shared by the offline API, the CLI and the server.

The KV cache's knobs (``CACHE_FIELDS``) are ``vmemkv.CacheConfig`` fields under the same names and
with the same defaults (``swap_space_bytes`` aside: the engine reserves 1 GiB); they stay flat here
because a ``CacheConfig`` also needs the model's shapes, known only once it is loaded:
``EngineConfig.cache_config(model)`` derives it (``vmemkv.engine.models.hf_support.cache_config_for``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Literal

import torch

from vmemkv.cache.config import CacheConfig
from vmemkv.errors import ConfigError
from vmemkv.memory.quantized_rows import KV_CACHE_DTYPES
from vmemkv.engine.models.hf_support import cache_config_for, model_length_limit, uniform_chunk
from vmemkv.engine.models.dtype_choice import auto_dtype
from vmemkv.engine.core.policies import POLICIES, policy_names
from vmemkv.engine.core.threads import check_threads

logger = logging.getLogger(__name__)

# max_model_len when none is given: the model's own limit, but no more than this (slots reserve
# max_model_len tokens each, and the default pool holds every slot at full length).
DEFAULT_MAX_MODEL_LEN = 1024

# EngineConfig fields passed to CacheConfig as they are.
CACHE_FIELDS = ("max_num_seqs", "max_model_len", "num_blocks", "device", "tokens_per_page",
                "enable_prefix_caching", "swap_space_bytes", "host_cache_bytes", "layout",
                "kv_backend", "kv_pool", "kv_pool_bytes", "state_cache_interval", "kv_cache_dtype")
# EngineConfig fields passed to CacheConfig under its names.
RENAMED_CACHE_FIELDS = {"kv_cold_tier": "cold_tier", "kv_cold_cache_bytes": "cold_cache_bytes"}


@dataclass
class EngineConfig:
    model: str = "tiny-llama"  # a built-in random-weight model name or a local HF directory
    # "auto" (vLLM's default): the checkpoint's dtype where the device computes it natively, else
    # float32 (models/dtype_choice.py); "float32" gives Hugging Face's float32 tokens exactly,
    # which the tests compare token for token.
    dtype: str = "auto"
    device: str = CacheConfig.device
    max_num_seqs: int = 64  # slots: sequences running at once
    # longest prompt + output; None: the model's limit (for_model), at most DEFAULT_MAX_MODEL_LEN
    max_model_len: int | None = None
    # Accept a max_model_len past the model's limit (its config's max_position_embeddings or
    # the like, RoPE scaling included), as vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN: positions past it
    # may give wrong tokens.
    allow_long_max_model_len: bool = False
    num_blocks: int | None = None  # KV pool size in blocks; None: enough for every slot at full length
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    tokens_per_page: int = CacheConfig.tokens_per_page
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    # models with recurrent state layers: prompt positions between saved states (prefix hits)
    state_cache_interval: int | None = CacheConfig.state_cache_interval
    preemption_mode: Literal["auto", "swap", "recompute"] = "auto"
    swap_space_bytes: int = 1 << 30
    # host memory for the prefix cache's host tier (evicted cached pages wait there); 0: none
    host_cache_bytes: int = CacheConfig.host_cache_bytes
    # The prefix cache's lossy cold tier (vmemkv/cache/cold_tier.py): cached pages the pool lets
    # go are kept compressed, "int8" or "int4", in kv_cold_cache_bytes of host memory, and a hit
    # decompresses them; a request with SamplingParams(kv_exact=True) never reuses them. "off".
    kv_cold_tier: str = CacheConfig.cold_tier
    kv_cold_cache_bytes: int = CacheConfig.cold_cache_bytes
    # How K/V are stored (vLLM's --kv-cache-dtype): "auto" in the model's dtype; "int8" or "fp8"
    # (e4m3): one byte a value and a float32 scale per 32 values (memory/quantized_rows.py),
    # 0.56-0.58x of bfloat16's bytes at head_dim 64, lossy. Read by the native CPU decode routine and
    # the Triton decode kernel, and by SDPA over the step's rows dequantized; over slots (kv_backend
    # "vmem") or block tables ("paged"); no FlashAttention.
    kv_cache_dtype: str = CacheConfig.kv_cache_dtype
    seed: int = 0
    # The scheduling policy, a name in POLICIES (engine/core/policies.py): "fcfs", "priority" (the
    # only one under which a request may set its priority) or "lpm": longest cached prefix first
    # (engine/core/lpm.py); a request passed over in lpm_max_passed_over steps goes next; only the
    # first lpm_window waiting are ranked
    policy: str = "lpm"
    lpm_max_passed_over: int = 8
    lpm_window: int = 128
    watermark: float = 0.01  # fraction of blocks kept free at admission to avoid instant preemption
    layout: Literal["token_major", "per_layer"] = CacheConfig.layout
    # virtually contiguous slots, or block tables
    kv_backend: Literal["vmem", "paged"] = CacheConfig.kv_backend
    # "flash": one FlashAttention-2 varlen call per layer per step, prefill and decode together,
    # over the slots (or block tables of 256-token multiples) in place (CUDA, fp16/bf16);
    # "triton": decodes in one Triton launch that reads the cache in place, prefill by SDPA (CUDA);
    # "native": decodes in one call of the CPU routine that reads the cache in place, prompt
    # chunks in one call of its prefill twin (float32; else SDPA) (CPU, float32/bfloat16);
    # "sdpa": PyTorch SDPA per sequence (or per run of slots);
    # "auto": on CUDA flash if it runs here, else triton, else sdpa; on CPU native, else sdpa.
    attention: Literal["auto", "flash", "triton", "native", "sdpa"] = "auto"
    # With the native CPU routine: decoding requests whose KV starts with the same blocks (a
    # cached prompt prefix, parallel samples) read those blocks once per layer for all of them
    # (attention/shared_prefix.py); False: every request reads its own.
    shared_prefix_decode: bool = True
    # On CPU, a model the engine loads by name runs its linear layers on packed weights: the native
    # panel kernel in float32, else oneDNN (engine/models/packed_linear.py); a model object
    # passed in is never changed; False: F.linear. Not with tensor parallelism.
    packed_linears: bool = True
    # The kernel float32 weights are packed for: "auto" times the native panels and oneDNN on the
    # model's first layers at the start (engine/models/kernel_choice.py) and takes the faster, or
    # both ("split": panels for decode steps, oneDNN for prefill; twice the weights' memory);
    # "panels", "onednn" or "split" to fix it (other dtypes: oneDNN).
    linear_kernel: str = "auto"
    # With packed linears: q|k|v and gate|up as one GEMM each (packed_linear.py). Off by default:
    # faster alone at a few rows, but no faster end to end (a 32-sequence decode: 6 % slower, median)
    # (docs/engine.md#linear-layers-on-the-cpu).
    fused_projections: bool = False
    # A model whose code is Llama's, Qwen2/3's or Mistral's (its causal LM, model, layer, attention
    # and MLP forwards as transformers 5.17 / 5.25 write them) runs by direct calls of its modules, without
    # transformers' wrappers: the same logits, 2-3 ms less Python a decode step of SmolLM2-135M
    # (engine/models/direct_forward.py; off where a module has hooks). False: the model's forward.
    direct_forward: bool = True
    # Sliding windows: give back the blocks behind each layer's window while a request runs (one
    # window for every layer, or local and global layers in layer groups: cache_group.py); False
    # keeps every block (O(length) KV per request: the A/B's keep-everything baseline).
    release_behind_window: bool = True
    # Decoding requests get the block their next `lookahead_tokens` tokens need mapped on a
    # background thread while the current step computes (0: map only when needed, inline).
    lookahead_tokens: int = 1
    # Publish KV events (blocks stored in / removed from the prefix cache) over ZeroMQ at this
    # address, e.g. "tcp://*:5557" (engine/kv_event_publisher.py); None: no events.
    kv_events_endpoint: str | None = None
    # Ranks the model and its KV heads are split across (engine/distributed/): vmemkv spawns the
    # other ranks, or torchrun starts them; a collective that waits longer than the timeout stops
    # the engine; tensor_parallel_check compares every rank's page-mapping state every step.
    tensor_parallel_size: int = 1
    tensor_parallel_timeout: float = 60.0
    tensor_parallel_check: bool = False
    # torch's intra-op threads, set when the engine starts (engine/threads.py); None leaves them
    # as they are. vmemkv generate / serve and LLM default to the usable cores less one.
    threads: int | None = None
    # One KV memory budget shared with other engines on this machine (vmemkv/memory/budget.py):
    # its name, and its bytes for the engine that creates it (a later one gives the same or
    # None). The pool backs blocks with memory only within the engine's share of it.
    kv_pool: str | None = None
    kv_pool_bytes: int | None = None
    # Give free KV memory back (cached blocks too) once the engine has had no request for this
    # many seconds (engine/core/elastic.py); None: 1 s with a kv_pool, never without.
    kv_idle_release_s: float | None = None
    # Make the engine's processes non-dumpable (vmemkv/memory/protect.py), so that other processes
    # of the same user cannot read the KV cache through /proc/<pid>/fd/<memfd> or a debugger; also
    # no core dumps and no gdb / py-spy attach. vmemkv serve turns it on (--dumpable: off).
    protect_kv: bool = False

    def __post_init__(self) -> None:
        if (self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0
                or (self.max_model_len is not None and self.max_model_len <= 1)):
            raise ConfigError("max_num_seqs, max_num_batched_tokens must be positive and "
                              "max_model_len at least 2")
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ConfigError(f"preemption_mode must be auto, swap or recompute, got {self.preemption_mode!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be {policy_names()}, got {self.policy!r}")
        if (type(self.lpm_max_passed_over) is not int or self.lpm_max_passed_over < 0
                or type(self.lpm_window) is not int or self.lpm_window < 1):
            raise ConfigError(f"lpm_max_passed_over must be an int >= 0 and lpm_window an int >= 1; "
                              f"got {self.lpm_max_passed_over!r}, {self.lpm_window!r}")
        if self.attention not in ("auto", "flash", "triton", "native", "sdpa"):
            raise ConfigError(f"attention must be auto, flash, triton, native or sdpa, got {self.attention!r}")
        on_cuda = str(self.device).startswith("cuda")
        if self.attention in ("flash", "triton") and not on_cuda:
            raise ConfigError(f"attention={self.attention!r} needs a CUDA device; use attention='native', "
                              "'sdpa' (or 'auto') on CPU")
        if self.attention == "native" and on_cuda:
            raise ConfigError("attention='native' is the CPU decode routine; use 'auto', 'flash', 'triton' "
                              "or 'sdpa' on CUDA")
        if self.linear_kernel not in ("auto", "panels", "onednn", "split"):
            raise ConfigError(f"linear_kernel must be auto, panels, onednn or split, got {self.linear_kernel!r}")
        if self.kv_backend not in ("vmem", "paged"):
            raise ConfigError(f"kv_backend must be vmem or paged, got {self.kv_backend!r}")
        if self.tensor_parallel_size < 1 or self.tensor_parallel_timeout <= 0:
            raise ConfigError(f"tensor_parallel_size must be at least 1 and tensor_parallel_timeout "
                              f"positive; got {self.tensor_parallel_size}, {self.tensor_parallel_timeout}")
        check_threads(self.threads)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.attention == "flash":
            raise ConfigError(f"kv_cache_dtype {self.kv_cache_dtype!r} with attention=flash: quantized rows are "
                              "read by the native CPU routine, the Triton kernel or SDPA (FlashAttention-2 "
                              "reads no bytes); use attention 'auto'")
        if self.kv_cold_tier != "off" and self.tensor_parallel_size > 1:
            raise ConfigError(f"kv_cold_tier {self.kv_cold_tier!r} with tensor_parallel_size "
                              f"{self.tensor_parallel_size}: the cold tier runs on one rank only so far; "
                              "set kv_cold_tier='off' or tensor_parallel_size=1")
        if type(self.release_behind_window) is not bool:
            raise ConfigError(f"release_behind_window must be True or False, got "
                              f"{self.release_behind_window!r}")
        if type(self.protect_kv) is not bool:
            raise ConfigError(f"protect_kv must be True or False, got {self.protect_kv!r}")
        if self.kv_idle_release_s is not None and not (
                isinstance(self.kv_idle_release_s, (int, float)) and self.kv_idle_release_s >= 0):
            raise ConfigError(f"kv_idle_release_s must be a number >= 0 or None, got "
                              f"{self.kv_idle_release_s!r}")
        if self.dtype != "auto":
            self._named_dtype()  # validates the name

    def for_model(self, model_config) -> "EngineConfig":
        """This configuration with ``max_model_len`` checked against the model's limit (vLLM's
        rule): unset, the limit but at most ``DEFAULT_MAX_MODEL_LEN``; past it, refused unless
        ``allow_long_max_model_len``."""
        found = model_length_limit(model_config)
        if self.max_model_len is None:
            length = DEFAULT_MAX_MODEL_LEN if found is None else min(found[0], DEFAULT_MAX_MODEL_LEN)
            return dataclasses.replace(self, max_model_len=length)
        if found is not None and self.max_model_len > found[0]:
            limit, reason = found
            past = (f"max_model_len={self.max_model_len} is longer than {self.model}'s limit of "
                    f"{limit} tokens ({reason} in its config)")
            if not self.allow_long_max_model_len:
                raise ConfigError(
                    f"{past}: positions past it may give wrong tokens. Lower max_model_len "
                    f"(--max-model-len) to at most {limit}, or accept the risk with "
                    "allow_long_max_model_len=True (--allow-long-max-model-len)")
            logger.warning("vmemkv: %s; running past it as allow_long_max_model_len asks "
                           "(positions past it may give wrong tokens)", past)
        return self

    @property
    def idle_release_seconds(self) -> float | None:
        """``kv_idle_release_s``, or its default: 1 s with a shared ``kv_pool``, else never."""
        if self.kv_idle_release_s is not None:
            return float(self.kv_idle_release_s)
        return 1.0 if self.kv_pool is not None else None

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype the model runs in (``auto`` resolved first: ``with_dtype_for``)."""
        if self.dtype == "auto":
            raise ConfigError("dtype='auto' is resolved when the model is known "
                              "(EngineConfig.with_dtype_for)")
        return self._named_dtype()

    def _named_dtype(self) -> torch.dtype:
        dtype = getattr(torch, str(self.dtype).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"unknown dtype {self.dtype!r}; use auto, float32, float16 or bfloat16")
        return dtype

    def with_dtype_for(self, recorded: torch.dtype | None) -> tuple["EngineConfig", str]:
        """This configuration with ``auto`` resolved for a checkpoint recorded in ``recorded``
        (None: not recorded), and a line saying what runs and why."""
        if self.dtype != "auto":
            return self, f"{self.dtype} (as asked)"
        dtype, why = auto_dtype(recorded, self.device)
        return dataclasses.replace(self, dtype=str(dtype).removeprefix("torch.")), f"auto: {why}"

    def cache_config(self, model) -> CacheConfig:
        """The KV cache for ``model`` (a Hugging Face causal LM) under this configuration; without
        ``num_blocks``, enough blocks for every slot at full length."""
        config = self if self.max_model_len is not None else self.for_model(model.config)
        options = {name: getattr(config, name) for name in CACHE_FIELDS}
        options.update({cache_name: getattr(config, name) for name, cache_name in RENAMED_CACHE_FIELDS.items()})
        chunk = uniform_chunk(model.config)  # the engine's attention reads from chunk starts
        if self.release_behind_window and chunk is not None and chunk < config.max_model_len:
            options["attention_chunk_size"] = chunk
        return cache_config_for(model, check_token_ids=True,
                                release_behind_window=self.release_behind_window,
                                dtype=next(model.parameters()).dtype, **options)
