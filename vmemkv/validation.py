"""Checks of what callers pass in at the library boundary, done once, before any state changes.

Each check returns the value in the form the manager uses (a plain ``list[int]``, an ``int``) or
raises a vmemkv error whose one-line message says what was asked, the limit, and what to change:
``InvalidInputError`` (a ValueError) for a wrong type or a value out of range, ``ConfigError`` for a
``CacheConfig`` that cannot work, ``ManagerClosedError`` for any call after ``close()``.

Which ``KVCacheManager`` method calls which check (``check`` = ``vmemkv.validation``; ``V`` = the
vocabulary size when the config knows it, else None; every method, queries and properties included,
also starts with the registry's ``check_open()`` (``RequestRegistry``) or ``check.require_open(closed, "<method>")``)::

    __init__                     config(config)
    admit                        request_id(id), token_ids(token_ids, "admit token_ids", V),
                                 count(num_new_tokens, ..., optional=True),
                                 count(token_budget, ..., optional=True), cache_keys(keys),
                                 slot_index(slot, max_num_seqs)
    can_admit, match_prefix      token_ids(token_ids, ..., V), cache_keys(keys)
    allocate                     request_id(id), count(num_new_tokens, ...),
                                 token_ids(new_token_ids, "allocate new_token_ids", V)
    can_allocate, blocks_needed  request_id(id), count(num_new_tokens, ...)
    commit                       request_id(id), count(num_computed_tokens, ..., optional=True)
    truncate                     request_id(id), count(num_tokens, ...)
    allocate_lookahead           request_id_list(request_ids, ...) (then resolve every id before
                                 giving any block), count(margin_tokens, ...), count(keep_free, ...)
                                 (a margin past max_model_len is clamped, not refused)
    fork                         request_id(parent_id), request_id(child_id),
                                 slot_index(slot, max_num_seqs)
    reorder                      request_id_list(request_ids, ...), request_id_list(source_ids, ...)
    preempt                      request_id(id), choice(mode, "preempt mode", PREEMPT_MODES)
                                 (before trimming the lookahead)
    free, swap_in, estimate_preemption, slot_of, num_tokens, num_computed_tokens, block_table,
    token_ids, is_swapped        request_id(id)   (``_running`` can do it for those that use it;
                                 an unknown id is UnknownRequestError, never a bare KeyError)
    kv_views, block_views        layer_index(layer, num_layers); kv_views on kv_backend="paged"
                                 raises ConfigError, not NotImplementedError

For example ``allocate`` starts with::

    request_id, num_new_tokens, new_token_ids = check.request_id(request_id), check.count(
        num_new_tokens, "allocate num_new_tokens"), check.token_ids(new_token_ids, "allocate new_token_ids", V)

Decisions: token ids are ints in ``[0, vocab_size)`` when the vocabulary is known, else in
``[0, 2**63)``; Python ints and numpy integer scalars are accepted, and 1-D integer numpy arrays and
torch tensors; bools (``True``, numpy bool, bool arrays) are refused, as are floats even when
integral (``5.0``): a float id is a caller bug that would otherwise share a cached page with another
prompt. Sizes are ints (numpy ints too), never bools or floats. Request ids are ``str``. Layers and
slots are never negative (no Python-style ``-1`` for the last one). ``dtype`` must be a
``torch.dtype``: a string such as ``"float16"`` is refused with the fix (``torch.float16``), since
spellings like ``"half"``/``"bf16"`` are ambiguous.

Cost: the common case (a list of Python ints, an int size) is one type test per element and a
range test; ``token_ids([5])`` and ``count(1, ...)`` take well under a microsecond.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from vmemkv.cache.config import CacheConfig
from vmemkv.errors import ConfigError, InvalidInputError, ManagerClosedError
from vmemkv.cache.hashing import CacheKeys, MultimodalItem
from vmemkv.memory.quantized_rows import KV_CACHE_DTYPES

TOKEN_ID_LIMIT = 2 ** 63  # ids are hashed as int64
PREEMPT_MODES = ("recompute", "swap", "auto")
LAYOUTS = ("token_major", "per_layer")
KV_BACKENDS = ("vmem", "paged")
HASH_ALGORITHMS = ("sha256", "blake2b")
COLD_TIERS = ("off", "int8", "int4")


def _show(value) -> str:
    """A short one-line repr of a refused value."""
    text = repr(value).replace("\n", " ")
    return (text if len(text) <= 60 else text[:57] + "...") + f" ({type(value).__name__})"


def require_open(closed: bool, call: str) -> None:
    if closed:
        raise ManagerClosedError(f"{call}() was called on a closed KVCacheManager; its memory is "
                                 "released; build a new manager")


def request_id(value, what: str = "request_id") -> str:
    if type(value) is str:
        return value
    raise InvalidInputError(f"{what} is {_show(value)}; request ids are str; pass str(request_id)")


def request_id_list(values, what: str) -> list[str]:
    """A list or tuple of request ids (not a bare string, which would be read letter by letter)."""
    if not isinstance(values, (list, tuple)):
        example = f", such as [{values!r}]" if isinstance(values, str) else ""
        raise InvalidInputError(f"{what} is {_show(values)}; pass a list of request ids{example}")
    for value in values:
        if type(value) is not str:
            request_id(value, f"an entry of {what}")
    return list(values)


def token_ids(ids, what: str, vocab_size: int | None = None) -> list[int]:
    """``ids`` as a plain list of ints, each in ``[0, vocab_size)`` (``[0, 2**63)`` when the
    vocabulary is unknown). A list of ints is returned as it is (not copied), a tuple as a list."""
    limit = TOKEN_ID_LIMIT if vocab_size is None else vocab_size
    if type(ids) is list or type(ids) is tuple:  # the hot path: one test per id
        for t in ids:
            if type(t) is not int or not 0 <= t < limit:
                break
        else:
            return ids if type(ids) is list else list(ids)
    return _token_ids_slow(ids, what, limit, vocab_size)


def _token_ids_slow(ids, what: str, limit: int, vocab_size: int | None) -> list[int]:
    kinds = "a list, tuple or 1-D integer array of token ids"
    if isinstance(ids, torch.Tensor):
        dtype = ids.dtype
        if ids.dim() != 1 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise InvalidInputError(f"{what} is a {ids.dim()}-D {dtype} tensor; pass {kinds}")
        items = ids.tolist()
    elif isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise InvalidInputError(f"{what} is a {ids.ndim}-D {ids.dtype} array; pass {kinds}")
        items = ids.tolist()
    elif isinstance(ids, Sequence) and not isinstance(ids, (str, bytes, bytearray)):
        items = list(ids)
    else:
        raise InvalidInputError(f"{what} is {_show(ids)}; pass {kinds}")
    bound = f"[0, {limit})" if vocab_size is not None else "[0, 2**63)"
    out = []
    for index, t in enumerate(items):
        if type(t) is not int:
            if not isinstance(t, np.integer):  # floats, str, None, bool, numpy bool
                raise InvalidInputError(f"{what}[{index}] is {_show(t)}; token ids are ints in "
                                        f"{bound}; pass integer ids (not floats or strings)")
            t = int(t)
        if not 0 <= t < limit:
            size = f"the vocabulary has {vocab_size} ids" if vocab_size is not None else \
                "ids are hashed as int64"
            raise InvalidInputError(f"{what}[{index}] is {t}; {size}, so token ids must be in "
                                    f"{bound}; pass ids from the model's tokenizer")
        out.append(t)
    return out


def count(n, what: str, minimum: int = 0, maximum: int | None = None, optional: bool = False):
    """A size: an int (numpy ints too, not bool or float) in ``[minimum, maximum]``; None passes
    when ``optional``."""
    if type(n) is not int:
        if n is None and optional:
            return None
        if not isinstance(n, np.integer):
            raise InvalidInputError(f"{what} is {_show(n)}; it must be an int >= {minimum}; "
                                    "pass a whole number" + (" or None" if optional else ""))
        n = int(n)
    if n < minimum or (maximum is not None and n > maximum):
        limit = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise InvalidInputError(f"{what} is {n}, out of range; pass a value {limit}")
    return n


def _index(value, what: str, size: int, thing: str):
    if type(value) is not int:
        if not isinstance(value, np.integer):
            raise InvalidInputError(f"{what} is {_show(value)}; pass an int in [0, {size})")
        value = int(value)
    if not 0 <= value < size:
        raise InvalidInputError(f"{what} is {value}, but there are {size} {thing}; pass an index "
                                f"in [0, {size}) (negative indexing is not supported)")
    return value


def layer_index(layer, num_layers: int, what: str = "layer") -> int:
    if type(layer) is int and 0 <= layer < num_layers:
        return layer
    return _index(layer, what, num_layers, "layers")


def slot_index(slot, num_slots: int, what: str = "slot") -> int | None:
    """A slot in ``[0, num_slots)``, or None (any free slot)."""
    if slot is None or (type(slot) is int and 0 <= slot < num_slots):
        return slot
    return _index(slot, what, num_slots, "slots (max_num_seqs)")


def choice(value, what: str, options: tuple[str, ...]) -> str:
    if isinstance(value, str) and value in options:
        return value
    raise InvalidInputError(f"{what} is {_show(value)}; pass one of {', '.join(map(repr, options))}")


def cache_keys(keys) -> CacheKeys:
    if type(keys) is CacheKeys and not keys.multimodal:
        return keys
    if not isinstance(keys, CacheKeys):
        raise InvalidInputError(f"keys is {_show(keys)}; pass a vmemkv.CacheKeys, such as "
                                "CacheKeys(cache_salt=...)")
    if not isinstance(keys.multimodal, (tuple, list)):
        raise InvalidInputError(f"keys.multimodal is {_show(keys.multimodal)}; pass a tuple of "
                                "vmemkv.MultimodalItem")
    for index, item in enumerate(keys.multimodal):
        what = f"keys.multimodal[{index}]"
        if not isinstance(item, MultimodalItem):
            raise InvalidInputError(f"{what} is {_show(item)}; pass a vmemkv.MultimodalItem")
        count(item.offset, f"{what}.offset")
        count(item.length, f"{what}.length")
        if not isinstance(item.content_hash, (bytes, bytearray)):
            raise InvalidInputError(f"{what}.content_hash is {_show(item.content_hash)}; pass "
                                    "the content's digest as bytes")
    return keys


def config(cfg):
    """Check every field of a ``CacheConfig`` (ConfigError naming the field); returns ``cfg``."""
    if not isinstance(cfg, CacheConfig):
        raise ConfigError(f"config is {_show(cfg)}; pass a vmemkv.CacheConfig")
    try:
        for name in ("num_layers", "num_kv_heads", "head_dim", "num_blocks", "max_num_seqs",
                     "max_model_len", "tokens_per_page"):
            count(getattr(cfg, name), f"CacheConfig.{name}", minimum=1)
        count(cfg.page_size, "CacheConfig.page_size (bytes)", minimum=1, optional=True)
        count(cfg.swap_space_bytes, "CacheConfig.swap_space_bytes", minimum=0)
        count(cfg.host_cache_bytes, "CacheConfig.host_cache_bytes", minimum=0)
        count(cfg.cold_cache_bytes, "CacheConfig.cold_cache_bytes", minimum=0)
        choice(cfg.cold_tier, "CacheConfig.cold_tier", COLD_TIERS)
        choice(cfg.kv_cache_dtype, "CacheConfig.kv_cache_dtype", KV_CACHE_DTYPES)
        count(getattr(cfg, "vocab_size", None), "CacheConfig.vocab_size", minimum=1, optional=True)
        choice(cfg.layout, "CacheConfig.layout", LAYOUTS)
        choice(cfg.kv_backend, "CacheConfig.kv_backend", KV_BACKENDS)
        choice(cfg.hash_algorithm, "CacheConfig.hash_algorithm", HASH_ALGORITHMS)
    except InvalidInputError as error:
        raise ConfigError(str(error)) from None
    if not isinstance(cfg.latent, bool):
        raise ConfigError(f"CacheConfig.latent is {_show(cfg.latent)}; pass True (one MLA latent row "
                          "per token per layer) or False (K and V)")
    if not isinstance(cfg.dtype, torch.dtype):
        fix = f"torch.{cfg.dtype}" if isinstance(cfg.dtype, str) and isinstance(
            getattr(torch, cfg.dtype, None), torch.dtype) else "a torch.dtype such as torch.float16"
        raise ConfigError(f"CacheConfig.dtype is {_show(cfg.dtype)}; pass {fix}")
    if cfg.dtype == torch.bool or cfg.dtype.is_complex:
        raise ConfigError(f"CacheConfig.dtype is {cfg.dtype}; pass the model's KV dtype, such as "
                          "torch.float16 or torch.bfloat16")
    if not isinstance(cfg.device, (str, torch.device)):
        raise ConfigError(f"CacheConfig.device is {_show(cfg.device)}; pass 'cpu', 'cuda' or 'cuda:N'")
    if type(cfg.enable_prefix_caching) is not bool:
        raise ConfigError(f"CacheConfig.enable_prefix_caching is {_show(cfg.enable_prefix_caching)}; "
                          "pass True or False")
    if cfg.hash_seed is not None and not isinstance(cfg.hash_seed, (bytes, bytearray)):
        raise ConfigError(f"CacheConfig.hash_seed is {_show(cfg.hash_seed)}; pass bytes "
                          "(such as b'my-seed') or None for a random seed")
    if cfg.cold_tier != "off" and not (cfg.cold_cache_bytes and cfg.enable_prefix_caching):
        raise ConfigError(f"CacheConfig.cold_tier is {cfg.cold_tier!r} with cold_cache_bytes "
                          f"{cfg.cold_cache_bytes} and enable_prefix_caching {cfg.enable_prefix_caching}; "
                          "the cold tier keeps prefix-cache blocks: give it cold_cache_bytes > 0 "
                          "with prefix caching on, or set cold_tier='off'")
    if cfg.cold_tier == "off" and cfg.cold_cache_bytes:
        raise ConfigError(f"CacheConfig.cold_cache_bytes is {cfg.cold_cache_bytes} with cold_tier "
                          "'off'; choose cold_tier 'int8' or 'int4', or leave cold_cache_bytes 0")
    for name in ("swap_bytes_per_second", "prefill_tokens_per_second"):
        rate = getattr(cfg, name)
        if isinstance(rate, bool) or not isinstance(rate, (int, float, np.number)) or not (
                math.isfinite(rate) and rate > 0):
            raise ConfigError(f"CacheConfig.{name} is {_show(rate)}; pass a positive number "
                              "measured on your machine")
    return cfg
