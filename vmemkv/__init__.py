"""vmemkv: a KV-cache memory manager on virtual-memory page mapping.

Each request's KV cache is virtually contiguous (attention kernels read it without a block table)
while physical pages come from a reference-counted pool with prefix caching, copy-on-write and
preemption. See README.md for the API.
"""

from vmemkv.errors import (BlockStateError, ConfigError, CudaDriverError, InvalidInputError,
                           InvalidStateError, ManagerClosedError, MappingError, MappingLimitError,
                           NativeExtensionError, OutOfBlocksError, RequestStateError, RequestTooLongError,
                           UnsupportedModelError, VmemkvError)
from vmemkv.errors import deprecated_name as _deprecated_name
from vmemkv.cache.hashing import CacheKeys, MultimodalItem
from vmemkv.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventBuffer
from vmemkv.cache.metrics import KVMetricsCollector
from vmemkv.memory.layout import KVLayout
from vmemkv.cache.config import CacheConfig, CacheStats, PreemptionEstimate
from vmemkv.cache.manager import KVCacheManager, PrefixCacheBusyError, UnknownRequestError
from vmemkv.cache.pool import BlockPool
from vmemkv.cache.request import KVRequest
from vmemkv.memory.slots import NoFreeSlotError
from vmemkv.cache.swap import OutOfSwapSpaceError
from vmemkv import _moved

_moved.install()  # the modules' paths before the concept folders, for one release

__version__ = "0.1.0"

_ENGINE_NAMES = {"LLM", "SamplingParams", "EngineConfig"}


def _hybrid_manager(config, layer_windows, chunk_tokens=None, local_blocks=None, metrics=None,
                    backends=None, events=None) -> KVCacheManager:
    """``HybridKVCacheManager(...)`` as it was called before 0.2."""
    return KVCacheManager(config, metrics=metrics, events=events, layer_windows=layer_windows,
                          chunk_tokens=chunk_tokens, local_blocks=local_blocks, backends=backends)


def __getattr__(name: str):
    if name == "PagePool":  # the pre-0.2 name of BlockPool, kept for one release
        import warnings
        warnings.warn("vmemkv.PagePool is deprecated; use vmemkv.BlockPool", DeprecationWarning,
                      stacklevel=2)
        return BlockPool
    if name == "HybridKVCacheManager":  # before 0.2: a second manager; now KVCacheManager's groups
        import warnings
        warnings.warn("vmemkv.HybridKVCacheManager is deprecated; use vmemkv.KVCacheManager(config, "
                      "layer_windows=...)", DeprecationWarning, stacklevel=2)
        return _hybrid_manager
    if name in ("OutOfPagesError", "PageStateError"):  # the pre-0.2 names, kept for one release
        return _deprecated_name(__name__, name)
    # The engine pulls in transformers; load it only when asked for.
    if name in _ENGINE_NAMES:
        from vmemkv import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'vmemkv' has no attribute {name!r}")
