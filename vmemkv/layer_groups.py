"""Which layers of a model with local (sliding-window) and global layers form each layout
group, and how the two groups share the KV memory: ``LayerGroups`` (the layers of each kind),
``group_configs`` (each group's ``CacheConfig``: its layers, its share of the blocks and of the
swap space, pages of one number of tokens) and ``split_blocks`` (the bytes of the pool shared
between the groups). ``hybrid.HybridKVCacheManager`` runs one manager per group."""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

from .cache_config import CacheConfig
from .errors import ConfigError
from .attention_spec import CHUNKED, SLIDING, AttentionSpec


LayerSpec = "int | AttentionSpec | None"  # a layer's window, its spec, or None: global


def _local_spec(layer: "int | AttentionSpec | None") -> AttentionSpec | None:
    """A layer's spec if it is local (a window ``W`` is a sliding window), None if global."""
    if isinstance(layer, AttentionSpec):
        return layer if layer.releases else None
    return AttentionSpec(SLIDING, layer) if layer else None


@dataclasses.dataclass(frozen=True)
class LayerGroups:
    """Which model layers are global (full attention) and which are local: one sliding window
    or one attention chunk (``local_spec``; a window ``W`` given as an int is a sliding one)."""

    global_layers: tuple[int, ...]
    local_layers: tuple[int, ...]
    local_spec: AttentionSpec

    def __post_init__(self) -> None:
        if not isinstance(self.local_spec, AttentionSpec):
            object.__setattr__(self, "local_spec", _local_spec(self.local_spec))  # frozen: set once

    @property
    def window(self) -> int | None:
        """The local layers' sliding window (None for attention chunks)."""
        return self.local_spec.window

    @classmethod
    def from_windows(cls, layer_windows: "Sequence[int | AttentionSpec | None]") -> "LayerGroups":
        """``layer_windows[i]``: layer ``i``'s sliding window or its ``AttentionSpec`` (sliding or
        chunked local), None (or full attention) for a global layer."""
        specs = [_local_spec(layer) for layer in layer_windows]
        kinds = {spec for spec in specs if spec is not None}
        if len(kinds) != 1:
            raise ConfigError(f"a hybrid KV cache needs local layers of one window or chunk; got "
                              f"{sorted(spec.describe() for spec in kinds) or 'none'}")
        global_layers = tuple(i for i, spec in enumerate(specs) if spec is None)
        local = kinds.pop()
        if not global_layers:
            raise ConfigError("every layer is chunked: use KVCacheManager with CacheConfig.attention_chunk_size"
                              if local.kind == CHUNKED else
                              "every layer slides: use KVCacheManager with CacheConfig.sliding_window")
        return cls(global_layers, tuple(i for i, spec in enumerate(specs) if spec is not None), local)


def split_blocks(config: CacheConfig, groups: LayerGroups, chunk_tokens: int | None,
                 local_blocks: int | None, global_group: CacheConfig,
                 local_group: CacheConfig) -> tuple[int, int]:
    """Blocks for the (global, local) groups out of the bytes of ``config.num_blocks`` blocks
    of all layers.

    The local group needs at most, per slot, the blocks a decode's window spans and one where a
    chunk ends, plus one step's chunk (``chunk_tokens``, the most tokens computed in a step over
    all requests); never more than would hold as many tokens as the whole pool. It gets that (or
    ``local_blocks``), and the global group the rest of the bytes."""
    whole = config.make_layout()
    local, global_ = local_group.make_layout(), global_group.make_layout()
    tokens = local.tokens_per_page
    most = -(-config.num_blocks * whole.tokens_per_page // tokens)
    if local_blocks is None:
        decode_peak = groups.local_spec.peak_blocks(config.max_model_len, 1, tokens)
        chunk_blocks = -(-(chunk_tokens or config.max_model_len) // tokens)
        local_blocks = config.max_num_seqs * (decode_peak + 1) + chunk_blocks
    local_blocks = min(local_blocks, most)
    left = config.num_blocks * whole.block_bytes - local_blocks * local.block_bytes
    return max(left // global_.block_bytes, 1), local_blocks


def group_configs(config: CacheConfig, groups: LayerGroups, chunk_tokens: int | None = None,
                  local_blocks: int | None = None) -> tuple[CacheConfig, CacheConfig]:
    """The (global, local) groups' configs: their layers, blocks (``split_blocks``) and share of
    the swap space and host tier, and pages of one number of tokens (a group's rows are shorter than the whole
    model's, so its pages may hold more tokens: both take the larger count, or a clear error),
    and one hash seed."""
    num_global, num_local = len(groups.global_layers), len(groups.local_layers)
    # One hash seed for both: a block's hash names its content in either group (as vLLM's groups
    # share a request's block hashes), so KV events of both groups speak of one hash per content.
    seed = config.hash_seed if config.hash_seed is not None else os.urandom(32)
    # Host bytes (swap space, the host tier) by layers: as many host blocks in each group, for a
    # request's two halves swap out together and a host hit is promoted only where both hold it.
    local = groups.local_spec
    chunk = local.size if local.kind == CHUNKED else None
    configs = [dataclasses.replace(config, num_layers=layers, sliding_window=window,
                                   attention_chunk_size=chunked, hash_seed=seed,
                                   swap_space_bytes=config.swap_space_bytes * layers // config.num_layers,
                                   host_cache_bytes=config.host_cache_bytes * layers // config.num_layers)
               for layers, window, chunked in ((num_global, None, None), (num_local, local.window, chunk))]
    tokens = [group.make_layout().tokens_per_page for group in configs]
    if tokens[0] != tokens[1] and not config.page_size:
        configs = [dataclasses.replace(group, tokens_per_page=max(tokens)) for group in configs]
        tokens = [group.make_layout().tokens_per_page for group in configs]
    if tokens[0] != tokens[1]:
        raise ConfigError(f"the global layers' pages hold {tokens[0]} tokens and the local layers' "
                          f"{tokens[1]}; give CacheConfig.tokens_per_page or max_padding that make "
                          "them equal")
    blocks = split_blocks(config, groups, chunk_tokens, local_blocks, *configs)
    global_group, local_group = (dataclasses.replace(group, num_blocks=count)
                                 for group, count in zip(configs, blocks))
    return global_group, local_group
