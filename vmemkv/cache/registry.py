"""The manager's requests: :class:`RequestRegistry`.

A request is the caller's :class:`vmemkv.KVRequest` (``request.py``): its token ids, hash chain and
allocations (one per layer group). The registry knows which requests are admitted (running or
swapped out), by id, for callers that name a request by its id and for the invariant check; which
ids were preempted by recompute (to count their re-prefill); and whether the manager is closed. It
resolves what a caller passes (a KVRequest or its id) into the request an operation may work on,
checks request arguments (token ids, lengths, committed positions) and extends a request's hash
chain with the manager's hasher. It changes no pool, slot or group: the manager and its other
parts do, once the registry has said which request they change.
"""

from __future__ import annotations

import functools

from vmemkv import validation as check
from vmemkv.cache.config import CacheConfig
from vmemkv.cache.hashing import CacheKeys, PrefixHasher
from vmemkv.cache.request import KVRequest
from vmemkv.errors import (InvalidInputError, ManagerClosedError, RequestStateError, RequestTooLongError,
                           VmemkvError)


class UnknownRequestError(VmemkvError, KeyError):
    """No request with this id is known to the manager (not admitted: new, freed, or preempted
    by recompute)."""

    def __str__(self) -> str:  # the message as written, not quoted as a KeyError's key
        return str(self.args[0]) if self.args else ""


class WrongRequestStateError(RequestStateError, UnknownRequestError):
    """An admitted request that is not in the state the call needs: ``swap_in`` of a running
    request, ``allocate`` of a swapped-out one. Also an ``UnknownRequestError``, as these were
    before, so code catching that still catches them."""


class RequestRegistry:
    """``RequestRegistry(owner, config, tokens_per_page, num_groups)``: the admitted requests of
    ``owner`` (the manager: a request's hash chain names it), whose requests hold one allocation
    in each of ``num_groups`` layer groups and hash blocks of ``tokens_per_page`` tokens."""

    def __init__(self, owner, config: CacheConfig, tokens_per_page: int, num_groups: int):
        self.owner, self.config = owner, config
        self.tokens_per_page, self.num_groups = tokens_per_page, num_groups
        self.hasher = PrefixHasher(config.hash_algorithm, config.hash_seed)
        self.chain_root = functools.lru_cache(256)(self.hasher.root)  # keys -> root hash, 1 µs saved
        self.requests: dict[str, KVRequest] = {}  # admitted (running or swapped), by id
        self.preempted: set[str] = set()  # recompute-preempted ids, to count their re-prefill
        self.closed = False

    # --- admitted and preempted requests -----------------------------------------------------------
    def add(self, req: KVRequest) -> bool:
        """Register an admitted request; True when it was preempted by recompute (a re-prefill)."""
        request_id = req.request_id
        self.requests[request_id] = req
        if request_id in self.preempted:
            self.preempted.discard(request_id)
            return True
        return False

    def remove(self, request_id: str) -> None:
        """Forget an admitted request (freed), and that it was ever preempted."""
        del self.requests[request_id]
        self.preempted.discard(request_id)

    def mark_preempted(self, request_id: str) -> None:
        self.preempted.add(request_id)

    def forget_preempted(self, request_id: str) -> None:
        self.preempted.discard(request_id)

    def holds(self, request: "KVRequest | str") -> KVRequest | None:
        """The admitted request ``request`` names (this very KVRequest, or the one of this id), or
        None; checks nothing else."""
        if request.__class__ is KVRequest:
            return request if self.requests.get(request.request_id) is request else None
        return self.requests.get(request) if type(request) is str else None

    def running_requests(self) -> list[KVRequest]:
        return [req for req in self.requests.values() if req.allocation.swapped is None]

    # --- resolving what callers pass -----------------------------------------------------------------
    def check_open(self) -> None:
        if self.closed:
            raise ManagerClosedError("this KV cache manager is closed; its memory is gone. "
                                     "Create a new one")

    def running(self, request) -> KVRequest:
        """The running request ``request`` names: a KVRequest (no lookup) or its id."""
        if request.__class__ is KVRequest:
            if request.chain.owner is self.owner and request.allocation.slot is not None and not self.closed:
                return request  # the hot path
        elif type(request) is str:
            req = self.requests.get(request)
            if req is not None and req.allocation.slot is not None and not self.closed:
                return req
        req = self.known(request)
        if req.allocation.swapped is not None:
            raise WrongRequestStateError(f"request {req.request_id!r} is swapped out, not running; "
                                         "swap_in() it first")
        return req

    def running_list(self, requests, what: str) -> list[KVRequest]:
        """A list or tuple of running requests (not a bare string, read letter by letter)."""
        if not isinstance(requests, (list, tuple)):
            example = f", such as [{requests!r}]" if isinstance(requests, (str, KVRequest)) else ""
            raise InvalidInputError(f"{what} is a {type(requests).__name__}; pass a list of "
                                    f"KVRequests or request ids{example}")
        return [self.running(request) for request in requests]

    def known(self, request) -> KVRequest:
        """An admitted (running or swapped) request: a KVRequest of this manager's or an id;
        UnknownRequestError for one that is not admitted, InvalidInputError for anything else."""
        self.check_open()
        if isinstance(request, KVRequest):
            self.check_not_foreign(request)
            if self.requests.get(request.request_id) is not request:
                raise UnknownRequestError(f"request {request.request_id!r} is not admitted (new, "
                                          "freed, or preempted by recompute); admit() it first")
            return request
        if type(request) is not str:
            raise InvalidInputError(f"request is a {type(request).__name__} ({request!r:.40}); pass a "
                                    "vmemkv.KVRequest or its request id (a str)")
        req = self.requests.get(request)
        if req is None:
            raise UnknownRequestError(f"no request {request!r}; admit() it first")
        return req

    def check_not_foreign(self, request: KVRequest) -> None:
        if request.chain.owner is not None and request.chain.owner is not self.owner:
            raise InvalidInputError(
                f"request {request.request_id!r} belongs to another KVCacheManager (its block "
                "hashes were made with that manager's hasher); make a new KVRequest for this one")

    def own(self, req: KVRequest) -> None:
        """``req`` is this manager's from now on: its hash chain is made with this manager's
        hasher, and it has an allocation in every group."""
        req.chain.claim(self.owner)
        req.hold_groups(self.num_groups)

    def admission_request(self, request, token_ids, keys) -> KVRequest:
        """The KVRequest ``admit`` works on: the caller's (its tokens checked), or a new one."""
        if isinstance(request, KVRequest):
            if token_ids is not None or keys is not None:
                raise InvalidInputError(
                    f"admit({request.request_id!r}): a KVRequest carries its own token ids and keys; "
                    "give them when you make it, or admit by id with token_ids")
            self.check_not_foreign(request)
            self.check_tokens(request, len(request.token_ids))
            return request
        request_id = check.request_id(request)
        if token_ids is None:
            raise InvalidInputError(f"admit({request_id!r}) needs token_ids (or admit a KVRequest)")
        token_ids = self.token_ids(token_ids, "token_ids")
        req = KVRequest(request_id, list(token_ids), CacheKeys() if keys is None else keys)
        req.chain.mark_checked(len(token_ids))
        return req

    # --- checking a request's arguments --------------------------------------------------------------
    def token_ids(self, token_ids, what: str) -> list[int]:
        return check.token_ids(token_ids, what, self.config.vocab_size)

    def check_tokens(self, req: KVRequest, end: int) -> None:
        """Check the request's token ids up to ``end`` that were not checked yet (the caller
        appends to the list; each id is checked once, when the manager first reads it)."""
        if end > req.chain.num_checked:
            check.token_ids(req.token_ids[req.chain.num_checked:end],
                            f"request {req.request_id!r}'s token_ids", self.config.vocab_size)
            req.chain.mark_checked(end)

    def check_length(self, request_id: str, num_tokens: int) -> None:
        if num_tokens > self.config.max_model_len:
            raise RequestTooLongError(
                f"request {request_id!r} needs {num_tokens} tokens but max_model_len is "
                f"{self.config.max_model_len}; shorten it or raise max_model_len")

    @staticmethod
    def require_committed(req: KVRequest) -> None:
        if req.allocation.num_computed != req.allocation.num_tokens:
            raise RequestStateError(
                f"request {req.request_id!r} has {req.num_tokens - req.num_computed_tokens} reserved "
                "tokens not yet computed; commit() them first")

    # --- hash chains ---------------------------------------------------------------------------------
    def extend_chain(self, req: KVRequest, num_blocks: int) -> list[bytes]:
        """The request's hash chain, extended to its first ``num_blocks`` full blocks (as far as
        its tokens go): only blocks never hashed are hashed."""
        chain = req.chain
        hashes = chain.hashes
        if num_blocks > len(hashes):
            tokens_per_page = self.tokens_per_page
            if num_blocks * tokens_per_page > chain.num_checked:
                self.check_tokens(req, min(num_blocks * tokens_per_page, len(req.token_ids)))
            chain.extend(self.hasher.block_hashes(req.token_ids, tokens_per_page, chain.keys,
                                                  start_block=len(hashes),
                                                  parent=hashes[-1] if hashes else None,
                                                  end_block=num_blocks))
        return chain.hashes

    def hashes_of(self, token_ids: list[int], keys: CacheKeys) -> list[bytes]:
        """The block hashes of checked ``token_ids`` under ``keys`` (no request)."""
        return self.hasher.block_hashes(token_ids, self.tokens_per_page, check.cache_keys(keys))
