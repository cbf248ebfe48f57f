"""The KV cache: the coordinator (``manager.KVCacheManager``) over one single-type manager per
layer group (``group.KVCacheGroup``, one subclass per kind of KV memory: ``kv_spec.KVCacheSpec``), the pools behind them (``memory.KVMemory``: ``pool``,
``swap``, ``host_tier``), the requests' allocations (``request``, ``allocation``), prefix keys
(``hashing``), KV events and metrics. It imports ``memory/`` and never ``attention/`` or the engine.
"""
