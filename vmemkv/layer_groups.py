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
from .window import peak_blocks


@dataclasses.dataclass(frozen=True)
class LayerGroups:
    """Which model layers are global (full attention) and which are local (one window)."""

    global_layers: tuple[int, ...]
    local_layers: tuple[int, ...]
    window: int

    @classmethod
    def from_windows(cls, layer_windows: Sequence[int | None]) -> "LayerGroups":
        """``layer_windows[i]``: layer ``i``'s sliding window, None for a global layer."""
        windows = {w for w in layer_windows if w}
        if len(windows) != 1:
            raise ConfigError(f"a hybrid KV cache needs local layers of one window; got windows "
                              f"{sorted(windows)}")
        global_layers = tuple(i for i, w in enumerate(layer_windows) if not w)
        if not global_layers:
            raise ConfigError("every layer slides: use KVCacheManager with CacheConfig.sliding_window")
        return cls(global_layers, tuple(i for i, w in enumerate(layer_windows) if w), windows.pop())


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
        decode_peak = peak_blocks(config.max_model_len, 1, groups.window, tokens)
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
    configs = [dataclasses.replace(config, num_layers=layers, sliding_window=window, hash_seed=seed,
                                   swap_space_bytes=config.swap_space_bytes * layers // config.num_layers,
                                   host_cache_bytes=config.host_cache_bytes * layers // config.num_layers)
               for layers, window in ((num_global, None), (num_local, groups.window))]
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
