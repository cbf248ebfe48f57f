"""Which layers of a model form each layer group, and how the groups share the KV memory:
``LayerGroups`` (the layers of each attention kind, full attention first), ``group_configs``
(each group's ``CacheConfig``: its layers, its share of the blocks and of the host bytes, pages of
one number of tokens) and ``split_blocks`` (the bytes of the pool shared between the groups).
``KVCacheManager`` runs one ``KVCacheGroup`` per group."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from vmemkv.cache.config import CacheConfig
from vmemkv.cache.kv_spec import KVCacheSpec, spec_of_layer
from vmemkv.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class LayerGroups:
    """``specs[g]``: group ``g``'s attention spec; ``layers[g]``: its model layers, in order. The
    full-attention group (when a layer has full attention) is group 0, the others follow in the
    order their kinds first appear."""

    specs: tuple[KVCacheSpec, ...]
    layers: tuple[tuple[int, ...], ...]

    @classmethod
    def from_windows(cls, layer_windows: "Sequence[int | KVCacheSpec | None]") -> "LayerGroups":
        """``layer_windows[i]``: layer ``i``'s sliding window or its ``KVCacheSpec`` (or an
        ``AttentionSpec``, which makes one), None for a full-attention layer."""
        specs = [spec_of_layer(layer) for layer in layer_windows]
        kinds = sorted(set(specs), key=lambda spec: (spec.releases, specs.index(spec)))
        keeping = [spec.describe() for spec in kinds if not spec.releases]
        if len(keeping) > 1:  # the first group grows with a request, the others are bounded
            raise ConfigError(f"layer_windows mixes {' and '.join(keeping)}, which both keep every "
                              "block; give at most one kind of layer that reads every position")
        return cls(tuple(kinds), tuple(tuple(i for i, spec in enumerate(specs) if spec == kind)
                                       for kind in kinds))

    @property
    def local_specs(self) -> tuple[KVCacheSpec, ...]:
        return tuple(spec for spec in self.specs if spec.releases)


def split_blocks(config: CacheConfig, groups: LayerGroups, chunk_tokens: int | None,
                 local_blocks: int | None, layouts: list) -> list[int]:
    """Blocks for each group out of the bytes of ``config.num_blocks`` blocks of all layers.

    A group whose blocks go back behind its window or chunk needs at most, per slot, the blocks
    a decode's window spans and one where a chunk ends, plus one step's chunk (``chunk_tokens``,
    the most tokens computed in a step over all requests); never more than would hold as many
    tokens as the whole pool. It gets that (or ``local_blocks``), and the first group the rest of
    the bytes."""
    whole = config.make_layout()
    most = -(-config.num_blocks * whole.tokens_per_page // layouts[0].tokens_per_page)
    counts = []
    for spec, layout in zip(groups.specs, layouts):
        if not spec.releases or spec == groups.specs[0]:
            counts.append(None)  # the first group takes the rest
            continue
        tokens = layout.tokens_per_page
        blocks = local_blocks
        if blocks is None:
            decode_peak = spec.peak_blocks(config.max_model_len, 1, tokens)
            chunk_blocks = -(-(chunk_tokens or config.max_model_len) // tokens)
            blocks = config.max_num_seqs * (decode_peak + 1) + chunk_blocks
        counts.append(min(blocks, most))
    left = config.num_blocks * whole.block_bytes - sum(
        count * layout.block_bytes for count, layout in zip(counts, layouts) if count is not None)
    counts[0] = max(left // layouts[0].block_bytes, 1)
    return counts


def group_configs(config: CacheConfig, groups: LayerGroups, chunk_tokens: int | None = None,
                  local_blocks: int | None = None) -> list[CacheConfig]:
    """Each group's config: its layers, blocks (``split_blocks``), share of the swap space and
    host tier (by layers), and pages of one number of tokens (a group's rows are shorter than
    the whole model's, so its pages may hold more tokens: all take the largest count, or a clear
    error)."""
    num_layers = config.num_layers
    configs = [dataclasses.replace(config, num_layers=len(layers), **spec.config_fields(),
                                   swap_space_bytes=config.swap_space_bytes * len(layers) // num_layers,
                                   host_cache_bytes=config.host_cache_bytes * len(layers) // num_layers)
               for spec, layers in zip(groups.specs, groups.layers)]
    tokens = [group.make_layout().tokens_per_page for group in configs]
    if len(set(tokens)) > 1 and not config.page_size:
        configs = [dataclasses.replace(group, tokens_per_page=max(tokens)) for group in configs]
        tokens = [group.make_layout().tokens_per_page for group in configs]
    if len(set(tokens)) > 1:
        raise ConfigError(f"the layer groups' pages hold {tokens} tokens; give "
                          "CacheConfig.tokens_per_page or max_padding that make them equal")
    counts = split_blocks(config, groups, chunk_tokens, local_blocks,
                          [group.make_layout() for group in configs])
    return [dataclasses.replace(group, num_blocks=count) for group, count in zip(configs, counts)]
