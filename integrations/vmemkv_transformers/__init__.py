"""vmemkv for Hugging Face transformers: ``VmemkvCache``, a transformers ``Cache`` for
``model.generate()`` backed by a :class:`vmemkv.KVCacheManager`.

    from vmemkv_transformers import VmemkvCache, cache_kwarg

    cache = VmemkvCache.from_model(model, max_batch_size=8, max_cache_len=2048)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64,
                         **{cache_kwarg(model): cache})

* :mod:`vmemkv_transformers.cache`: ``VmemkvCache`` (see its docstring for the whole story);
* :mod:`vmemkv_transformers.model`: ``manager_for`` (a manager shaped for a model),
  ``layer_windows`` and ``cache_kwarg``;
* its parts: ``layer`` (the per-layer objects transformers asks for), ``rows`` (row
  bookkeeping) and ``prefix`` (prefix reuse across ``generate`` calls).

It uses only vmemkv's public API (``integrations/README.md``).
"""

from vmemkv_transformers.cache import VmemkvCache
from vmemkv_transformers.model import cache_kwarg, layer_windows, manager_for

__all__ = ["VmemkvCache", "cache_kwarg", "layer_windows", "manager_for"]
