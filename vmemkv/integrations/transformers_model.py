"""Shaping vmemkv for a Hugging Face model: :func:`manager_for` builds a :class:`KVCacheManager`
for the model's KV (checking its attention is one ``VmemkvCache`` can serve) and
:func:`cache_kwarg` names the keyword ``generate`` takes a cache by in this transformers version.
Part of :mod:`vmemkv.integrations.transformers_cache`, which re-exports both."""

from __future__ import annotations

import inspect

from ..hf_support import cache_config_for, check_attention_supported
from ..manager import KVCacheManager


def manager_for(model, max_batch_size: int, max_cache_len: int, num_blocks: int | None = None,
                **config) -> KVCacheManager:
    """A :class:`KVCacheManager` shaped for ``model`` (layers, KV heads, head dim, dtype, device).

    ``num_blocks`` defaults to every slot full plus one spare block per slot for copy-on-write,
    so ``generate`` never runs out; pass fewer to cap memory (on CUDA the pool is allocated up
    front). Other keyword arguments go to :class:`CacheConfig` (``tokens_per_page``,
    ``enable_prefix_caching``, ``hash_seed``, ...)."""
    # The model runs its own attention over the cache, so only windows and chunks matter here.
    check_attention_supported(model.config, max_cache_len, replaces_attention=False,
                              who="VmemkvCache", limit_name="max_cache_len")
    return KVCacheManager(cache_config_for(model, max_batch_size, max_cache_len, num_blocks,
                                           spare_blocks_per_slot=1, **config))


def cache_kwarg(model) -> str:
    """The keyword ``model.generate`` / ``forward`` take a cache by: ``cache`` in transformers
    5.24, ``past_key_values`` in 5.17 and 4.57."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
