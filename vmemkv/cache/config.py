"""What a KV cache manager is configured with and what it reports: ``CacheConfig`` (shapes, pool
and slot sizes, page sizing, prefix caching, swap), ``CacheStats`` (counters since creation) and
``PreemptionEstimate`` (what swapping or recomputing a request would cost)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from vmemkv.errors import ConfigError
from vmemkv.memory.layout import KVLayout, LayoutKind, choose_page, unpadded_row_bytes
from vmemkv.memory.quantized_rows import storage_dtype
from vmemkv.memory.vmm import DEFAULT_DEVICE, device_granularity as mapping_granularity


@dataclass
class CacheConfig:
    """What the manager holds, and how pages are sized.

    Page sizing: ``page_size`` (bytes) when given is used as is, unpadded. Otherwise vmemkv
    chooses the page (a multiple of ``page_granularity``: 2 MiB on CUDA, 4 KiB on CPU unless set)
    and may pad each token's row by up to ``max_padding`` of its size, to give the fewest tokens
    per page, at least ``tokens_per_page``, in a page of at most ``max_page_bytes`` and never more
    than 512 tokens where the shape allows (``layout.choose_page``). Raising ``max_padding``
    trades memory for finer pages; 0 never pads. The result is ``make_layout().describe()``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int  # blocks in the pool (a block: every layer's K/V of tokens_per_page tokens)
    max_num_seqs: int  # slots
    max_model_len: int  # tokens each slot can hold
    dtype: torch.dtype = torch.float16
    device: str = DEFAULT_DEVICE
    tokens_per_page: int = 16  # the fewest tokens a page should hold (see above)
    page_size: int | None = None  # bytes; chosen when None (see above)
    max_padding: float = 0.07  # padding per token row, as a fraction of the row's own bytes
    max_page_bytes: int = 16 << 20  # pages above this only when no padding within limits allows
    page_granularity: int | None = None  # bytes; the device's when None (2 MiB pages on CPU too)
    # token_major on CPU too: per_layer reads a layer's K/V about 12 % faster in one batched
    # decode call, but costs 2 x layers map calls per page and gains nothing end to end
    # (experiments/bench_decode_layout.py, bench_step.py --layouts, the A/B's per-layer variants).
    layout: LayoutKind = "token_major"
    kv_backend: Literal["vmem", "paged"] = "vmem"
    # Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3): each layer caches one latent row per
    # token (num_kv_heads 1, head_dim kv_lora_rank + qk_rope_head_dim) instead of K and V.
    latent: bool = False
    # How K/V values are stored (vLLM's kv_cache_dtype): "auto" in ``dtype``; "int8" or "fp8"
    # (e4m3) one byte a value with a float32 scale per 32 values beside them in the page
    # (memory/quantized_rows.py): 0.56-0.58x of bfloat16's bytes at head_dim 64 (rows padded to 32 B), lossy.
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    hash_algorithm: str = "sha256"
    # The prefix hash chain's seed. None: a random one per manager (a hybrid model's layout
    # groups share theirs), so hashes cannot be predicted from outside and two managers' KV
    # events never name one hash for different caches; give the same bytes to managers whose
    # hashes must agree (KV events from several engines behind one router).
    hash_seed: bytes | None = None
    swap_space_bytes: int = 0
    # Host memory for the prefix cache's host tier (host_tier.py): cached blocks evicted from the
    # device pool wait there (LRU) and are copied back on a hit. 0: no tier. Its rows sit in the
    # same host block store as the swap space, beside swap_space_bytes.
    host_cache_bytes: int = 0
    # The prefix cache's lossy cold tier (cold_tier.py): cached blocks the device pool (or the full
    # host tier) lets go are kept compressed, "int8" or "int4" (block_codec.py), in at most
    # cold_cache_bytes of host memory, and decompressed on a hit; a request created with
    # exact=True never reuses them. "off": none. Full-attention and MLA layers only.
    cold_tier: str = "off"
    cold_cache_bytes: int = 0
    # Rates for the swap-or-recompute estimate; measure them on your machine for better choices.
    swap_bytes_per_second: float = 10e9
    prefill_tokens_per_second: float = 10e3
    vocab_size: int | None = None  # when known, token ids are checked against it
    # Every layer attends only the last ``sliding_window`` tokens (Mistral): blocks wholly behind
    # the window of every future query are given back while a request runs. None keeps every
    # block (models with any full-attention layer, or windows differing between layers).
    sliding_window: int | None = None
    # Every layer attends only within its query's chunk of ``attention_chunk_size`` positions
    # (Llama-4's chunked local attention): the blocks of finished chunks are given back while a
    # request runs. At most one of sliding_window and attention_chunk_size.
    attention_chunk_size: int | None = None
    # One KV memory budget shared by several engines (processes) on one machine
    # (memory/budget.py): the manager's pools back blocks with memory only within its share of the
    # budget named ``kv_pool``, which the first member creates with ``kv_pool_bytes`` bytes (a
    # later member gives the same number or None). ``num_blocks`` stays each pool's most blocks.
    kv_pool: str | None = None
    kv_pool_bytes: int | None = None
    # How many ranks' pages each block stands for in that budget: a tensor-parallel engine's rank
    # 0 is its only member, and every rank holds a block of the same size (its share of the heads).
    kv_pool_ranks: int = 1
    # A model with recurrent state layers: the state is saved every ``state_cache_interval``
    # prompt positions (a multiple of the attention layers' tokens per page) as a request is
    # computed, so a later request sharing the prefix continues from it (a prefix hit needs a saved
    # state at its end). None: every 4 pages (64 tokens at 16 per page): one saved state costs as
    # much as a whole request's state, so saving at every page would make a long prompt's saves
    # cost more than its KV; 0: no saved states (no prefix hits for these models).
    state_cache_interval: int | None = None

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype K/V values are stored in: ``dtype``, or int8 / float8_e4m3fn when quantized."""
        return storage_dtype(self.dtype, self.kv_cache_dtype)

    def make_layout(self) -> KVLayout:
        shape = (self.num_layers, self.num_kv_heads, self.head_dim, self.storage_dtype)
        if self.page_size:
            return KVLayout(*shape, self.page_size, self.layout, latent=self.latent)
        device_granularity = mapping_granularity(self.device)
        granularity = self.page_granularity or device_granularity
        if not isinstance(granularity, int) or granularity % device_granularity:
            raise ConfigError(f"CacheConfig.page_granularity is {granularity!r}; pass a multiple of "
                              f"{device_granularity} B (the {self.device} mapping granularity)")
        choice = choose_page(unpadded_row_bytes(*shape, self.layout, self.latent), granularity,
                             self.tokens_per_page, self.max_padding, self.max_page_bytes)
        return KVLayout(*shape, choice.page_size, self.layout, choice.token_stride_bytes, self.latent)


@dataclass
class CacheStats:
    prefix_queried_tokens: int = 0  # prompt tokens looked up at first admission
    prefix_hit_tokens: int = 0  # all tiers; below, by tier
    prefix_hit_tokens_device: int = 0  # mapped from the device pool as they were
    prefix_hit_tokens_host: int = 0  # copied back from the host tier (promoted)
    prefix_hit_tokens_cold: int = 0  # decompressed from the cold tier (lossy)
    # Prompt tokens past a first admission's page hits that a cached page continuing the same
    # prefix (same keys) also holds, up to the prompt's last token: hits lost because the shared
    # part is shorter than a page (what a token-granular cache would have served on top).
    prefix_partial_page_tokens: int = 0
    reprefill_queried_tokens: int = 0  # the same, for re-admission after preemption
    reprefill_hit_tokens: int = 0
    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    # The host tier (host_tier.py): blocks copied to host on eviction, copied back on a hit, and
    # dropped from host to make room; bytes copied each way.
    host_demotions: int = 0
    host_promotions: int = 0
    host_evictions: int = 0
    host_bytes_demoted: int = 0
    host_bytes_promoted: int = 0
    # The cold tier (cold_tier.py): blocks compressed into it, decompressed back on a hit (the
    # tokens: prefix_hit_tokens_cold) and dropped from it; the compressed bytes it stored.
    cold_demotions: int = 0
    cold_promotions: int = 0
    cold_evictions: int = 0
    cold_bytes_stored: int = 0
    forks: int = 0
    blocks_copied: int = 0  # copy-on-write copies of partial blocks
    blocks_released_behind_window: int = 0  # given back while running (CacheConfig.sliding_window)
    # Recurrent states saved at prefix positions (CacheConfig.state_cache_interval), their bytes,
    # and admissions that continued from one (a prefix hit of a model with state layers).
    states_saved: int = 0
    state_bytes_saved: int = 0
    state_hits: int = 0
    state_host_hits: int = 0  # of which loaded from the host tier

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0


@dataclass
class PreemptionEstimate:
    """What each way of preempting a request would cost.

    swap: ``2 * swap_bytes / swap_bytes_per_second`` (out now, in later);
    recompute: ``recompute_tokens / prefill_tokens_per_second``, where ``recompute_tokens`` are the
    computed tokens not covered by pages that other requests keep alive (those will still hit).
    Swap is chosen only when it is cheaper and the swap space has room.
    """

    swap_bytes: int
    recompute_tokens: int
    swap_seconds: float
    recompute_seconds: float
    swap_fits: bool

    @property
    def cheaper(self) -> Literal["swap", "recompute"]:
        return "swap" if self.swap_fits and self.swap_seconds < self.recompute_seconds else "recompute"
