"""Shaping vmemkv for a Hugging Face model: :func:`manager_for` builds a :class:`KVCacheManager`
for the model's KV (checking its attention is one ``VmemkvCache`` can serve; sliding-window
layers get their own blocks, released behind the window), :func:`layer_windows` says which layers
a manager keeps windowed, and :func:`cache_kwarg` names the keyword ``generate`` takes a cache by
in this transformers version. Part of :mod:`vmemkv_transformers.cache`, which
re-exports them."""

from __future__ import annotations

import inspect

from vmemkv import KVCacheManager, KVCacheSpec
from vmemkv.engine import make_kv_manager
from vmemkv.engine.models.hf_support import cache_config_for, check_attention_supported, storing_layers


def manager_for(model, max_batch_size: int, max_cache_len: int, num_blocks: int | None = None,
                *, release_behind_window: bool = True,
                **config) -> KVCacheManager:
    """A manager shaped for ``model`` (layers, KV heads, head dim, dtype, device).

    With ``release_behind_window`` (the default) sliding-window layers hold O(window) blocks: a
    model whose every layer slides with one window shorter than ``max_cache_len`` (Mistral) gets
    a windowed :class:`KVCacheManager`, one mixing local and global layers (Gemma-2/3) one with a
    layer group per kind (when its groups' pages can hold one number of tokens; else
    every layer keeps every token, as with ``release_behind_window=False``, and the model's mask
    applies the window). ``num_blocks`` defaults to every slot full plus one spare block per slot
    for copy-on-write, so ``generate`` never runs out; pass fewer to cap memory (on CUDA the pool
    is allocated up front). Other keyword arguments go to :class:`CacheConfig`
    (``tokens_per_page``, ``enable_prefix_caching``, ``hash_seed``, ...)."""
    # The model runs its own attention over the cache, so only windows and chunks matter here.
    check_attention_supported(model.config, max_cache_len, replaces_attention=False,
                              who="VmemkvCache", limit_name="max_cache_len")
    # Layers that reuse another's K/V (Gemma-3n's KV-shared layers, the last ones) never reach
    # the cache: it holds the layers before them.
    cache_config = cache_config_for(model, max_batch_size, max_cache_len, num_blocks,
                                    spare_blocks_per_slot=1, num_layers=storing_layers(model.config),
                                    release_behind_window=release_behind_window, **config)
    # The engine's factory. A forward computes every row's new tokens before any block behind the
    # window goes back (at the commit after it): the local layers' group holds one forward's
    # tokens, up to every row's whole prompt at once. The model's own attention reads chunked
    # local layers from position 0, so they keep every token (no group of their own).
    return make_kv_manager(cache_config, model.config, max_model_len=max_cache_len,
                           chunk_tokens=max_batch_size * max_cache_len,
                           release_behind_window=release_behind_window, chunked_groups=False)


def layer_specs(manager: KVCacheManager) -> list[KVCacheSpec]:
    """Each layer's kind as ``manager`` keeps it: blocks wholly before its ``first_read`` are
    released, so a cache reads such a layer from there."""
    groups = manager.layout_groups
    if len(groups) == 1:  # one group holds every layer
        return [groups[0].spec] * groups[0].layout.num_layers
    return [manager.layer_group(layer).spec for layer in range(manager.config.num_layers)]


def layer_windows(manager: KVCacheManager) -> list[int | None]:
    """Each layer's sliding window as ``manager`` keeps it (None: every token is kept)."""
    return [spec.window for spec in layer_specs(manager)]


def cache_kwarg(model) -> str:
    """The keyword ``model.generate`` / ``forward`` take a cache by: ``cache`` in transformers
    5.24, ``past_key_values`` in 5.17 and 4.57."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
