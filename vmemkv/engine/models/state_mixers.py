"""The engine's recurrent mixers: LFM2's short convolutions, Qwen3-Next's and Qwen3.5's gated
delta nets, Kimi Linear's delta attention, Granite-4.0-H's, Nemotron-H's and Falcon-H1's Mamba2
layers, run by the model's own code over each sequence's state in the KV cache.

The engine calls the model on one packed batch (``[1, T]``: every sequence's new tokens side by
side); a convolution or a delta rule would run that batch as one sequence. So
:func:`route_state_mixers` gives each such module a forward that splits the packed hidden states
by the step's spans (the attention's ``spans``) and calls the module's own forward once per
sequence (and once for all decoding sequences, as a batch of one token each, their states
gathered from their slots and written back), with a :class:`SlotState` in place of transformers'
cache: the methods the mixer calls
(``get_conv_state``, ``update_conv_state``, ``get_recurrent_state``, ``update_recurrent_state``)
read and write that sequence's slot of the layer's state (``KVCacheManager.state_views``), as
transformers' ``LinearAttentionLayer`` does its own tensors. A sequence with nothing computed yet
starts with no previous state (as a fresh cache); chunked prefill continues from the saved state;
a decode step runs one token. Called outside the engine a module runs its own forward.

:func:`state_specs` gives each layer's ``RecurrentStateSpec`` (None: attention) in the shapes
and dtypes transformers keeps them: the conv window ``[channels, kernel]`` in the model's dtype
(transformers keeps the whole kernel's inputs, the first of them unused), the delta-rule state
``[value heads, key dim, value dim]`` and Mamba2's SSM state ``[heads, head dim, state]`` in
float32.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
import transformers
from torch import nn

from vmemkv.cache.kv_spec import NO_MEMORY, RecurrentStateSpec, StatePart
from vmemkv.engine.core.model_runner import BATCH_KWARG
from vmemkv.engine.models.hf_support import HYBRID_KIND, MEMORYLESS_KINDS, STATE_MODEL_TYPES, text_config
from vmemkv.errors import UnsupportedModelError


def state_specs(config: Any, dtype: torch.dtype) -> list[RecurrentStateSpec | None] | None:
    """Each layer's recurrent state spec (None for an attention layer, ``NO_MEMORY`` for a layer
    that holds nothing: Nemotron-H's MLP layers, ``(None, spec)`` for a layer with both: Falcon-H1's)
    for a model whose mixers the engine routes (``STATE_MODEL_TYPES``); None for any other model."""
    text = text_config(config)
    model_type = getattr(text, "model_type", None)
    if model_type not in STATE_MODEL_TYPES:
        return None
    kind = STATE_MODEL_TYPES[model_type]
    spec = _spec(text, model_type, dtype)
    if kind == HYBRID_KIND:  # each layer in the attention group and the state group
        return [(None, spec) if layer_kind == kind else None for layer_kind in text.layer_types]
    return [spec if layer_kind == kind else NO_MEMORY if layer_kind in MEMORYLESS_KINDS else None
            for layer_kind in text.layer_types]


def _spec(text: Any, model_type: str, dtype: torch.dtype) -> RecurrentStateSpec:
    if model_type == "lfm2":
        return RecurrentStateSpec((StatePart("conv", (text.hidden_size, text.conv_L_cache), dtype),))
    if model_type == "granitemoehybrid":
        return _mamba2_spec(text.mamba_n_heads, text.mamba_d_head, text.mamba_d_state,
                            text.mamba_n_groups, text.mamba_d_conv, dtype,
                            inner=int(text.mamba_expand * text.hidden_size))
    if model_type == "kimi_linear":  # Kimi delta attention: one conv over q, k, v; a state per head
        channels = text.linear_num_heads * text.linear_head_dim
        return RecurrentStateSpec((
            StatePart("conv", (3 * channels, text.linear_conv_kernel_dim), dtype),
            StatePart("recurrent", (text.linear_num_heads, text.linear_head_dim, text.linear_head_dim),
                      torch.float32)))
    if model_type == "falcon_h1":
        return _mamba2_spec(text.mamba_n_heads, text.mamba_d_head, text.mamba_d_state,
                            text.mamba_n_groups, text.mamba_d_conv, dtype,
                            inner=text.mamba_d_ssm or int(text.mamba_expand * text.hidden_size))
    if model_type == "nemotron_h":  # Mamba2 as Granite-4.0-H's, under other config names
        return _mamba2_spec(text.mamba_num_heads, text.mamba_head_dim, text.ssm_state_size,
                            text.n_groups, text.conv_kernel, dtype)
    key_dim = text.linear_key_head_dim * text.linear_num_key_heads  # a gated delta net's (Qwen3-Next, 3.5)
    conv_dim = 2 * key_dim + text.linear_value_head_dim * text.linear_num_value_heads
    return RecurrentStateSpec((
        StatePart("conv", (conv_dim, text.linear_conv_kernel_dim), dtype),
        StatePart("recurrent", (text.linear_num_value_heads, text.linear_key_head_dim,
                                text.linear_value_head_dim), torch.float32)))


def _mamba2_spec(heads: int, head_dim: int, state: int, groups: int, kernel: int,
                 dtype: torch.dtype, inner: int | None = None) -> RecurrentStateSpec:
    """Mamba2's state: a conv window over x (``inner`` channels: heads x head dim unless the
    model says otherwise), B and C; an SSM state per head, in float32."""
    conv_dim = (inner or heads * head_dim) + 2 * groups * state
    return RecurrentStateSpec((StatePart("conv", (conv_dim, kernel), dtype),
                               StatePart("ssm", (heads, head_dim, state), torch.float32)))


def is_state_mixer(module: nn.Module) -> bool:
    """Whether ``module`` is a recurrent mixer the engine routes (LFM2's ``Lfm2ShortConv``,
    Qwen3-Next's and Qwen3.5's gated delta nets, Kimi Linear's delta attention, Granite-4.0-H's,
    Nemotron-H's and Falcon-H1's Mamba2 layers)."""
    return type(module).__name__ in STATE_MIXERS


# the mixer classes routed (Qwen3.5's text model shares Qwen3-Next's gated delta net code)
STATE_MIXERS = ("Lfm2ShortConv", "Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet",
                "GraniteMoeHybridMambaLayer", "NemotronHMamba2Mixer", "FalconH1Mixer",
                "KimiLinearDeltaAttention")


def takes_cache(module_class: type) -> bool:
    """Whether a mixer's forward takes its state as ``cache`` (transformers 5.25's API; older
    versions pass it in another form, which the engine does not fill)."""
    return "cache" in inspect.signature(module_class.forward).parameters


def route_state_mixers(model: nn.Module) -> int:
    """Give every recurrent mixer of ``model`` the per-sequence forward; returns how many.
    Refuses (``UnsupportedModelError``) mixers that do not take their state as ``cache``."""
    modules = [m for m in model.modules() if is_state_mixer(m) and not hasattr(m, "vmemkv_own_forward")]
    for module in modules:
        if not takes_cache(type(module)):
            raise UnsupportedModelError(
                f"transformers {transformers.__version__}'s {type(module).__name__} takes its "
                "state in another form than the `cache` argument the vmemkv engine fills; use "
                "transformers 5.25 or later for this model")
    for module in modules:
        module.vmemkv_own_forward = module.forward
        module.forward = types.MethodType(_state_forward, module)
    return len(modules)


def _state_forward(module: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    attention = kwargs.pop(BATCH_KWARG, None)
    if attention is None:
        return module.vmemkv_own_forward(hidden_states, *args, **kwargs)
    kwargs.pop("cache", None)
    kwargs.pop("attention_mask", None)  # the spans are the sequences: nothing is padding
    views = attention.state_views(module.layer_idx)
    spans = attention.spans
    outputs: list = [None] * len(spans)
    decodes = [i for i, span in enumerate(spans) if span.num_queries == 1 and span.num_cached]
    if len(decodes) > 1:  # one call for every decoding sequence: a batch of one token each
        _decode_batch(module, hidden_states, views, [spans[i] for i in decodes], args, kwargs,
                      outputs, decodes)
    for i, span in enumerate(spans):
        if outputs[i] is None:
            rows = hidden_states[:, span.query_start:span.query_start + span.num_queries]
            state = SlotState([view[span.slot:span.slot + 1] for view in views], fresh=span.num_cached == 0)
            outputs[i] = module.vmemkv_own_forward(rows, *args, cache=state, **kwargs)
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


def _decode_batch(module, hidden_states, views, spans, args, kwargs, outputs, indices) -> None:
    """The module's own forward over the decoding ``spans`` as a batch ``[B, 1, hidden]``, their
    states gathered from their slots and written back after; each output row into ``outputs``
    at its ``indices``."""
    device = hidden_states.device
    slots = torch.tensor([span.slot for span in spans], device=device)
    rows = torch.tensor([span.query_start for span in spans], device=device)
    parts = [view[slots] for view in views]  # gathered copies [B, *shape]
    out = module.vmemkv_own_forward(hidden_states[0, rows].unsqueeze(1), *args,
                                    cache=SlotState(parts, fresh=False), **kwargs)
    for view, part in zip(views, parts):
        view[slots] = part
    for index, row in zip(indices, out):
        outputs[index] = row.unsqueeze(0)


class SlotState:
    """The state of one layer of a batch of sequences as transformers' cache hands it to a mixer
    (the methods ``LinearAttentionLayer`` answers, for state 0): ``parts`` are ``[B, *shape]``,
    the conv window first and then the recurrent state if the layer has one (one sequence: a
    view of its slot, so writes go there; a decode batch: copies, written back by the caller).
    ``fresh``: the sequences have no previous state (nothing computed yet)."""

    def __init__(self, parts: list[torch.Tensor], fresh: bool):
        self.conv = parts[0]
        self.recurrent = parts[1] if len(parts) > 1 else None
        self.fresh = fresh

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.fresh else self.conv

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """The inputs the convolution reads (the saved window, then ``conv_states``); keeps
        the last ``kernel`` of them."""
        kernel = self.conv.shape[-1]
        if self.fresh:  # a prefill: pad a prompt shorter than the kernel, as transformers does
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([self.conv.to(conv_states.dtype), conv_states], dim=-1)
        self.conv.copy_(full[..., -kernel:])
        return full

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.fresh else self.recurrent

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int,
                               state_idx: int = 0, **kwargs) -> torch.Tensor:
        self.recurrent.copy_(recurrent_states)
        return self.recurrent

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """Positions are the engine's: nothing to count."""

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return not self.fresh
