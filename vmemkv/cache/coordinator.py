"""The coordinator over the layer groups: :class:`KVCacheCoordinator`.

A model's layers split into one :class:`KVCacheGroup` (``group.py``) per kind of KV memory (full
attention, a sliding window, attention chunks), as vLLM v1's ``KVCacheCoordinator`` over its
single-type managers. A model whose layers read alike has one group; Gemma-2/3, GPT-OSS, Cohere2
and Llama-4 have two. Every group has its own virtual tensors; groups whose blocks have the same
bytes draw from one :class:`KVMemory` (``memory.py``: pages, pool, swap space, host tier), the
others from one each. All groups share one slot index, one hash chain per request and one set of
counters (``stats``).

The coordinator builds the groups and memories from a :class:`CacheConfig` and answers, over every
group at once, what an operation of the manager asks before it changes anything: do the fresh
blocks fit in every memory (``fits``), which blocks each group would get (``peek``), is the slot
free, which prefix hits every group can reuse (``cached_hits``, ``common_hits``, ``host_reach``),
and why a call was refused (``last_refusal``). Once every check passed it carries out the steps
over the memories (``take``, ``copy``, ``claim``) and registers full blocks in every group. It
knows no requests: callers pass the allocations, hashes and counts.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from vmemkv.cache.config import CacheConfig, CacheStats
from vmemkv.cache.events import KVEventSink, SavedStateEvents, group_sink, shared_sink
from vmemkv.cache.group import (ChunkedLocalGroup, FullAttentionGroup, KVCacheGroup, MLALatentGroup,
                                RecurrentStateGroup, SavedBlock, SlidingWindowGroup)
from vmemkv.cache.kv_spec import (ChunkedLocalSpec, FullAttentionSpec, KVCacheSpec, MLALatentSpec,
                                  RecurrentStateSpec, SlidingWindowSpec, is_state, layer_specs,
                                  spec_of_config)
from vmemkv.cache.layer_groups import LayerGroups, group_configs
from vmemkv.cache.memory import KVMemory
from vmemkv.cache.metrics import KVMetricsCollector
from vmemkv.cache.refusal import Refusal
from vmemkv.cache.request import KVRequest
from vmemkv.errors import ConfigError, InvalidInputError
from vmemkv.memory.budget import SharedKVBudget
from vmemkv.memory.vmm import device_granularity
from vmemkv.memory.vmm.base import VirtualMemoryBackend


# The group class of each kind of KV memory (vLLM's ``spec_manager_map``): a new kind registers
# its spec type and group class here, once.
GROUP_CLASSES: dict[type[KVCacheSpec], type[KVCacheGroup]] = {
    FullAttentionSpec: FullAttentionGroup,
    MLALatentSpec: MLALatentGroup,
    SlidingWindowSpec: SlidingWindowGroup,
    ChunkedLocalSpec: ChunkedLocalGroup,
    RecurrentStateSpec: RecurrentStateGroup,
}


def group_class(spec: KVCacheSpec) -> type[KVCacheGroup]:
    """The group class serving ``spec``'s kind."""
    try:
        return GROUP_CLASSES[type(spec)]
    except KeyError:
        raise ConfigError(f"no layer group serves {type(spec).__name__}; register its group class "
                          f"in coordinator.GROUP_CLASSES (kinds served: "
                          f"{', '.join(kind.__name__ for kind in GROUP_CLASSES)})") from None


class KVCacheCoordinator:
    """``KVCacheCoordinator(config, stats, backend, metrics, events, *, layer_windows,
    chunk_tokens, local_blocks, backends)``: the groups and memories of ``config`` (the arguments
    as ``KVCacheManager``'s), counting into ``stats``."""

    def __init__(self, config: CacheConfig, stats: CacheStats, backend: VirtualMemoryBackend | None,
                 metrics: KVMetricsCollector | None, events: KVEventSink | None, *,
                 layer_windows: "Sequence[int | KVCacheSpec | None] | None" = None,
                 chunk_tokens: int | None = None, local_blocks: int | None = None,
                 backends: Sequence[VirtualMemoryBackend | None] | None = None):
        self.config, self.stats, self.events = config, stats, events
        self.last_refusal: Refusal | None = None  # why the last refused call was refused
        layers, configs = self._group_layers(config, layer_windows, chunk_tokens, local_blocks)
        for (_, spec), group_config in zip(layers, configs):  # refused before any memory is made
            group_class(spec).check_config(group_config, spec)
        if config.cold_tier != "off" and (len(layers) != 1 or not issubclass(group_class(layers[0][1]),
                                                                               FullAttentionGroup)):
            kinds = ", ".join(spec.describe() for _, spec in layers)
            raise ConfigError(f"the cold tier (CacheConfig.cold_tier {config.cold_tier!r}) keeps the "
                              f"blocks of one group of full-attention or MLA layers; this cache has "
                              f"{len(layers)} group(s): {kinds}. Set cold_tier='off'")
        # each memory with the indices of the groups drawing from it, for the steps over memories
        self._members = tuple((memory, tuple(indices)) for memory, indices in self._memories(
            configs, [spec for _, spec in layers], local_blocks is None, backend, backends, metrics))
        self.memories = tuple(memory for memory, _ in self._members)
        memory_of = {index: memory for memory, indices in self._members for index in indices}
        self.groups = tuple(group_class(spec)(index, group_config, group_layers, spec, memory_of[index])
                            for index, ((group_layers, spec), group_config)
                            in enumerate(zip(layers, configs)))
        for group in self.groups:  # every mapper's views exist now: the references are the manager's
            group.slots.count_own_references()
        self.first = self.groups[0]  # the full-attention group if any: block counts are its
        self.tokens_per_page = self.first.tokens_per_page
        self.releases = any(group.spec.releases for group in self.groups)
        self.has_state = any(group.holds_state for group in self.groups)
        # prompt positions between saved states (0: none): chunks end there (aligned_chunk_end)
        self.state_interval = self.state_cache_interval(config, self.tokens_per_page) if self.has_state else 0
        for group in self.groups:
            if group.holds_state:
                group.save_every = self.state_interval // self.tokens_per_page
        self._where: dict[int, list[tuple[KVCacheGroup, int]]] = {}  # model layer -> (group, index)s
        for group in self.groups:
            for index, layer in enumerate(group.layers):
                self._where.setdefault(layer, []).append((group, index))

    @staticmethod
    def _group_layers(config: CacheConfig, layer_windows, chunk_tokens, local_blocks):
        """``([(layers, spec)] per group, [CacheConfig] per group)``: one group of every layer by
        ``config``'s window or chunks, or the groups of ``layer_windows`` (each layer's window,
        its ``KVCacheSpec``, or None: full attention)."""
        if layer_windows is None:
            spec = spec_of_config(config)
            return [(tuple(range(config.num_layers)), spec)], [config]
        if len(layer_windows) != config.num_layers:
            raise ConfigError(f"layer_windows has {len(layer_windows)} entries for "
                              f"{config.num_layers} layers")
        if config.sliding_window or config.attention_chunk_size:
            raise ConfigError("give windows or chunks per layer (layer_windows) or for every layer "
                              "(CacheConfig.sliding_window or attention_chunk_size), not both")
        # a layer is in the group of its attention kind, of its state kind, both, or none
        attention_specs, state_specs = zip(*map(layer_specs, layer_windows))
        attention = [i for i, spec in enumerate(attention_specs) if spec is not None]
        if len(attention) == len(layer_windows) and not any(state_specs):
            groups = LayerGroups.from_windows(layer_windows)
            return list(zip(groups.layers, groups.specs)), group_configs(config, groups, chunk_tokens,
                                                                         local_blocks)
        if not attention:
            raise ConfigError("every layer keeps a recurrent state or no memory; a model needs at "
                              "least one attention layer here (give its layers' specs in layer_windows)")
        # the attention layers' groups over the blocks of config (of those layers), then one
        # group per kind of state, after them (group 0 grows with a request)
        kv_config = dataclasses.replace(config, num_layers=len(attention))
        groups = LayerGroups.from_windows([attention_specs[i] for i in attention])
        layers = [(tuple(attention[i] for i in group_layers), spec)
                  for group_layers, spec in zip(groups.layers, groups.specs)]
        configs = group_configs(kv_config, groups, chunk_tokens, local_blocks)
        page_size = config.page_granularity or device_granularity(config.device)
        # as many saved states as running ones: saving doubles the state's memory at most
        saved = config.max_num_seqs if KVCacheCoordinator.state_cache_interval(
            config, configs[0].make_layout().tokens_per_page) else 0
        for spec in dict.fromkeys(filter(None, state_specs)):
            state_layers = tuple(i for i, layer_spec in enumerate(state_specs) if layer_spec == spec)
            layers.append((state_layers, spec))
            configs.append(RecurrentStateGroup.state_config(config, spec, len(state_layers), page_size,
                                                            saved))
        if config.host_cache_bytes:  # the host tier mirrors the device pools: shares by their bytes
            device = [c.num_blocks * c.make_layout().block_bytes for c in configs]
            configs = [dataclasses.replace(c, host_cache_bytes=config.host_cache_bytes * d // sum(device))
                       for c, d in zip(configs, device)]
        return layers, configs

    @staticmethod
    def state_cache_interval(config: CacheConfig, tokens_per_page: int) -> int:
        """``config.state_cache_interval`` checked (``ConfigError``), its default resolved (4
        pages of ``tokens_per_page`` tokens); 0 without prefix caching."""
        interval = config.state_cache_interval
        if interval is None:
            interval = 4 * tokens_per_page
        if type(interval) is not int or interval < 0 or interval % tokens_per_page:
            raise ConfigError(f"CacheConfig.state_cache_interval is {interval!r}; give a multiple of "
                              f"the {tokens_per_page} tokens per page (or 0: no saved states)")
        return interval if config.enable_prefix_caching else 0

    def _memories(self, configs: list[CacheConfig], specs: list[KVCacheSpec], share: bool,
                  backend, backends, metrics) -> list[tuple[KVMemory, list[int]]]:
        """The memories behind the groups, each with the indices of the groups it serves: one for
        all groups of one block layout when ``share`` (no fixed ``local_blocks``), holding the
        blocks of all of them; else one each. ``backends``: one per memory (a list), or a callable
        making one from a memory's config; ``backend``: the first memory's."""
        layouts: dict = {}  # layout -> group indices
        for index, group_config in enumerate(configs):
            layout = group_config.make_layout()
            # a state group keeps a memory of its own (its events tell whole saved states)
            layouts.setdefault(layout if share and not is_state(specs[index]) else index, []).append(index)
        memories = []
        self.budget = self._join_budget(max(c.make_layout().block_bytes for c in configs))
        try:  # a refused construction leaves the budget as it was
            for position, indices in enumerate(layouts.values()):
                memory_config = configs[indices[0]]
                if len(indices) > 1:  # the bytes of every member's blocks, in one pool
                    memory_config = dataclasses.replace(
                        memory_config, num_blocks=sum(configs[i].num_blocks for i in indices),
                        swap_space_bytes=sum(configs[i].swap_space_bytes for i in indices),
                        host_cache_bytes=sum(configs[i].host_cache_bytes for i in indices),
                        # a memory serving a releasing kind names it: a backend made from this
                        # config then keeps the page behind released positions (backend_pages)
                        **next((specs[i].config_fields() for i in indices if specs[i].releases),
                               specs[indices[0]].config_fields()))
                if callable(backends):
                    memory_backend = backends(memory_config)
                elif backends is not None:
                    if len(backends) != len(layouts):
                        raise ConfigError(f"{len(backends)} backends for {len(layouts)} memories of "
                                          "layer groups")
                    memory_backend = backends[position]
                else:
                    memory_backend = backend if position == 0 else None
                sink = self._sink([(i, specs[i]) for i in indices], len(configs),
                                  configs[0].make_layout().tokens_per_page, memory_config.max_model_len)
                memories.append((KVMemory(memory_config, self.stats, memory_backend, sink, metrics,
                                          self.budget), indices))
        except BaseException:
            if self.budget is not None:
                self.budget.close()
            raise
        return memories

    def _join_budget(self, block_bytes: int) -> SharedKVBudget | None:
        """The shared KV budget ``config.kv_pool``, if any, refused if it cannot pay for one
        block (``block_bytes`` of every rank's pages)."""
        config = self.config
        if config.kv_pool is None:
            return None
        ranks = config.kv_pool_ranks
        if type(ranks) is not int or ranks < 1:
            raise ConfigError(f"kv_pool_ranks must be a positive int, got {ranks!r}")
        return SharedKVBudget(config.kv_pool, config.kv_pool_bytes, block_bytes=block_bytes * ranks)

    def _sink(self, members: list[tuple[int, KVCacheSpec]], num_groups: int, tokens_per_page: int,
              state_blocks: int):
        """The events sink of a memory serving ``members`` (group index, spec): the manager's own
        for a one-group model, each event tagged with its group otherwise (a state group's
        telling whole saved states of ``state_blocks`` blocks, after prompt blocks of
        ``tokens_per_page`` tokens)."""
        if num_groups == 1:
            return self.events
        if len(members) == 1:
            index, spec = members[0]
            sink = group_sink(self.events, index, spec)
            if sink is not None and is_state(spec):  # whole saved states, by their chain hash
                return SavedStateEvents(sink, tokens_per_page, state_blocks)
            return sink
        return shared_sink(self.events, members)

    def refuse_state(self, operation: str) -> None:
        """Refuse (``ConfigError``) an operation recurrent state does not support (a state is
        not rewound to an earlier position), before any change."""
        if self.has_state:
            raise ConfigError(f"{operation} is not supported with recurrent state layers (a "
                              "state cannot be rewound); use n > 1 sampling (fork), not "
                              f"{operation}, for these models")

    def save_states(self, allocations, done: int, hashes: list[bytes], token_ids: list[int]) -> None:
        """Save every state group's state of a request (its ``allocations``) computed up to
        ``done`` tokens, when ``done`` is a save position (``hashes``: its chain up to there;
        ``token_ids``: its tokens, which the saved state's event names)."""
        if self.state_interval and done % self.state_interval == 0:
            last = done // self.tokens_per_page - 1
            block = SavedBlock(hashes[last], hashes[last - 1] if last else None,
                               token_ids[last * self.tokens_per_page:done])
            for group, alloc in zip(self.groups, allocations):
                if group.holds_state:
                    group.save_state(alloc, block)

    def aligned_chunk_end(self, computed: int, end: int, num_tokens: int) -> int:
        """Where a chunk of a request's computation from ``computed`` to at most ``end`` of its
        ``num_tokens`` tokens ends: at the last save position up to ``end`` before its last
        token, if past ``computed``, so a state is saved there (the last one before a prompt's
        end: the one a repeat of the prompt hits); else at ``end``."""
        if not self.state_interval:
            return end
        position = min(end, num_tokens - 1) // self.state_interval * self.state_interval
        return position if position > computed else end

    # --- layers and slots --------------------------------------------------------------------------
    def where(self, layer: int, state: bool = False) -> tuple[KVCacheGroup, int]:
        """The group holding model layer ``layer`` (checked) and the layer's index in it; of a
        layer in two groups (attention and a state), its state group's when ``state``."""
        if layer not in self._where:
            raise InvalidInputError(f"layer {layer} holds no memory (it is in no layer group); "
                                    f"pass one of layers {sorted(self._where)}")
        places = self._where[layer]
        return next((place for place in places if place[0].holds_state == state), places[0])

    def slot_available(self, slot: int | None) -> bool:
        slots = self.first.slots
        return slots.num_free > 0 if slot is None else slots.is_free(slot)

    def refused(self, operation: str, req: KVRequest | str, slot: int | None, needs: list[int],
                 revived: "list[list[int]] | None" = None) -> None:
        """Record in ``last_refusal`` why ``operation`` was refused, the slot (``slot``, or any)
        or the fresh blocks (``needs[g]`` for group ``g``, beside the cached ``revived[g]``) not
        being there; returns None. Called only once the call is refused, so it costs the
        calls that succeed nothing."""
        if not self.slot_available(slot):
            self.last_refusal = Refusal(operation, req if isinstance(req, str) else req.request_id,
                                        "no_free_slot" if slot is None else "slot_taken", slot)
            return None
        return self.short_of_blocks(operation, req, slot, needs, revived)

    def short_of_blocks(self, operation: str, req: KVRequest | str, slot: int | None, needs: list[int],
                         revived: "list[list[int]] | None" = None) -> None:
        """``refused`` for a call refused by the blocks: the first pool short of them."""
        request_id = req if isinstance(req, str) else req.request_id
        counts = [(members, sum(needs[g] for g in members),
                   memory.available_besides([b for g in members for b in revived[g]] if revived else ()))
                  for memory, members in self._members]
        members, needed, available = next((count for count in counts if count[1] > count[2]), counts[0])
        group = None if len(self.groups) == 1 else " and ".join(
            f"the {self.groups[g].spec.describe()} layers" for g in members)
        self.last_refusal = Refusal(operation, request_id, "out_of_blocks", slot, needed, available, group)
        return None

    # --- the memories' blocks over every group ------------------------------------------------------
    def fits(self, needs: list[int], revived: "list[list[int]] | None" = None) -> bool:
        """Whether every memory has the fresh blocks its groups need (``needs[g]`` for group
        ``g``) once the cached blocks of ``revived[g]`` (hits leaving the free queue) are not free."""
        wants = [(memory, needs[members[0]] if len(members) == 1 else sum(needs[g] for g in members),
                  () if revived is None else [b for g in members for b in revived[g]])
                 for memory, members in self._members]
        if self.budget is None or len(wants) == 1:
            return all(memory.fits(needed, kept) for memory, needed, kept in wants)
        # One budget, several memories: each grows its share leaving what the later ones need.
        shortfalls = [memory.budget_shortfall(needed, kept) for memory, needed, kept in wants]
        return all(memory.fits(needed, kept, spare=sum(shortfalls[i + 1:]))
                   for i, (memory, needed, kept) in enumerate(wants))

    def peek(self, needs: list[int], exclude: "list[list[int]] | None" = None) -> list[list[int]]:
        """The fresh blocks each group's part of an operation takes (``needs[g]`` of them for
        group ``g``), as its memory will hand them out in one take after every group took its
        shared references (``exclude[g]``: cached hits those references take out of the queue)."""
        fresh: list[list[int]] = [[]] * len(needs)  # replaced, never appended to
        for memory, members in self._members:
            total = needs[members[0]] if len(members) == 1 else sum(needs[g] for g in members)
            if not total:
                continue
            kept = () if exclude is None else [b for g in members for b in exclude[g]]
            blocks = memory.pool.peek(total, exclude=kept)
            if len(members) == 1:
                fresh[members[0]] = blocks
                continue
            for g in members:
                fresh[g], blocks = blocks[:needs[g]], blocks[needs[g]:]
        return fresh

    def take(self, fresh: list[list[int]]) -> None:
        """Take the blocks ``peek`` planned, one call for each memory, in its groups' order."""
        for memory, members in self._members:
            planned = fresh[members[0]] if len(members) == 1 else [b for g in members for b in fresh[g]]
            if planned:
                memory.pool.take(planned)

    def copy(self, copies: list[list[tuple[int, int]]]) -> None:
        """Make each group's block copies ``copies[g]`` (source, copy), one call for each memory."""
        for memory, members in self._members:
            pairs = copies[members[0]] if len(members) == 1 else [p for g in members for p in copies[g]]
            memory.copy_blocks(pairs)
        for group, group_copies in zip(self.groups, copies):
            group.blocks_copied += len(group_copies)

    # --- prefix hits over every group ------------------------------------------------------------
    def common_hits(self, hashes: list[bytes], hits: list[list[int]], length: int) -> list[list[int]]:
        """Every group's ``hits`` of ``hashes`` cut to the longest prefix of at most ``length``
        blocks that every group can reuse (a windowed group's hit within a shorter prefix starts
        its window earlier, so it may be shorter again: repeated until they agree)."""
        groups = self.groups
        while True:
            hits = [group.capped_hits(hashes, group_hits, length) for group, group_hits in zip(groups, hits)]
            lengths = [group.hit_length(group_hits) for group, group_hits in zip(groups, hits)]
            shortest = min(lengths)
            if all(length == shortest for length in lengths):
                return hits
            length = shortest

    def cached_hits(self, hashes: list[bytes], num_tokens: int, lossy: bool = False) -> list[list[int]]:
        """Each group's cached blocks of the longest prefix of ``hashes`` every group can reuse,
        leaving at least one of ``num_tokens`` tokens to compute (``lossy``: lossy blocks count)."""
        hashes = hashes[: (num_tokens - 1) // self.tokens_per_page]
        hits, length = [], len(hashes)
        for group in self.groups:  # a later group looks only as far as the earlier ones hit
            hits.append(group.cached_blocks(hashes if length == len(hashes) else hashes[:length], lossy))
            length = min(length, group.hit_length(hits[-1]))
        if all(group.hit_length(group_hits) == length for group, group_hits in zip(self.groups, hits)):
            return hits
        return self.common_hits(hashes, hits, length)

    def host_reach(self, hashes: list[bytes], num_prompt: int, hits: list[list[int]],
                   num_new_tokens: int | None, token_budget: int | None,
                   max_blocks: int | None, lossy: bool = False) -> tuple[list[list[int]], int]:
        """How many prompt blocks an admission of a prompt of ``num_prompt`` tokens and block
        ``hashes`` reuses, and each group's device hits for it: the device ``hits`` (one length
        in every group), extended by the blocks every group's host tier holds after them, as
        many as every group's free blocks take (each is copied into a fresh block; under a token
        budget, chunked prefill, a shorter hit may need fewer blocks now); ``lossy``: the cold
        tiers' blocks count too. No side effect."""
        if self.has_state:
            return self._state_host_reach(hashes, num_prompt, hits, num_new_tokens, token_budget, max_blocks)
        groups, device = self.groups, len(hits[0])
        if not all(group.host_tier.capacity or (lossy and group.cold_tier.capacity) for group in groups):
            return hits, device
        tokens_per_page = self.tokens_per_page
        end = (num_prompt - 1) // tokens_per_page
        if max_blocks is not None:
            end = min(end, max_blocks)
        candidates = hashes[device:end]
        run = min(group.host_run(candidates, lossy) for group in groups)
        for keep in range(run, 0, -1):
            cached = (device + keep) * tokens_per_page
            new = num_prompt - cached if num_new_tokens is None else num_new_tokens
            if token_budget is not None:
                new = min(new, token_budget)
            if self.fits([group.admit_needs(group_hits, cached + new) for group, group_hits in zip(groups, hits)],
                          hits):
                return hits, device + keep
        return hits, device

    def admissions(self, hashes: list[bytes], num_prompt: int, hits: list[list[int]],
                   num_new_tokens: int | None, token_budget: int | None,
                   max_blocks: int | None, lossy: bool = False) -> list:
        """Each group's ``Admission`` of a prompt of ``num_prompt`` tokens and block ``hashes``:
        its device ``hits`` (one length in every group) extended by the host tiers
        (``host_reach``), reserving ``num_new_tokens`` (default: the rest of the prompt; at most
        ``token_budget``, a prefill chunk then ending where a state is saved). What ``admit``
        takes and ``can_admit`` asks about, alike. ``lossy``: the cold tiers' blocks count."""
        hits, reach = self.host_reach(hashes, num_prompt, hits, num_new_tokens, token_budget, max_blocks,
                                      lossy)
        host_hits = hashes[len(hits[0]):reach]
        cached = reach * self.tokens_per_page
        new = num_prompt - cached if num_new_tokens is None else num_new_tokens
        if token_budget is not None:
            new = min(new, token_budget)
            if num_new_tokens is None:  # a prefill chunk: ends where a state is saved
                new = self.aligned_chunk_end(cached, cached + new, num_prompt) - cached
        return [group.admission(group_hits, host_hits, cached, cached + new)
                for group, group_hits in zip(self.groups, hits)]

    def admission_fits(self, admissions: list, slot: int | None = None) -> tuple[list[int], list[list[int]], bool]:
        """``(needs, hits, fits)`` of ``admissions``: the fresh blocks each group takes, the hits
        it holds (taken out of the free queue), and whether the slot (``slot``, or any) and
        those blocks are there."""
        needs = [group.admit_needs(admission.hits, admission.num_tokens)
                 for group, admission in zip(self.groups, admissions)]
        hits = [admission.hits for admission in admissions]
        return needs, hits, self.slot_available(slot) and self.fits(needs, hits)

    def _state_host_reach(self, hashes: list[bytes], num_prompt: int, hits: list[list[int]],
                          num_new_tokens: int | None, token_budget: int | None,
                          max_blocks: int | None) -> tuple[list[list[int]], int]:
        """``host_reach`` of a model with state groups beside one attention group (group 0):
        the longest save position up to which the attention group holds every block, on the
        device and then on its host tier, and every state group a saved state, on the device
        or the host; the first such that every memory's free blocks take. Other layouts (two
        attention groups) reuse the device hits only."""
        groups, device = self.groups, len(hits[0])
        attention = groups[0]
        if (sum(not group.holds_state for group in groups) != 1 or not self.state_interval
                or not attention.host_tier.capacity):
            return hits, device
        tokens_per_page, step = self.tokens_per_page, self.state_interval // self.tokens_per_page
        end = (num_prompt - 1) // tokens_per_page
        if max_blocks is not None:
            end = min(end, max_blocks)
        own = attention.cached_blocks(hashes[:end])  # its device blocks, not cut to the states'
        run = len(own) + attention.host_run(hashes[len(own):end])
        for length in range(run // step * step, device, -step):
            saved = [group.saved_at(hashes[length - 1], length) for group in groups[1:]]
            if None in saved:
                continue
            reach = [own[:length], *saved]
            cached = length * tokens_per_page
            new = num_prompt - cached if num_new_tokens is None else num_new_tokens
            if token_budget is not None:
                new = min(new, token_budget)
            if self.fits([group.admit_needs(group_hits, cached + new) for group, group_hits in zip(groups, reach)],
                         reach):
                return reach, length
        return hits, device

    def claim(self, promote: list[list[bytes]]) -> list[list]:
        """Each group's host-tier entries of ``promote[g]``, claimed from its memory's tier in one
        call (nothing evicts them until they are promoted)."""
        claimed: list[list] = [[]] * len(self.groups)  # replaced, never appended to
        if not any(promote):
            return claimed
        for memory in self.memories:
            keys = [key for group in memory.groups for key in promote[group.index]]
            if not keys:
                continue
            entries = memory.claim(keys)
            for group in memory.groups:
                count = len(promote[group.index])
                claimed[group.index], entries = entries[:count], entries[count:]
        return claimed

    # --- registering, invariants, closing -------------------------------------------------------
    def register_full(self, allocations, full: int, token_ids: list[int], hashes: list[bytes],
                      root: bytes | None) -> None:
        """Offer a request's full blocks up to ``full`` (its ``allocations``, one per group) to
        every group's prefix cache."""
        for group, alloc in zip(self.groups, allocations):
            group.register_full(alloc, full, token_ids, hashes, root)

    def check(self, requests: list[KVRequest]) -> None:
        """Assert the invariants of every group's pool and slots and every memory over the
        admitted ``requests``, and that the groups bind the same slots."""
        results = {group.index: group.check([(req.request_id, req.allocations[group.index],
                                              len(req.chain.hashes)) for req in requests])
                   for group in self.groups}
        bound = [slots for slots, _, _ in results.values()]
        assert all(slots == bound[0] for slots in bound), "the groups bind different slots"
        for memory in self.memories:
            memory.check([b for group in memory.groups for b in results[group.index][1]],
                         [row for group in memory.groups for row in results[group.index][2]])
        free = [sorted(group.slots.free_slots()) for group in self.groups]
        assert all(slots == free[0] for slots in free), "the groups have different free slots"

    def views_in_use(self) -> int:
        return sum(group.slots.views_in_use() for group in self.groups)

    def close(self) -> None:
        """Give every group's slots and every memory's pages (and the budget's share) back."""
        for group in self.groups:
            group.slots.close()
        for memory in self.memories:
            memory.backend.close()
        if self.budget is not None:
            self.budget.close()
