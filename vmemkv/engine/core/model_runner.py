"""Runs a Hugging Face causal LM, its own modelling code unmodified, over the vmemkv cache.

vmemkv registers one attention function with transformers' attention interface. The model is
called on one packed, ragged batch per step (``[1, T]`` tokens, every sequence's new tokens side by
side, with their absolute positions); our function receives each layer's query, key and value
after RoPE and hands them to the step's attention object, which writes K/V into the cache and
attends per sequence. No attention mask is built by transformers: the attention object knows the
spans. A layer's sliding window, logit soft-capping and sinks (``sliding_window``, ``softcap``,
``s_aux``) are passed on to it (``vmemkv.attention.variants``). (The name is deliberately not
registered with transformers' mask interface: an attention implementation the mask code does not
know skips mask preparation entirely, as vLLM's and TGI's do; registered, it would also scan the
position ids for packed sequences on every forward.)
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from vmemkv.errors import UnsupportedModelError
from vmemkv.engine.models.direct_forward import DirectForward, direct_code
from vmemkv.engine.models.hf_support import layer_chunks

ATTENTION_NAME = "vmemkv"
BATCH_KWARG = "vmemkv_attention"
CHUNKS_KWARG = "vmemkv_layer_chunks"  # each layer's attention chunk (hf_support.layer_chunks)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    attention = kwargs.get(BATCH_KWARG)
    if attention is None:
        raise RuntimeError("the vmemkv attention was called without a batch; run the model "
                           "through vmemkv's ModelRunner")
    # Backstop for models check_attention_supported does not know: score changes we don't apply.
    for name in ("sinks", "alibi", "position_bias"):
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(f"{type(module).__name__} passes {name!r} to its attention "
                                        "function, which the vmemkv engine does not apply")
    chunks = kwargs.get(CHUNKS_KWARG)
    variant = {"chunk": chunks[module.layer_idx]} if chunks else {}
    return attention(module.layer_idx, query, key, value, scaling, window=kwargs.get("sliding_window"),
                     softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"), **variant), None


AttentionInterface.register(ATTENTION_NAME, _attention)


class ModelRunner:
    """``direct``: run a model whose code is Llama's, Qwen2/3's or Mistral's by direct calls of its
    modules (``direct_forward.py``; build this runner after every module swap); ``direct_forward``
    says whether it does, or why not."""

    def __init__(self, model: torch.nn.Module, direct: bool = True):
        self.model = model
        self.device = next(model.parameters()).device
        model.set_attn_implementation(ATTENTION_NAME)  # LLMEngine ran check_attention_supported
        # Chunked local layers (Llama-4): transformers passes the chunks only in its mask, which
        # the engine does not build, so the attention is told each layer's chunk.
        chunks = layer_chunks(model.config)
        self._extra = {CHUNKS_KWARG: chunks} if chunks else {}
        code = ("turned off" if not direct else "chunked layers (the attention is told each one's chunk)"
                if chunks else direct_code(model))
        self.direct = None if isinstance(code, str) else DirectForward(model, code)
        self.direct_forward = (f"off: {code}" if self.direct is None
                               else f"on: {code.family}'s code, {len(self.direct.layers)} layers")

    @torch.inference_mode()
    def forward(self, input_ids: list[int], positions: list[int], attention,
                logit_rows: list[int] | None = None) -> torch.Tensor:
        """Logits ``[len(logit_rows), vocab]`` (float32) at the given rows of the packed batch;
        ``logit_rows=None``: every row.

        Token ids, positions and logit rows travel to the device with the attention's index
        tensors, in one host-to-device transfer per layout group (``attention.upload``; pinned memory on
        CUDA, without blocking the host)."""
        inputs = attention.upload(input_ids=input_ids, positions=positions,
                                  logit_rows=[] if logit_rows is None else logit_rows)
        ids = inputs["input_ids"].view(1, -1)
        pos = inputs["positions"].view(1, -1)
        keep = 0 if logit_rows is None else inputs["logit_rows"]  # 0: all rows, no gather
        if self.direct is not None:
            return self.direct(ids, pos, attention, keep)[0].float()
        out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep,
                         **{BATCH_KWARG: attention}, **self._extra)
        return out.logits[0].float()
