"""The engine's multi-head latent attention (MLA) for DeepSeek-V2/V3, MiniCPM3 and Kimi Linear
models (Kimi Linear's without rotary: its rope part is used as it is).

transformers' MLA modules decompress every cached latent into per-head K and V before calling the
attention function, so the engine would have to hold (or rebuild) the decompressed K/V. Instead
:func:`route_latent_attention` gives each such module a forward that runs the model's own
projections, norm and rotary, writes the step's latent rows ``[c_kv | k_pe]`` into the slots, and
attends in the absorbed form (``vmemkv.attention.latent``): ``q_nope`` projected through ``W_UK``
into the latent space, the output projected back through ``W_UV``, then ``o_proj``. The scale is
the module's own ``scaling`` (``qk_head_dim ** -0.5``, with DeepSeek's YaRN ``mscale`` folded in).
Called outside the engine (no step attention among the arguments) a module runs its own forward.
"""

from __future__ import annotations

import sys
import types

import torch
from torch import nn

from vmemkv.engine.core.model_runner import BATCH_KWARG
from vmemkv.engine.models.hf_support import LATENT_MODEL_TYPES


def is_latent_attention(module: nn.Module) -> bool:
    """Whether ``module`` is the MLA attention module of a model the engine runs from latent rows."""
    return (getattr(getattr(module, "config", None), "model_type", None) in LATENT_MODEL_TYPES
            and hasattr(module, "kv_a_proj_with_mqa") and hasattr(module, "kv_b_proj"))


def route_latent_attention(model: nn.Module) -> int:
    """Give every MLA attention module of ``model`` the latent forward; returns how many. Run it
    before the engine packs the linears: ``kv_b_proj``, whose weight the absorbed form reads
    (and never multiplies by as a layer), stays an ``nn.Linear``."""
    modules = [m for m in model.modules() if is_latent_attention(m) and not hasattr(m, "vmemkv_own_forward")]
    for module in modules:
        module.kv_b_proj.keep_unpacked = True  # packed_linear.pack_linears leaves it
        module.vmemkv_own_forward = module.forward
        module.forward = types.MethodType(_latent_forward, module)
    return len(modules)


def _absorbed_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``W_UK`` ``[heads, nope, rank]`` and ``W_UV`` ``[heads, v, rank]``: views of ``kv_b_proj``'s
    weight ``[heads * (nope + v), rank]``, read at each call (the weight may move: sleep, wake)."""
    weight = module.kv_b_proj.weight.view(module.num_heads, -1, module.kv_lora_rank)
    return weight.split([module.qk_nope_head_dim, module.v_head_dim], dim=1)


def _latent_forward(module: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    attention = kwargs.get(BATCH_KWARG)
    if attention is None:
        return module.vmemkv_own_forward(hidden_states, *args, **kwargs)
    _, num_tokens, _ = hidden_states.shape  # the packed batch: [1, T, hidden]
    if module.q_lora_rank is None:
        q = module.q_proj(hidden_states)
    else:
        q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
    q = q.view(1, num_tokens, module.num_heads, module.qk_head_dim).transpose(1, 2)
    q_nope, q_pe = q.split([module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
    c_kv, k_pe = module.kv_a_proj_with_mqa(hidden_states).split(
        [module.kv_lora_rank, module.qk_rope_head_dim], dim=-1)
    c_kv = module.kv_a_layernorm(c_kv).view(1, 1, num_tokens, module.kv_lora_rank)
    k_pe = k_pe.view(1, 1, num_tokens, module.qk_rope_head_dim)
    if kwargs.get("position_embeddings") is not None:  # (Kimi Linear's MLA has no rotary)
        q_pe, k_pe = _rotary(module, q_pe, k_pe, kwargs["position_embeddings"])
    absorb_k, absorb_v = _absorbed_weights(module)
    q_latent = q_nope @ absorb_k  # [1, H, T, rank]
    out = attention(module.layer_idx, torch.cat([q_latent, q_pe], dim=-1),
                    torch.cat([c_kv, k_pe], dim=-1), module.scaling, module.kv_lora_rank)
    # [1, T, H, rank] -> per head through W_UV: [H, T, v] -> [1, T, H * v]
    out = out[0].transpose(0, 1) @ absorb_v.transpose(1, 2)
    return module.o_proj(out.transpose(0, 1).reshape(1, num_tokens, -1)), None


def _rotary(module: nn.Module, q_pe: torch.Tensor, k_pe: torch.Tensor, position_embeddings):
    """The model's own rotary on the rope parts: DeepSeek-V2's complex frequencies, DeepSeek-V3's
    interleaved or plain cos/sin, MiniCPM3's plain cos/sin."""
    modeling = sys.modules[type(module).__module__]
    if hasattr(modeling, "apply_rotary_emb"):  # DeepSeek-V2
        return modeling.apply_rotary_emb(q_pe, k_pe, position_embeddings.to(q_pe.device))
    cos, sin = position_embeddings
    if getattr(module.config, "rope_interleave", False):
        return modeling.apply_rotary_pos_emb_interleave(q_pe, k_pe, cos, sin)
    return modeling.apply_rotary_pos_emb(q_pe, k_pe, cos, sin)
