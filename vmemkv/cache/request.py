"""A request as the KV cache manager sees it: :class:`KVRequest`, made and owned by the caller.

As vLLM's ``Request`` and nano-vllm's ``Sequence``, one object holds what the manager needs to
know about a request, so no component keeps its own copy in sync by counters:

* ``token_ids``: the caller's list. The caller appends to it (the prompt, then each sampled
  token); the manager reads it where it is and never copies it. Only the manager changes earlier
  entries (``truncate`` shortens it, ``reorder`` replaces its contents), always in place, so the
  caller's reference stays the request's list. Tokens are checked when the manager first reads
  them (at admission, and when a block of them is hashed), not on every append.
* ``keys``: the cache keys (adapter, salt, multimodal content) its block hashes depend on.
* the **block-hash chain**: one hash per full block of ``token_ids`` hashed so far, extended only
  as far as an operation needs (the prompt's full blocks at admission, a filled block at commit)
  and never recomputed: a waiting request retried every step, or re-admitted after a recompute
  preemption, is hashed once.
* the **allocation** (``allocation``, an :class:`vmemkv.cache.allocation.Allocation`): slot, blocks,
  reserved and computed counts, swapped state. Only the manager changes it, through the
  allocation's transitions. With a sliding window (``CacheConfig.sliding_window``) or attention
  chunks (``attention_chunk_size``) the leading blocks that no future query reads are given back
  while the request runs: their entries in the block list become ``RELEASED`` (-1), always a
  leading run of ``num_released_blocks``.
  The caller reads the allocation through the read-only properties below. ``free`` and a recompute
  preemption reset it and keep the hash chain.

A ``KVRequest`` belongs to the first manager that admits it (or is asked to): its hash chain was
made with that manager's hasher, so another manager refuses it. The manager's operations take the
object (no lookup by id); they also accept its ``request_id``, looked up in the manager's registry.
"""

from __future__ import annotations

from vmemkv import validation as check
from vmemkv.cache.allocation import RELEASED, Allocation
from vmemkv.errors import InvalidInputError
from vmemkv.cache.hashing import CacheKeys

__all__ = ["RELEASED", "HashChain", "KVRequest"]


class HashChain:
    """What a manager knows of a request's tokens: the ``keys`` its block hashes depend on, the
    chain ``hashes`` of its leading full blocks hashed so far, how many leading token ids it has
    checked (``num_checked``), and the ``owner`` whose hasher made the chain. A manager reads
    the fields and changes them only through the transitions below."""

    __slots__ = ("keys", "hashes", "num_checked", "owner")

    def __init__(self, keys: CacheKeys):
        self.keys = keys
        self.hashes: list[bytes] = []  # chain hashes of the leading full blocks hashed so far
        self.num_checked = 0  # leading token ids a manager has checked
        self.owner = None  # the manager it belongs to, from its first admission on

    def claim(self, owner) -> None:
        """The chain is ``owner``'s from now on (made, and extended, with its hasher)."""
        self.owner = owner

    def mark_checked(self, num_tokens: int) -> None:
        """The leading ``num_tokens`` token ids are checked."""
        self.num_checked = num_tokens

    def extend(self, hashes: list[bytes]) -> None:
        """``hashes`` continue the chain (the next full blocks')."""
        self.hashes += hashes

    def truncate(self, num_tokens: int, num_full_blocks: int) -> None:
        """The tokens from ``num_tokens`` on are gone: so are the hashes past the first
        ``num_full_blocks`` blocks and the check of those tokens."""
        del self.hashes[num_full_blocks:]
        self.num_checked = min(self.num_checked, num_tokens)

    def copy_from(self, source: "HashChain") -> None:
        """The request's tokens became ``source``'s (a fork child, a beam-search row): so do its
        keys, hashes, checks and owner."""
        self.keys, self.hashes = source.keys, list(source.hashes)
        self.num_checked, self.owner = source.num_checked, source.owner

    def snapshot(self) -> "HashChain":
        """A copy, for a ``copy_from`` after the source itself changed."""
        copy = HashChain(self.keys)
        copy.copy_from(self)
        return copy


class KVRequest:
    """``KVRequest(request_id, token_ids=None, keys=None, exact=False)``: ``token_ids`` is a list
    the request keeps (not a copy) and the caller appends to; ``keys`` defaults to
    ``CacheKeys()``; ``exact``: reuse only exact prefix blocks, never the lossy ones of the cold
    tier (``cold_tier.py``), so its KV is what recomputing would give."""

    # ``chain``, ``allocation`` and ``allocations`` are plain attributes (read on every manager
    # call: no property in the way), the manager's to change through their transitions; never
    # replace them. ``allocations``: one per layer group of the manager (``allocation`` is the
    # first), the same counts in each, each group's own blocks.
    __slots__ = ("_request_id", "_token_ids", "chain", "allocation", "allocations", "exact")

    def __init__(self, request_id: str, token_ids: list[int] | None = None,
                 keys: CacheKeys | None = None, exact: bool = False):
        self._request_id = check.request_id(request_id)
        if type(exact) is not bool:
            raise InvalidInputError(f"exact is {exact!r}; pass True (reuse exact prefix blocks only) "
                                    "or False (the cold tier's lossy blocks too)")
        self.exact = exact
        if token_ids is None:
            token_ids = []
        elif type(token_ids) is not list:
            raise InvalidInputError(
                f"token_ids is a {type(token_ids).__name__}; a KVRequest keeps the list you give it "
                "(you append to it as tokens come), so pass a list, such as list(token_ids)")
        self._token_ids = token_ids
        self.chain = HashChain(CacheKeys() if keys is None else check.cache_keys(keys))
        self.allocation = Allocation()  # reset on free and recompute; the hash chain stays
        self.allocations = [self.allocation]

    def hold_groups(self, num_groups: int) -> None:
        """An allocation for each of ``num_groups`` layer groups (the manager's, when it first
        takes the request)."""
        while len(self.allocations) < num_groups:
            self.allocations.append(Allocation())

    # --- what the caller gave ---------------------------------------------------------------------
    @property
    def request_id(self) -> str:
        return self._request_id

    @property
    def token_ids(self) -> list[int]:
        """The request's token ids: the caller's list itself (append to it; don't edit earlier
        entries, which would make the hash chain stale)."""
        return self._token_ids

    @property
    def keys(self) -> CacheKeys:
        return self.chain.keys

    # --- what the manager keeps (read-only) -------------------------------------------------------
    @property
    def block_hashes(self) -> tuple[bytes, ...]:
        """The chain hashes of the leading full blocks hashed so far."""
        return tuple(self.chain.hashes)

    @property
    def num_tokens(self) -> int:
        """Positions reserved in the KV cache (0 unless admitted)."""
        return self.allocation.num_tokens

    @property
    def num_computed_tokens(self) -> int:
        """Positions whose K/V is written (committed)."""
        return self.allocation.num_computed

    @property
    def slot(self) -> int | None:
        """The slot while running; None otherwise."""
        return self.allocation.slot

    @property
    def block_table(self) -> tuple[int, ...]:
        """The blocks held, in position order (lookahead blocks past the reservation included);
        blocks released behind a sliding window are ``RELEASED`` (-1)."""
        return tuple(self.allocation.blocks)

    @property
    def num_released_blocks(self) -> int:
        """Leading blocks given back behind the sliding window (``RELEASED`` in ``block_table``)."""
        return self.allocation.num_released

    def group_block_table(self, group: int) -> tuple[int, ...]:
        """``block_table`` in the manager's layer group ``group`` (``layout_groups[group]``)."""
        return tuple(self.allocations[group].blocks)

    def group_released_blocks(self, group: int) -> int:
        """``num_released_blocks`` in the manager's layer group ``group``."""
        return self.allocations[group].num_released

    @property
    def is_running(self) -> bool:
        return self.allocation.slot is not None

    @property
    def is_swapped(self) -> bool:
        return self.allocation.swapped is not None

    def __repr__(self) -> str:
        allocation = self.allocation
        state = ("running" if allocation.slot is not None
                 else "swapped" if allocation.swapped is not None else "idle")
        return (f"KVRequest({self._request_id!r}, {len(self._token_ids)} tokens, {state}, "
                f"{allocation.num_computed}/{allocation.num_tokens} computed/reserved, "
                f"{len(self.chain.hashes)} block hashes)")
