"""The KV cache: the coordinator (``manager.KVCacheManager``) over one single-type manager per
attention group (``group.KVCacheGroup``), the pools behind them (``memory.KVMemory``: ``pool``,
``swap``, ``host_tier``), the requests' allocations (``request``, ``allocation``), prefix keys
(``hashing``), KV events and metrics. It imports ``memory/`` and never ``attention/`` or the engine.
"""
