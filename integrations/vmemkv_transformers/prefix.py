"""Prefix reuse across ``generate`` calls for a ``VmemkvCache``: admit a prompt mapping the blocks
the prefix cache already holds, compute the rest once per row (:meth:`_PrefixReuse.prefill`) and
run ``model.generate`` on it (:meth:`_PrefixReuse.generate`). A mixin of
:class:`vmemkv_transformers.cache.VmemkvCache`, which provides the rows
(:mod:`.rows`), ``attach``, ``release`` and the model it is hooked to."""

from __future__ import annotations

import inspect

import torch

from vmemkv import ConfigError, InvalidStateError
from vmemkv_transformers.model import cache_kwarg


class _PrefixReuse:
    """``admit_prompt``, ``prefill`` and ``generate`` of a ``VmemkvCache``."""

    def admit_prompt(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
        """Admit one row per prompt of ``input_ids`` (``[batch, length]``), mapping the full blocks
        the prefix cache already holds. Returns the number of leading positions cached in every
        row (``get_seq_length()``): a following ``generate(input_ids, cache=self)`` feeds only the
        rest. Rows that hit more keep their extra blocks and never rewrite them."""
        if self._rows:
            raise InvalidStateError("admit_prompt needs an empty cache; call release() first")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        self._tracked = True
        cached = self._admit(input_ids.tolist(), self._masked_positions(attention_mask, 0, input_ids.shape[1], len(input_ids)),
                             num_new_tokens=0)
        self._length = min(cached)
        return self._length

    def prefill(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                upto: int | None = None) -> None:
        """Compute positions ``[get_seq_length(), upto)`` of the admitted rows in one forward
        (default ``upto``: all but the last token, which ``generate`` computes for the logits)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        upto = input_ids.shape[1] - 1 if upto is None else upto
        start = self._length
        if upto <= start:
            return
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        kwargs = {cache_kwarg(model): self, "use_cache": True}
        if "logits_to_keep" in inspect.signature(model.forward).parameters:
            kwargs["logits_to_keep"] = 1
        with torch.no_grad():
            model(input_ids=input_ids[:, start:upto], attention_mask=attention_mask[:, :upto],
                  position_ids=positions[:, start:upto], **kwargs)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 model=None, keep: bool = False, **generate_kwargs) -> torch.Tensor:
        """``model.generate`` with prefix reuse: release the previous rows, admit ``input_ids``
        (mapping cached prefix blocks), compute the prompt once per row even when ``generate``
        expands rows for beams or ``num_return_sequences`` (the copies are forks sharing the
        blocks), then generate, feeding only uncached tokens. Rows are released at the end unless
        ``keep``; their full blocks stay cached for the next call. ``attention_mask`` defaults to
        all ones and is passed to ``generate`` explicitly, so the blocks are hashed under the mask
        that was really used. Counts go to :attr:`last_call`."""
        model = model if model is not None else self._model
        if model is None:
            raise ConfigError("VmemkvCache.generate needs a model: build the cache with from_model() "
                              "or attach(model), or pass model=")
        if model is not self._model:
            self.attach(model)
        self.release()
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        config = generate_kwargs.get("generation_config") or model.generation_config
        copies = max(generate_kwargs.get("num_beams", getattr(config, "num_beams", 1) or 1),
                     generate_kwargs.get("num_return_sequences", getattr(config, "num_return_sequences", 1) or 1))
        batch, length = input_ids.shape
        try:
            cached = self.admit_prompt(input_ids, attention_mask)
            cached_per_row = [row.kv.num_computed_tokens for row in self._rows]
            if copies > 1:
                self.prefill(model, input_ids, attention_mask)
            generate_kwargs[cache_kwarg(model)] = self
            out = model.generate(input_ids, attention_mask=attention_mask, **generate_kwargs)
        except BaseException:
            self.release()
            raise
        self.last_call = {
            "prompt_tokens": batch * length,
            "cached_tokens": sum(cached_per_row),
            "common_cached_length": cached,
            "computed_prompt_tokens": batch * length - sum(cached_per_row),
            "rows": len(self._rows),
        }
        if not keep:
            self.release()
        return out
