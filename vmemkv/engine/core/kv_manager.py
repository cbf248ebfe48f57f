"""The KV cache manager as the engine sees it: the members it calls (``KVViews`` for the step's
addressing, ``KVManager`` for everything else), and the one factory that shapes a manager for a
Hugging Face model (``make_kv_manager``).

``KVCacheManager`` satisfies both protocols; the read-only view it gives the step's addressing
(``views()``) and a tensor-parallel worker's view of its manager (its addressing replays rank 0's
batched reads) satisfy ``KVViews``. Of the engine's parts only the scheduler holds the
manager; the engine calls nothing else on it, so a member missing from these protocols is a
member the engine does not use (a manager's pools and groups are its own: ``memories`` is not
here, the engine asks queries such as ``fragmentation`` instead).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

from vmemkv.cache.kv_spec import ChunkedLocalSpec, KVCacheSpec, spec_of_config
from vmemkv.cache.manager import KVCacheManager
from vmemkv.engine.models.hf_support import hybrid_layer_windows, layer_chunks
from vmemkv.engine.models.state_mixers import state_specs

if TYPE_CHECKING:
    import torch

    from vmemkv.cache.config import CacheConfig, CacheStats, PreemptionEstimate
    from vmemkv.cache.group import KVCacheGroup
    from vmemkv.cache.request import KVRequest
    from vmemkv.memory.layout import KVLayout
    from vmemkv.memory.slots import MapJob


@runtime_checkable
class KVViews(Protocol):
    """What the step's addressing and attention read: the layout, the layer groups and the views
    over the pool (``addressing.py``)."""

    config: "CacheConfig"
    layout: "KVLayout"
    tokens_per_page: int

    @property
    def layout_groups(self) -> "tuple[KVCacheGroup, ...]": ...

    def layer_group(self, layer: int) -> "KVCacheGroup": ...

    def kv_views(self, layer: int) -> "tuple[torch.Tensor, torch.Tensor]": ...

    def kv_scale_views(self, layer: int) -> "tuple[torch.Tensor, torch.Tensor] | None": ...

    def block_views(self, layer: int) -> "tuple[torch.Tensor, torch.Tensor]": ...

    def block_scale_views(self, layer: int) -> "tuple[torch.Tensor, torch.Tensor] | None": ...

    def batched_reads(self): ...


@runtime_checkable
class KVManager(KVViews, Protocol):
    """Every manager member the engine calls, all through the scheduler that holds it: its
    admission, growth, forks, preemption and lookahead; the commit and the lookahead mapping
    the plan's ``KVStep`` carries out for the postprocessor and the runner; the addressing's
    views; the engine's validation, stats, give-backs and close."""

    # --- what the scheduler reads ------------------------------------------------------------------
    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_free_slots(self) -> int: ...

    def blocks_for_tokens(self, num_tokens: int, chunk_tokens: int | None = None) -> int: ...

    def why_never_fits(self, num_tokens: int, chunk_tokens: int | None = None) -> str | None: ...

    def match_prefix(self, request: "KVRequest") -> tuple[list, list[bytes]]: ...

    def aligned_chunk_end(self, computed: int, end: int, num_tokens: int) -> int: ...

    def estimate_preemption(self, request: "KVRequest") -> "PreemptionEstimate": ...

    # --- what the scheduler changes ----------------------------------------------------------------
    def admit(self, request: "KVRequest", *, token_budget: int | None = None) -> int | None: ...

    def allocate(self, request: "KVRequest", num_new_tokens: int) -> bool: ...

    def allocate_each(self, requests: "Sequence[KVRequest]", counts: Sequence[int]) -> int: ...

    def preempt(self, request: "KVRequest", mode: str) -> str: ...

    def swap_in(self, request: "KVRequest") -> bool: ...

    def free(self, request: "KVRequest") -> None: ...

    def discard(self, request: "KVRequest") -> None: ...

    def allocate_lookahead(self, requests: "Sequence[KVRequest]", margin_tokens: int,
                           keep_free: int = 0) -> "list[MapJob]": ...

    def cancel_lookahead(self, jobs: "list[MapJob]") -> None: ...

    # --- what the plan's KVStep carries out for the runner and the postprocessor ----------------
    def map_lookahead(self, jobs: "list[MapJob]") -> None: ...

    def commit_all(self, requests: "Sequence[KVRequest]") -> None: ...

    def fork(self, parent: "KVRequest", child: "KVRequest") -> "KVRequest | None": ...

    def views(self) -> KVViews: ...

    # --- stats and lifetime ------------------------------------------------------------------------
    @property
    def num_blocks_in_use(self) -> int: ...

    @property
    def kv_bytes_in_use(self) -> int: ...

    def usage(self) -> float: ...

    def fragmentation(self, requests: "Sequence[KVRequest]") -> tuple[int, int]: ...

    def cache_stats(self) -> "CacheStats": ...

    def snapshot_stats(self) -> dict: ...

    def release_free_memory(self, keep_blocks: int = 0, cached: bool = False) -> int: ...

    def reset_prefix_cache(self) -> int: ...

    def close(self) -> None: ...


def layer_windows(model_config, max_model_len: int, release_behind_window: bool = True,
                  chunked_groups: bool = True) -> "list[int | KVCacheSpec | None] | None":
    """Each layer's window (or, for chunked local layers, its ``ChunkedLocalSpec``; None: global)
    when local and global layers are kept in layer groups of their own (blocks no later query
    reads released), else None (one group keeps every layer's tokens). ``chunked_groups``: give
    chunked local layers a group of their own (the caller's attention reads from chunk starts)."""
    if not release_behind_window:
        return None
    windows = hybrid_layer_windows(model_config, max_model_len)
    chunks = layer_chunks(model_config) if chunked_groups else None  # Llama-4: chunked and global
    if windows is None and chunks and None in chunks and min(filter(None, chunks)) < max_model_len:
        return [ChunkedLocalSpec(chunk) if chunk else None for chunk in chunks]
    return windows


def make_kv_manager(cache: "CacheConfig", model_config, *, max_model_len: int, chunk_tokens: int,
                    release_behind_window: bool = True, chunked_groups: bool = True,
                    **manager_options) -> KVCacheManager:
    """The manager for a model of ``model_config`` (a Hugging Face config) over ``cache``: one
    layer group, or one per kind of layer for a model mixing local and global layers
    (``layer_windows``). ``chunk_tokens``: the most tokens one forward computes per request
    before any block behind a window goes back (the engine's ``max_num_batched_tokens``);
    ``chunked_groups``: see ``layer_windows`` (``VmemkvCache`` reads no chunk starts).
    ``manager_options`` go to ``KVCacheManager.for_layers`` (metrics, events, backends). Every
    tensor-parallel rank calls it with the same arguments, so every rank builds the same groups."""
    windows = layer_windows(model_config, max_model_len, release_behind_window, chunked_groups)
    states = state_specs(model_config, cache.dtype)
    if states:  # recurrent layers keep a state group each kind; the others as they would
        attention = spec_of_config(cache) if cache.latent else None  # (Kimi Linear's MLA rows)
        windows = [state or (windows[i] if windows else attention) for i, state in enumerate(states)]
    if windows:  # a cache of the leading layers only (VmemkvCache without Gemma-3n's KV-shared ones)
        windows = windows[:cache.num_layers]
    return KVCacheManager.for_layers(cache, windows, chunk_tokens, **manager_options)
