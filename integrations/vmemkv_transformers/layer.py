"""One layer's face of a ``VmemkvCache``: transformers 5.x asks a ``Cache`` for per-layer objects
(``cache.layers[i]``); each forwards to the cache, which holds all state."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

if TYPE_CHECKING:
    from vmemkv_transformers.cache import VmemkvCache


class _VmemkvLayer(CacheLayerMixin):
    """One layer's face of a VmemkvCache; all state lives in the cache."""

    is_compileable = False
    is_croppable = True

    def __init__(self, cache: VmemkvCache, layer_idx: int):  # no super(): keys/values are views
        self._cache = cache
        self.layer_idx = layer_idx

    @property
    def is_sliding(self) -> bool:
        """Whether the cache keeps only this layer's window (transformers then builds its mask
        from this layer's ``get_mask_sizes``)."""
        return self._cache.is_layer_sliding(self.layer_idx)

    @property
    def is_initialized(self) -> bool:
        return self._cache.num_rows > 0

    @property
    def keys(self) -> torch.Tensor | None:
        return self._cache.layer_views(self.layer_idx)[0] if self._cache.num_rows else None

    @property
    def values(self) -> torch.Tensor | None:
        return self._cache.layer_views(self.layer_idx)[1] if self._cache.num_rows else None

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self._cache.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        return self._cache.get_mask_sizes(query_length, self.layer_idx)

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length()

    def get_max_length(self) -> int:
        return self._cache.max_cache_len

    get_max_cache_shape = get_max_length  # transformers < 5.2x

    # The cache-level methods act on all layers at once; these per-layer ones are never used.
    def reset(self) -> None:
        pass

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("call VmemkvCache.reorder_cache")

    def crop(self, max_length: int) -> None:
        self._cache.crop(max_length)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("call VmemkvCache.batch_repeat_interleave")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("call VmemkvCache.batch_select_indices")
