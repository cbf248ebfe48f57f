"""``VmemkvCache``: a Hugging Face transformers ``Cache`` for ``model.generate()`` on vmemkv.

Each batch row is one :class:`vmemkv.KVCacheManager` request bound to one slot, and the rows of a
batch sit in *consecutive* slots, so the K/V that ``update()`` hands to attention is a strided view
``[batch, kv_heads, length, head_dim]`` of the slot range, narrowed to the tokens written so far:
no copy, no concatenation, never a position past what is mapped. Blocks come from the manager's
reference-counted pool on demand, so

* beam search reorders by **remapping blocks** (``manager.reorder``: full blocks are shared, only a
  partial last block is copied when two beams take it) instead of ``index_select`` over the KV;
* a second ``generate`` whose prompt shares a prefix with an earlier one **reuses those blocks**
  and computes only the rest (:meth:`VmemkvCache.generate`).

Usage::

    from vmemkv_transformers import VmemkvCache

    cache = VmemkvCache.from_model(model, max_batch_size=8, max_cache_len=2048)

    # 1. drop-in cache. transformers 5.24 takes ``cache=``, 5.17 and 4.57 ``past_key_values=``;
    #    ``cache_kwarg(model)`` says which.
    out = model.generate(input_ids, attention_mask=mask, cache=cache, max_new_tokens=64,
                         num_beams=4)              # beam reorders remap blocks
    cache.release()                                # rows freed; full blocks stay in the prefix cache

    # 2. prefix reuse across calls: admits the prompt, maps its cached blocks, computes the rest
    out = cache.generate(input_ids, attention_mask=mask, max_new_tokens=64)
    print(cache.last_call)                         # {'prompt_tokens': .., 'cached_tokens': .., ..}
    cache.close()

How the cache learns token ids
------------------------------
The prefix cache names a block by the chained hash of its token ids, but ``update()`` only sees
K/V. ``from_model`` / ``attach`` install a forward pre-hook on the model that hands the cache the
``input_ids`` and ``attention_mask`` of every forward it takes part in (``generate`` always passes
them). A full block is registered only once its K/V is written, under

* the exact token ids fed to the model at those positions (prompt and generated tokens alike),
* a salt naming the model (``model_key``: a per-model-object random id unless you pass a stable
  name, e.g. the checkpoint and revision), and the row's padding pattern (the positions masked
  out in the prompt), because the same token ids under another mask give other K/V.

Rows whose ids are unknown (a forward with ``inputs_embeds``, a cache used without ``attach``, a
4-D attention mask) get a random salt: their blocks are never found by anyone. A masked position
after admission that the row's salt does not account for raises rather than registering wrong
content. The manager is not thread-safe; one cache runs one ``generate`` at a time.

Multi-head latent attention
---------------------------
DeepSeek-V2/V3 and MiniCPM3 hand ``update()`` their latent, not per-head K/V: the compressed KV
after its norm (``[batch, 1, new, kv_lora_rank]``, as "keys") and the rope'd shared key
(``[batch, 1, new, qk_rope_head_dim]``, as "values"), and decompress what it returns. ``from_model``
gives such a model a latent layout (``CacheConfig.latent``): one row of ``kv_lora_rank +
qk_rope_head_dim`` values per token per layer, whose first part is the "keys" view and the rest
the "values" view, so the cache holds what the engine holds, 576 values per token per layer for
DeepSeek-V3 instead of 128 heads x (192 + 128).

Sliding-window layers
---------------------
``from_model`` gives sliding-window layers O(window) memory: a model whose every layer slides
(Mistral) gets a windowed manager, one mixing local and global layers (Gemma-2/3) a manager with
a layer group per kind, whose local group holds only the local layers. Blocks wholly behind a
row's window go back to the pool as it generates; ``update()`` returns a local layer's K/V from
the window start, and ``get_mask_sizes`` / ``is_sliding`` answer as transformers'
``DynamicSlidingWindowLayer`` does (the last ``window - 1`` positions before the step plus the
new ones, at offset ``max(length - window + 1, 0)``), so the model's own mask lines up. Cropping
(assisted decoding) back behind a released window is refused. ``manager_for(...,
release_behind_window=False)`` keeps every token and lets the mask apply the window. What is
not supported: chunked layers whose chunk is shorter than ``max_cache_len`` (refused with
``UnsupportedModelError``), layers with recurrent state (Mamba / SSM, gated delta net, short
convolution),
``torch.compile`` (the views change every step), offloading, encoder-decoder models.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Self

import torch
from transformers.cache_utils import Cache

from vmemkv import ConfigError, InvalidInputError, InvalidStateError, KVCacheManager, OutOfBlocksError
from vmemkv_transformers.layer import _VmemkvLayer
from vmemkv_transformers.model import cache_kwarg, layer_specs, layer_windows, manager_for
from vmemkv_transformers.prefix import _PrefixReuse
from vmemkv_transformers.rows import _RowBookkeeping, _Row, blocks_free

__all__ = ["VmemkvCache", "cache_kwarg", "layer_windows", "manager_for"]

_HOOK_ATTR = "_vmemkv_token_hook"
_MODEL_KEY_ATTR = "_vmemkv_model_key"


def _observe_tokens(module, args, kwargs):
    """Forward pre-hook: give a VmemkvCache taking part in this forward its input ids and mask."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, VmemkvCache):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache.observe(ids, kwargs.get("attention_mask"))


def _whole_number(value: int | torch.Tensor, what: str) -> int:
    """``value`` as an int: transformers passes some counts as one-element integer tensors."""
    if not isinstance(value, torch.Tensor):
        return value  # ints, and anything the manager's own checks refuse with a clear error
    if value.numel() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
        raise InvalidInputError(f"{what} is a tensor of shape {tuple(value.shape)} and dtype "
                                f"{value.dtype}; pass an int or a one-element integer tensor")
    return int(value.item())


class VmemkvCache(_PrefixReuse, _RowBookkeeping, Cache):
    """A transformers ``Cache`` whose K/V live in a :class:`KVCacheManager`'s slots.

    ``manager`` may be shared by several caches (their rows take disjoint slots, and one cache's
    committed blocks are prefix hits for another with the same ``model_key``). ``model``: install
    the token-id hook on it (see the module docstring); ``model_key``: a stable name for the
    weights, to share prefix blocks across model objects (default: a random id per model object).
    """

    _instances = itertools.count()

    def __init__(self, manager: KVCacheManager, model=None, *,
                 model_key: str | None = None, owns_manager: bool = False):
        self.manager = manager
        self.owns_manager = owns_manager
        self._num_layers = manager.config.num_layers
        self._specs = layer_specs(manager)  # per layer: which positions its queries read
        self._windows = [spec.window for spec in self._specs]  # per layer; None: every token is kept
        self._windowed = any(self._windows)
        super().__init__(layers=[_VmemkvLayer(self, i) for i in range(self._num_layers)])
        self._model = None
        self._model_key = model_key
        self._prefix = f"hf{next(self._instances)}-{uuid.uuid4().hex[:8]}"
        self._request_counter = itertools.count()
        self._rows: list[_Row] = []
        self._first_slot = 0
        self._length = 0  # positions computed in every row
        self._tracked = True  # rows carry real token ids
        self._pending: tuple[torch.Tensor | None, torch.Tensor | None] | None = None
        self._next_layer = 0
        self._step_len = 0
        self._write_from: list[int] = []
        self._uniform_write = True
        self._uncommitted = False  # the last forward's positions are written, not committed yet
        # A latent layout's row is [keys | values]: where it splits (set by the first update)
        self._latent_split: int | None = None
        # Peaks since construction or reset_peak(): blocks (the first layer group's, as the
        # manager's block counts) and bytes of the blocks held (in every group).
        self.peak_pages_in_use = 0
        self.peak_kv_bytes = 0
        self.last_call: dict = {}
        if model is not None:
            self.attach(model)

    # --- construction ----------------------------------------------------------------------------
    @classmethod
    def from_model(cls, model, max_batch_size: int = 8, max_cache_len: int = 2048,
                   num_blocks: int | None = None, *, model_key: str | None = None,
                   **config) -> VmemkvCache:
        """A cache with its own manager shaped for ``model`` (see :func:`manager_for`), hooked
        to ``model``. ``max_batch_size`` counts rows, i.e. ``batch * num_beams``."""
        manager = manager_for(model, max_batch_size, max_cache_len, num_blocks, **config)
        return cls(manager, model, model_key=model_key, owns_manager=True)

    def attach(self, model) -> VmemkvCache:
        """Hook ``model`` so that every forward given this cache tells it its token ids (one hook
        per model, shared by all caches)."""
        if getattr(model, _HOOK_ATTR, None) is None:
            setattr(model, _HOOK_ATTR, model.register_forward_pre_hook(_observe_tokens, with_kwargs=True))
        if self._model_key is None:
            if getattr(model, _MODEL_KEY_ATTR, None) is None:
                setattr(model, _MODEL_KEY_ATTR, uuid.uuid4().hex)
            self._model_key = getattr(model, _MODEL_KEY_ATTR)
        self._model = model
        return self

    def observe(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None) -> None:
        """Tell the cache the token ids (``[batch, new tokens]``) and attention mask of the next
        forward. The hook calls this; call it yourself when driving the model by hand."""
        self._pending = (input_ids, attention_mask)

    # --- what transformers asks ------------------------------------------------------------------
    @property
    def max_batch_size(self) -> int:
        return self.manager.num_slots

    @property
    def max_cache_len(self) -> int:
        return self.manager.config.max_model_len

    @property
    def batch_size(self) -> int:
        return len(self._rows) if self._rows else -1

    @property
    def num_rows(self) -> int:
        """The rows held now (0 before the first forward and after :meth:`release`)."""
        return len(self._rows)

    @property
    def request_ids(self) -> list[str]:
        return [row.kv.request_id for row in self._rows]

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self._length

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_cache_len

    get_max_cache_shape = get_max_length  # transformers < 5.2x

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        """(Key positions the next forward's attention gets, the first one's position): a
        sliding layer's start at its window, as ``DynamicSlidingWindowLayer``."""
        if isinstance(query_length, torch.Tensor):  # transformers 4.x passes cache_position
            query_length = query_length.shape[0]
        offset = self._window_start(layer_idx, self._length)
        return self._length - offset + query_length, offset

    def is_layer_sliding(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` keeps (and hands attention) only its window."""
        return self._windows[layer_idx] is not None

    def _window_start(self, layer_idx: int, length: int) -> int:
        """The first position a sliding layer keeps once ``length`` are computed: the next
        query, at ``length``, reads from there (0 for a layer that keeps every token)."""
        return self._specs[layer_idx].first_read(length)

    def layer_views(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s K and V of all rows, ``[batch, kv_heads, length, head_dim]``
        (a sliding layer's from its window start)."""
        keys, values = self._kv_views(layer_idx)
        rows = slice(self._first_slot, self._first_slot + len(self._rows))
        kept = slice(self._window_start(layer_idx, self._length), self._length)
        return keys[rows, kept].transpose(1, 2), values[rows, kept].transpose(1, 2)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new K/V (``[batch, kv_heads, new, head_dim]``) after the cached positions
        and return views of all positions so far (a sliding layer's from its window start). The
        first layer reserves blocks for the step; the step is committed (full blocks join the
        prefix cache, blocks behind a window are released) by the next call that changes the
        rows, once every layer's attention has read them (``_settle``)."""
        if layer_idx != self._next_layer:
            if layer_idx == 0:
                raise InvalidStateError(
                    f"a previous forward stopped after layer {self._next_layer - 1}, leaving "
                    "reserved positions unwritten; call cache.release() and start again")
            raise InvalidStateError(f"expected layer {self._next_layer}'s update, got layer {layer_idx}'s; "
                                 "VmemkvCache needs every layer updated once per forward, in order")
        if layer_idx == 0:
            self._begin_step(key_states, value_states)
        self._next_layer = layer_idx + 1
        keys, values = self._kv_views(layer_idx)
        first, batch, start = self._first_slot, len(self._rows), self._length
        end = start + self._step_len
        new_keys, new_values = key_states.transpose(1, 2), value_states.transpose(1, 2)
        if self._uniform_write:
            keys[first:first + batch, start:end].copy_(new_keys)
            values[first:first + batch, start:end].copy_(new_values)
        else:  # some rows hit cached blocks past the common length: never write those
            for i, begin in enumerate(self._write_from):
                if begin < end:
                    keys[first + i, begin:end].copy_(new_keys[i, begin - start:])
                    values[first + i, begin:end].copy_(new_values[i, begin - start:])
        if layer_idx == self._num_layers - 1:
            self._end_step()
        rows = slice(first, first + batch)
        read = slice(self._window_start(layer_idx, start), end)  # what get_mask_sizes announced
        return keys[rows, read].transpose(1, 2), values[rows, read].transpose(1, 2)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` becomes a copy of row ``beam_idx[i]``, by remapping blocks."""
        self._settle()
        sources = [int(i) for i in beam_idx.tolist()]
        if sources != list(range(len(self._rows))):
            self._reorder(list(range(len(self._rows))), sources)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._settle()
        if repeats > 1 and self._rows:
            self._repeat_rows(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._settle()
        keep = [int(i) for i in torch.as_tensor(indices).reshape(-1).tolist()]
        if keep == list(range(len(self._rows))):
            return
        if len(keep) > len(self._rows):
            raise ConfigError(f"cannot select {len(keep)} rows out of {len(self._rows)}; "
                              "use batch_repeat_interleave to add rows")
        self._reorder(list(range(len(keep))), keep)
        for row in self._rows[len(keep):]:
            self.manager.free(row.kv)
        del self._rows[len(keep):]

    def crop(self, max_length: int | torch.Tensor) -> None:
        """Drop the last ``-max_length`` positions of every row (transformers 5.2x passes 0 or a
        negative count, 5.17's assisted decoding a 0-d integer tensor; older versions a positive
        final length, also accepted), as assisted and prompt-lookup decoding do with rejected
        candidates. Blocks past the end are released; a shared or cached last block is copied
        before the rows write it again. Every row or none: OutOfBlocksError, changing nothing, when
        the copies find too few free blocks."""
        self._settle()
        max_length = _whole_number(max_length, "crop's max_length")
        length = self._length + max_length if max_length <= 0 else max_length
        if length >= self._length:
            return
        length = max(length, 0)
        if not self.manager.can_truncate([row.kv for row in self._rows], length):
            raise OutOfBlocksError(f"cropping {len(self._rows)} row(s) to {length} positions needs a "
                                   "free block for each shared or cached last block it copies; "
                                   f"{blocks_free(self.manager)}")
        for row in self._rows:
            if not self.manager.truncate(row.kv, length):  # shortens kv.token_ids too
                raise OutOfBlocksError(f"cropping row {row.kv.request_id!r} to {length} positions found "
                                       "no free block although can_truncate said every row fits (rows "
                                       f"before it were cropped); {blocks_free(self.manager)}")
        self._length = length

    def reset(self) -> None:
        """Free every row (same as :meth:`release`)."""
        self.release()

    # --- vmemkv-specific ---------------------------------------------------------------------
    def release(self) -> None:
        """Free every row's request. Full blocks keep their content in the manager's prefix cache
        (LRU) for later prompts; the cache object is ready for another batch."""
        self._settle()
        for row in self._rows:
            self.manager.free(row.kv)
        self._rows = []
        self._length = 0
        self._next_layer = 0
        self._pending = None

    def close(self) -> None:
        """Release the rows and, if this cache built its manager, close it."""
        self.release()
        if self.owns_manager:
            self.manager.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals -------------------------------------------------------------------------------
    def _kv_views(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s K and V over every slot (a latent layout's row split in two)."""
        keys, values = self.manager.kv_views(layer_idx)
        if self._latent_split is None:
            return keys, values
        return keys[..., :self._latent_split], keys[..., self._latent_split:]

    def _check_shapes(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Refuse K/V the manager was not shaped for; a latent layout learns its split here."""
        layout = self.manager.layout
        heads, key_dim = key_states.shape[1], key_states.shape[3]
        device = self.manager.kv_views(0)[0].device
        if layout.latent:  # keys and values are the two parts of one latent row
            gives = f"a latent of {key_dim} + {value_states.shape[3]} values in {heads} head(s)"
            holds = f"latent rows of {layout.head_dim}"
            fits = heads == value_states.shape[1] == 1 and key_dim + value_states.shape[3] == layout.head_dim
        else:
            gives = f"K/V of {heads} heads x {key_dim} dims"
            holds = f"{layout.num_kv_heads} x {layout.head_dim}"
            fits = (heads, key_dim) == (layout.num_kv_heads, layout.head_dim)
        if not fits or (key_states.dtype, key_states.device) != (layout.dtype, device):
            raise ConfigError(
                f"the model gives {gives} in {key_states.dtype} on {key_states.device}; the manager "
                f"holds {holds} in {layout.dtype} on {device}; build it with manager_for(model, ...)")
        if layout.latent:
            self._latent_split = key_dim

    def _begin_step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._settle()
        self._check_shapes(key_states, value_states)
        batch, _, count, _ = key_states.shape
        ids, mask = self._pending or (None, None)
        self._pending = None
        if ids is not None and tuple(ids.shape) != (batch, count):
            raise ConfigError(f"observed input_ids of shape {tuple(ids.shape)} for K/V of {batch} rows "
                              f"x {count} tokens; call observe() with this forward's ids")
        if not self._rows:
            self._tracked = ids is not None
            id_lists = ids.tolist() if ids is not None else [[0] * count for _ in range(batch)]
            self._admit(id_lists, self._masked_positions(mask, 0, count, batch), num_new_tokens=None)
            self._length = 0
        else:
            if batch != len(self._rows):
                if batch % len(self._rows):
                    raise ConfigError(f"the cache holds {len(self._rows)} rows; a forward of {batch} rows "
                                      "is neither that nor a multiple of it")
                self._repeat_rows(batch // len(self._rows))
            if self._tracked:
                if ids is None:
                    raise ConfigError(
                        "this cache records token ids for prefix caching, but a forward came without "
                        "input_ids (inputs_embeds?); attach the model or call observe(ids) first")
                self._check_mask(mask, count)
            self._reserve(count, ids.tolist() if self._tracked else None)
        self._step_len = count
        start = self._length
        self._write_from = [max(start, row.kv.num_computed_tokens) for row in self._rows]
        self._uniform_write = all(w == start for w in self._write_from)

    def _end_step(self) -> None:
        # The commit waits for the next call that changes the rows (_settle): it releases blocks
        # behind each sliding layer's window, and the last layer's attention, which runs after
        # this update returns, still reads this step's window.
        self._uncommitted = True
        self._length += self._step_len
        self._next_layer = 0
        self._note_peak()

    def _settle(self) -> None:
        """Commit the last forward's positions (full blocks join the prefix cache; blocks behind
        a window go back to the pool)."""
        if self._uncommitted:
            for row in self._rows:
                self.manager.commit(row.kv)
            self._uncommitted = False

    def reset_peak(self) -> None:
        self.peak_pages_in_use = self.manager.num_blocks_in_use
        self.peak_kv_bytes = self.manager.kv_bytes_in_use

    @property
    def page_bytes(self) -> int:
        """Bytes of one block (all layers' K and V of ``tokens_per_page`` tokens; with several layer
        groups the first group's, its layers only: ``peak_kv_bytes`` counts every group)."""
        return self.manager.block_bytes

    def __repr__(self) -> str:
        return (f"VmemkvCache(rows={len(self._rows)}, length={self._length}, slots={self._first_slot}.."
                f"{self._first_slot + len(self._rows) - 1}, pages_in_use={self.manager.num_blocks_in_use})")
