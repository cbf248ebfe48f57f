"""How a step addresses the KV cache, chosen once per engine: slots or block tables.

``kv_backend="vmem"``: every sequence's K/V is one virtually contiguous slot, read in place by the
contiguous attention (or FlashAttention over the slots), and decoding sequences may get their next
block mapped ahead of time (``lookahead``). ``kv_backend="paged"``: every sequence is a block table,
read by the block-table attention (or FlashAttention over block tables). ``choose_addressing``
resolves the backend and the attention kernel (``config.attention``) into one of the two
strategies below (block tables of a hybrid model: one table per layout group); the step never
branches on either again.
"""

from __future__ import annotations

import torch

from vmemkv.attention import BlockTableAttention, ContiguousAttention, SequenceSpan
from vmemkv.attention.choice import AttentionChoice, choose_attention
from vmemkv.attention.flash import FlashBlockTableAttention, FlashSlotAttention
from vmemkv.attention.flash_args import flat_rows, slot_geometry
from vmemkv.attention.latent import LatentAttention
from vmemkv.cache.request import KVRequest
from vmemkv.errors import ConfigError
from vmemkv.engine.core.config import EngineConfig
from vmemkv.engine.core.kv_manager import KVViews


class Addressing:
    """One sequence's span of the packed batch, and the step's attention over all spans.
    ``views``: what it reads of the KV cache (``KVCacheManager.views()``, read-only: the
    addressing holds no manager)."""

    uses_lookahead = False  # decoding sequences get their next block mapped during the forward

    def __init__(self, views: KVViews, device, choice: AttentionChoice, share_prefixes: bool = False):
        self.views = views
        self.device = device
        self.choice = choice
        # decoding sequences that hold the same leading blocks read them once (the CPU's routine)
        self.share_prefixes = share_prefixes and choice.kind == "native"

    def span(self, kv: KVRequest, begin: int, count: int, computed: int) -> SequenceSpan:
        """A running sequence's span (read from its KVRequest: no lookup by id)."""
        raise NotImplementedError

    def attention(self, spans: list[SequenceSpan]):
        """The attention object the model's layers call this step (it writes K/V and attends)."""
        raise NotImplementedError


class SlotAddressing(Addressing):
    """Virtually contiguous slots: a sequence is its slot; attention reads the slot in place."""

    uses_lookahead = True

    def __init__(self, views: KVViews, device, choice: AttentionChoice, share_prefixes: bool = False):
        # the spans carry block tables for that, which a hybrid's layout groups do not share
        super().__init__(views, device, choice, share_prefixes and len(views.layout_groups) == 1)
        if views.layout.latent:  # MLA: latent rows, attended in the absorbed form on any device
            scales = views.kv_scale_views if views.layout.scaled else None  # quantized rows
            self.attention = lambda spans: LatentAttention(spans, views.kv_views, device, scales)
        elif choice.kind == "flash":
            kernel, geometry = choice.kernel, layer_geometries(views)
            distinct = sorted(set(filter(None, geometry)))
            if len(distinct) == 1:
                rows_per_slot, num_rows = distinct[0]
                self.attention = lambda spans: FlashSlotAttention(
                    spans, views.kv_views, device, kernel, rows_per_slot, num_rows)
            else:  # layout groups whose slots flatten differently: one varlen geometry each
                group_of = [distinct.index(layer) if layer else None for layer in geometry]
                self.attention = lambda spans: GroupedAttention(
                    [FlashSlotAttention(spans, views.kv_views, device, kernel, rows, num)
                     for rows, num in distinct], group_of, spans)
        else:
            decode_kernel, reads = choice.decode_kernel, views.batched_reads()
            block_tokens = views.tokens_per_page if self.share_prefixes else 0
            scales = views.kv_scale_views if views.layout.scaled else None  # quantized rows
            self.attention = lambda spans: ContiguousAttention(
                spans, views.kv_views, device, decode_kernel, reads=reads,  # batched reads (CPU)
                prefix_block_tokens=block_tokens, kv_scale_views=scales)

        if any(group.holds_state for group in views.layout_groups):  # the mixers read the states
            self.attention = _with_states(self.attention, views.state_views)

    def span(self, kv: KVRequest, begin: int, count: int, computed: int) -> SequenceSpan:
        if self.share_prefixes:
            return SequenceSpan(kv.slot, begin, count, computed, kv.block_table)
        return SequenceSpan(kv.slot, begin, count, computed)


def _with_states(make_attention, state_views):
    """``make_attention`` whose attention objects also hand the recurrent mixers each layer's
    state views (``state_mixers.py``)."""
    def attention(spans):
        made = make_attention(spans)
        made.state_views = state_views
        return made
    return attention


def kv_layers(views: KVViews) -> list[int]:
    """The model layers holding K/V (not a recurrent state, nor no memory at all)."""
    return sorted(layer for group in views.layout_groups if not group.holds_state
                  for layer in group.layers)


def layer_geometries(views: KVViews) -> list[tuple[int, int]]:
    """Each model layer's flattened slot views for FlashAttention: (rows per slot, rows). One
    pair for every layer of a manager; layout groups of a hybrid model with different numbers
    of layers differ in the per-layer layout (a slot's rows span its group's layers)."""
    geometry = []
    holding = set(kv_layers(views))
    for layer in range(views.config.num_layers):
        if layer not in holding:  # no K/V: its mixer reads its state, or it holds nothing
            geometry.append(None)
            continue
        k_view, v_view = views.kv_views(layer)
        rows = slot_geometry(k_view, v_view)
        geometry.append((rows, flat_rows(k_view, rows)))
    return geometry


class BlockTableAddressing(Addressing):
    """Block tables (the paged baseline): a sequence is its list of blocks."""

    def __init__(self, views: KVViews, device, choice: AttentionChoice, share_prefixes: bool = False):
        super().__init__(views, device, choice, share_prefixes)
        tokens_per_page, share = views.tokens_per_page, self.share_prefixes
        # Blocks released behind a sliding window stay RELEASED (-1) in the spans; FlashAttention's
        # arguments point them at the first held block (flash_args.fill_released).
        if choice.kind == "flash":
            kernel = choice.kernel
            self.attention = lambda spans: FlashBlockTableAttention(
                spans, views.block_views, tokens_per_page, device, kernel)
        else:
            decode_kernel = choice.decode_kernel
            scales = views.block_scale_views if views.layout.scaled else None  # quantized rows
            self.attention = lambda spans: BlockTableAttention(
                spans, views.block_views, tokens_per_page, device, decode_kernel, share, scales)

    def span(self, kv: KVRequest, begin: int, count: int, computed: int) -> SequenceSpan:
        return SequenceSpan(kv.slot, begin, count, computed, kv.block_table)


class GroupedAttention:
    """A hybrid model's step attention: one attention per layout group, each over its group's
    spans (its own block tables), and each layer sent to its group's (``group_of[layer]``).
    ``spans``: the step's spans as the addressing made them (one per group for each sequence)."""

    def __init__(self, parts: list, group_of: list[int], spans: list):
        self.parts, self.group_of, self.spans = parts, group_of, spans

    def upload(self, **model_inputs: list[int]) -> dict:
        # one upload per group: on CUDA two host-to-device copies a step instead of one
        inputs = self.parts[0].upload(**model_inputs)
        for part in self.parts[1:]:
            part.upload()
        return inputs

    def __call__(self, layer: int, *args, **kwargs):
        return self.parts[self.group_of[layer]](layer, *args, **kwargs)

    seconds = property(lambda self: sum(part.seconds for part in self.parts))
    copy_seconds = property(lambda self: sum(part.copy_seconds for part in self.parts))


class GroupedBlockTableAddressing(BlockTableAddressing):
    """Block tables of a manager with several layer groups (``KVViews.layout_groups``):
    each group has its own pool, so a sequence has one block table per group (a local group's
    with its blocks behind the window released), and each group's layers read through its own.
    A span is the tuple of the sequence's spans, one per group."""

    def __init__(self, views: KVViews, device, choice: AttentionChoice, share_prefixes: bool = False):
        super().__init__(views, device, choice, share_prefixes)
        self.num_groups = len(views.layout_groups)
        group_of = [views.layer_group(layer).index for layer in range(views.config.num_layers)]
        one_group = self.attention
        self.attention = lambda spans: GroupedAttention(
            [one_group([group_spans[g] for group_spans in spans]) for g in range(self.num_groups)],
            group_of, spans)

    def span(self, kv: KVRequest, begin: int, count: int, computed: int) -> tuple[SequenceSpan, ...]:
        return tuple(SequenceSpan(kv.slot, begin, count, computed, kv.group_block_table(g))
                     for g in range(self.num_groups))


def _attention_choice(attention: str, kv_backend: str, manager: KVViews, device,
                      num_query_heads: int) -> AttentionChoice:
    """``attention`` resolved for this device, dtype and shapes."""
    layout = manager.layout
    if layout.latent:  # MLA: one attention (attention/latent.py) over latent rows, torch ops on any device
        if attention not in ("auto", "sdpa"):
            raise ConfigError(f"attention={attention!r}: an MLA model's latent rows are attended in "
                              "the absorbed form by torch operations, not that kernel; use "
                              "attention='auto'")
        return AttentionChoice("sdpa", why_not_flash="MLA latent rows: the absorbed-form attention")
    if layout.scaled and attention == "flash":
        raise ConfigError(f"kv_cache_dtype {manager.config.kv_cache_dtype!r} with attention=flash: quantized "
                          "rows are read by the native CPU routine, the Triton kernel or SDPA; use "
                          "attention 'auto', 'native', 'triton' or 'sdpa'")
    dtype = layout.dtype
    if layout.scaled:  # the kernels compute in the model's dtype; FlashAttention-2 reads no bytes
        dtype = manager.config.dtype
        attention = "triton" if attention == "auto" and device.type == "cuda" else attention
    views = [] if kv_backend == "paged" else [manager.kv_views(layer) for layer in kv_layers(manager)]
    return choose_attention(attention, device, kv_backend, dtype, num_query_heads, layout.num_kv_heads,
                            layout.head_dim, manager.tokens_per_page, views[0] if views else None, views[1:])


def slot_attention(manager: KVViews, num_query_heads: int, device=None, attention: str = "auto"):
    """The engine's attention over a manager's slots, for a custom engine: returns
    ``make_step(spans)``, which takes one ``SequenceSpan(slot, query_start, num_queries,
    num_cached)`` per request of a packed step and gives the step's attention object. Call that
    object per layer as ``step(layer, query, key, value, scaling)`` (``query`` ``[1, Hq, T, D]``,
    ``key``/``value`` ``[1, Hk, T, D]`` after RoPE, ``T`` every request's new tokens side by side):
    it writes the new K/V into each request's slot at positions ``num_cached ..`` and returns the
    attention output ``[1, T, Hq, D]``, with the kernels the engine picks for ``attention``
    (``"auto"``: FlashAttention or Triton on CUDA, the native routines on CPU; ``"sdpa"``,
    ``"flash"``, ``"triton"``, ``"native"``). ``device``: the manager's by default."""
    device = torch.device(manager.config.device if device is None else device)
    choice = _attention_choice(attention, "vmem", manager, device, num_query_heads)
    return SlotAddressing(manager, device, choice).attention


def choose_addressing(config: EngineConfig, views: KVViews, device,
                      num_query_heads: int) -> Addressing:
    """``config.kv_backend`` and ``config.attention`` resolved once for this device, dtype, shapes."""
    paged = config.kv_backend == "paged"
    choice = _attention_choice(config.attention, config.kv_backend, views, device, num_query_heads)
    share = config.shared_prefix_decode
    if not paged:
        return SlotAddressing(views, device, choice, share)
    # several layer groups (of a manager, or of a tensor-parallel worker's view of one)
    grouped = len(views.layout_groups) > 1
    return (GroupedBlockTableAddressing if grouped else BlockTableAddressing)(views, device, choice, share)
