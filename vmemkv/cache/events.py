"""KV events: what enters and leaves the prefix cache, for routers and observers.

The block pool emits one event each time its content-hash index changes:

* ``BlockStored``: a block's content hash is newly registered (a full block was computed and no
  other block already held that content). It carries the hash, the parent's hash (None for the
  first block of a prompt), the block's token ids, the block size and the tier (``medium``).
* ``BlockRemoved``: cached blocks were evicted (their hashes are forgotten) to be handed out again.
* ``AllBlocksCleared``: the prefix cache was reset; every hash is forgotten.

A hash registered again after its block was evicted is stored again. Replaying the events in
order therefore rebuilds exactly the set of hashes the pool can hit, and which tokens each holds.

Each event names its tier (``medium``): ``"GPU"`` for the device pool, ``"CPU"`` for the prefix
cache's host tier (``host_tier.py``). A block evicted from the device and copied to the host tier
(demoted) sends ``BlockRemoved(medium="GPU")`` then ``BlockStored(medium="CPU")`` with the same
hash, parent and tokens; a host hit copied back (promoted) sends ``BlockRemoved(medium="CPU")``
then ``BlockStored(medium="GPU")``; a block dropped from the full host tier sends
``BlockRemoved(medium="CPU")``. ``AllBlocksCleared`` clears both tiers. Replaying the events of
one medium rebuilds that tier's hashes; a hash may be in both tiers at once (content computed
again on the device while its demoted copy still waits on the host).

With the lossy cold tier (``cold_tier.py``), lossy copies are told under media of their own:
``"CPU_LOSSY"`` for the compressed blocks in the cold tier, ``"GPU_LOSSY"`` for a device block
decompressed from it or computed after reading such KV (keyed internally with ``LOSSY_SUFFIX``;
``lossy_sink`` tells them under their plain hash). Replaying ``"GPU"`` and ``"CPU"`` still rebuilds
exactly the hashes whose KV equals a recomputation's.

The shapes are vLLM's (``vllm/distributed/kv_events.py``), so routers written for vLLM read them:
``encode_batch`` turns a batch into msgpack-ready arrays, ``[ts, [event, ...]]`` with each event
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``,
``["BlockRemoved", block_hashes, medium]`` or ``["AllBlocksCleared"]`` (msgspec's array-like,
tagged structs). Hashes are the 32-byte digests of ``hashing.py``, sent as msgpack binary.

**Layer groups.** A hybrid model's KV cache (``KVCacheManager`` with ``layer_windows``) keeps its
local (sliding-window, chunked) and global layers in layer groups, each with its own prefix index
(in a pool of its own, or in one pool the groups share: ``shared_sink``), so one content hash may
be cached in one group and not the other. As vLLM's hybrid KV cache does, each group's
``BlockStored`` carries ``group_idx`` (0: global layers, 1: local), ``kv_cache_spec_kind``
(``"full_attention"``, ``"sliding_window"``) and ``kv_cache_spec_sliding_window`` (the window, or
None), and each ``BlockRemoved`` its ``group_idx`` (``group_sink`` tags them). A model with one
group sends them as None, and its encoding is the one above, unchanged. Where set, they follow
vLLM's field order: ``BlockStored`` continues after ``medium`` with ``lora_name``, ``extra_keys``
(both None here), ``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``;
``BlockRemoved`` with ``group_idx``. Replaying the events of one (group, medium) rebuilds that
group's tier.

**Saved recurrent states.** A state group (``RecurrentStateSpec``, ``kv_cache_spec_kind`` ``"mamba"``,
vLLM's name) caches copies of a request's state at block-aligned prompt positions, each in several
pool blocks keyed internally by the chain hash there and the block's index. Its events speak of
whole states, by that chain hash alone (the hash the attention groups' block at that position
has): one ``BlockStored`` when a tier holds a whole saved state (saved on the device, or demoted
to the host tier), with the parent hash and tokens of the prompt block it ends and the model's
tokens per block, and one ``BlockRemoved`` when that tier no longer holds it whole (a block
evicted, dropped or promoted, or a reset). Replaying the state group's events of one medium
rebuilds the positions at which a saved state can be hit from that tier (``SavedStateEvents``).

A sink is any callable taking one event: pass it as ``KVCacheManager(config, events=sink)``. It is
called on the thread that changes the cache, inside the manager's operation, so it must be quick
and must not call back into the manager. ``KVEventBuffer`` is a sink that keeps events until a
caller drains them as one timestamped batch (the engine does so once per step).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from vmemkv.errors import ConfigError
from vmemkv.cache.kv_spec import KVCacheSpec

# The tier a block lives in. vLLM's names: "GPU" is the device's KV pool (whatever the device:
# vmemkv's CPU backend reports its pool as the device tier too); "CPU" is host memory.
MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"
# Lossy copies (the cold tier's, cold_tier.py), media of their own so that replaying the exact
# media still rebuilds exactly the hashes whose KV equals a recomputation's.
LOSSY = "_LOSSY"
MEDIUM_DEVICE_LOSSY = MEDIUM_DEVICE + LOSSY
MEDIUM_COLD = MEDIUM_HOST + LOSSY


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None  # None: the first block of a prompt
    token_ids: list[int]  # the tokens of all the blocks, in order
    block_size: int  # tokens per block
    lora_id: int | None = None  # vmemkv has no adapters yet
    medium: str = MEDIUM_DEVICE
    group_idx: int | None = None  # the layout group (hybrid models only: see the module docstring)
    kv_cache_spec_kind: str | None = None  # "full_attention" or "sliding_window"
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str = MEDIUM_DEVICE
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
KVEventSink = Callable[[KVCacheEvent], None]


@dataclass
class KVEventBatch:
    ts: float  # seconds since the epoch (time.time()) when the batch was taken
    events: list[KVCacheEvent] = field(default_factory=list)


def check_sink(events: object) -> KVEventSink | None:
    """``events`` as a sink, or a clear error when it is not callable."""
    if events is not None and not callable(events):
        raise ConfigError(f"events must be a callable taking one KV event (e.g. a "
                          f"vmemkv.KVEventBuffer) or None; got {type(events).__name__}")
    return events


def group_sink(events: KVEventSink | None, group_idx: int, spec: KVCacheSpec) -> KVEventSink | None:
    """A sink for one layout group's pool and host tier: ``events`` told each of its events with
    the group (``group_idx``, and the kind of its layers, ``spec.event_kind``, and their sliding
    window on ``BlockStored``)."""
    events = check_sink(events)
    if events is None:
        return None
    kind, sliding_window = spec.event_kind, spec.window

    def tell(event: KVCacheEvent) -> None:
        if isinstance(event, BlockStored):
            event = replace(event, group_idx=group_idx, kv_cache_spec_kind=kind,
                            kv_cache_spec_sliding_window=sliding_window)
        elif isinstance(event, BlockRemoved):
            event = replace(event, group_idx=group_idx)
        events(event)

    return tell


HASH_BYTES = 32  # hashing.py's digests; a later group of a shared pool keys its blocks by one byte more
STATE_KEY_INDEX_BYTES = 4  # a saved state's block is keyed by the chain hash and this many bytes of index


# A block whose KV is lossy (decompressed from the cold tier, or computed by a request that read
# such a block) is keyed in the device pool's index by its key and this suffix, so that a request
# demanding exact reuse, which looks up plain keys only, never finds it.
LOSSY_SUFFIX = b"\x00lossy"


def lossy_key(key: bytes) -> bytes:
    return key + LOSSY_SUFFIX


def is_lossy_key(key: bytes | None) -> bool:
    return key is not None and len(key) >= HASH_BYTES + len(LOSSY_SUFFIX) and key.endswith(LOSSY_SUFFIX)


def exact_key(key: bytes) -> bytes:
    """The plain key of a lossy key (any other key unchanged)."""
    return key[:-len(LOSSY_SUFFIX)] if is_lossy_key(key) else key


def lossy_sink(events: KVEventSink | None) -> KVEventSink | None:
    """A sink for a device pool holding lossy blocks beside exact ones: an event's lossy keys go
    to ``events`` as their plain hashes under the lossy medium (``MEDIUM_DEVICE_LOSSY``)."""
    events = check_sink(events)
    if events is None:
        return None

    def tell(event: KVCacheEvent) -> None:
        if isinstance(event, BlockStored) and is_lossy_key(event.block_hashes[0]):
            # one block per event; its parent may be exact (the request read lossy KV from here on)
            events(replace(event, block_hashes=[exact_key(h) for h in event.block_hashes],
                           parent_block_hash=None if event.parent_block_hash is None
                           else exact_key(event.parent_block_hash),
                           medium=event.medium + LOSSY))
        elif isinstance(event, BlockRemoved) and any(map(is_lossy_key, event.block_hashes)):
            exact = [h for h in event.block_hashes if not is_lossy_key(h)]
            if exact:
                events(replace(event, block_hashes=exact))
            events(replace(event, block_hashes=[exact_key(h) for h in event.block_hashes if is_lossy_key(h)],
                           medium=event.medium + LOSSY))
        else:
            events(event)

    return tell


def shared_sink(events: KVEventSink | None, groups: "list[tuple[int, KVCacheSpec]]") -> KVEventSink | None:
    """A sink for one pool shared by several layer groups (``groups``: each one's ``(group_idx,
    spec)``, the first group's blocks keyed by their hash, a later group's by
    its hash and one byte, its ``group_idx``): each event goes to ``events`` once per group it
    concerns, with the plain hashes and tagged as ``group_sink`` tags them (a reset: once for
    every group, as separate pools would tell it)."""
    events = check_sink(events)
    if events is None:
        return None
    sinks = {index: group_sink(events, index, spec) for index, spec in groups}
    first = groups[0][0]

    def split(key: bytes | None) -> tuple[int, bytes | None]:
        if key is not None and len(key) == HASH_BYTES + 1:
            return key[-1], key[:-1]
        return first, key

    def tell(event: KVCacheEvent) -> None:
        if isinstance(event, BlockStored):
            index = split(event.block_hashes[0])[0]  # one group's blocks in one event
            sinks[index](replace(event, block_hashes=[split(h)[1] for h in event.block_hashes],
                                 parent_block_hash=split(event.parent_block_hash)[1]))
        elif isinstance(event, BlockRemoved):
            by_group: dict[int, list[bytes]] = {}
            for key in event.block_hashes:
                index, plain = split(key)
                by_group.setdefault(index, []).append(plain)
            for index, hashes in by_group.items():
                sinks[index](replace(event, block_hashes=hashes))
        else:
            for sink in sinks.values():
                sink(event)

    return tell


class SavedStateEvents:
    """The events sink of a state group's memory: the per-block events of its pool and host tier
    become one event per saved state (see the module docstring): ``BlockStored`` once a medium
    holds every one of its ``blocks_per_state`` blocks, with the tokens and parent its first
    block was registered with; ``BlockRemoved`` when a medium that held it whole loses one.
    ``events``: the sink told them (tagged with the group by ``group_sink``); ``block_size``:
    the model's tokens per block."""

    def __init__(self, events: KVEventSink, block_size: int, blocks_per_state: int):
        self.events, self.block_size, self.blocks_per_state = events, block_size, blocks_per_state
        self._blocks: dict[tuple[str, bytes], int] = {}  # (medium, hash) -> blocks held there
        self._told: set[tuple[str, bytes]] = set()  # the states told stored and not yet removed
        self._origin: dict[bytes, tuple[bytes | None, list[int]]] = {}  # hash -> (parent, tokens)

    def _split(self, key: bytes) -> tuple[bytes, int]:
        cut = len(key) - STATE_KEY_INDEX_BYTES
        return key[:cut], int.from_bytes(key[cut:], "little")

    def __call__(self, event: KVCacheEvent) -> None:
        if isinstance(event, BlockStored):
            for key in event.block_hashes:
                block_hash, index = self._split(key)
                if index == 0:
                    self._origin[block_hash] = (event.parent_block_hash, list(event.token_ids))
                place = (event.medium, block_hash)
                self._blocks[place] = self._blocks.get(place, 0) + 1
                if self._blocks[place] == self.blocks_per_state:
                    self._told.add(place)
                    parent, tokens = self._origin.get(block_hash, (None, []))
                    self.events(BlockStored([block_hash], parent, tokens, self.block_size,
                                            medium=event.medium))
        elif isinstance(event, BlockRemoved):
            gone = []
            for key in event.block_hashes:
                place = (event.medium, self._split(key)[0])
                self._blocks[place] = self._blocks.get(place, 1) - 1
                if not self._blocks[place]:
                    del self._blocks[place]
                if place in self._told:
                    self._told.discard(place)
                    gone.append(place[1])
            if gone:
                self.events(replace(event, block_hashes=gone))
        else:
            self._blocks.clear()
            self._told.clear()
            self.events(event)


class KVEventBuffer:
    """A sink that keeps events in order until ``drain()``. A block stored right after its parent
    joins the parent's ``BlockStored`` (one event per run of blocks, as vLLM sends a prefill).
    Use it from one thread (the one that runs the manager), or guard it yourself."""

    def __init__(self) -> None:
        self._events: list[KVCacheEvent] = []

    def __call__(self, event: KVCacheEvent) -> None:
        last = self._events[-1] if self._events else None
        if (isinstance(event, BlockStored) and isinstance(last, BlockStored)
                and event.parent_block_hash is not None
                and event.parent_block_hash == last.block_hashes[-1]
                and (event.block_size, event.lora_id, event.medium, event.group_idx)
                == (last.block_size, last.lora_id, last.medium, last.group_idx)):
            self._events[-1] = replace(last, block_hashes=last.block_hashes + event.block_hashes,
                                       token_ids=last.token_ids + event.token_ids)
            return
        self._events.append(event)

    def __len__(self) -> int:
        return len(self._events)

    def drain(self, ts: float | None = None) -> KVEventBatch | None:
        """The events since the last drain as one batch (None when there are none)."""
        if not self._events:
            return None
        events, self._events = self._events, []
        return KVEventBatch(time.time() if ts is None else ts, events)


def encode_event(event: KVCacheEvent) -> list:
    """One event as vLLM's array-like msgpack struct (the tag first, then the fields in order)."""
    if isinstance(event, BlockStored):
        fields = ["BlockStored", list(event.block_hashes), event.parent_block_hash,
                  list(event.token_ids), event.block_size, event.lora_id, event.medium]
        if event.group_idx is not None:  # lora_name and extra_keys (None), then the group
            fields += [None, None, event.group_idx, event.kv_cache_spec_kind,
                       event.kv_cache_spec_sliding_window]
        return fields
    if isinstance(event, BlockRemoved):
        fields = ["BlockRemoved", list(event.block_hashes), event.medium]
        return fields if event.group_idx is None else fields + [event.group_idx]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {type(event).__name__}")


def encode_batch(batch: KVEventBatch) -> list:
    """A batch as vLLM's ``KVEventBatch`` array, ``[ts, events]`` (its data-parallel rank left
    out, as msgspec omits a default), ready for ``msgpack.packb``."""
    return [batch.ts, [encode_event(event) for event in batch.events]]


def decode_event(fields: list) -> KVCacheEvent:
    """The inverse of ``encode_event`` (for subscribers and tests)."""
    tag, rest = fields[0], fields[1:]
    if tag == "BlockStored":
        hashes, parent, token_ids, block_size, lora_id, medium = rest[:6]
        group = rest[8:11] if len(rest) > 8 else ()  # past lora_name and extra_keys
        return BlockStored(list(hashes), parent, list(token_ids), block_size, lora_id, medium, *group)
    if tag == "BlockRemoved":
        return BlockRemoved(list(rest[0]), rest[1], *rest[2:3])
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event tag {tag!r}")


def decode_batch(fields: list) -> KVEventBatch:
    return KVEventBatch(fields[0], [decode_event(event) for event in fields[1]])
