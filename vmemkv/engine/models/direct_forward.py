"""A Llama-family model's forward over the engine's packed batch as direct calls of its own modules.

A decode step of SmolLM2-135M (4 requests, bfloat16, two threads) spends 2-3 of its ~19 ms in the
Python around the modules rather than in them: ``nn.Module.__call__`` for some 400 modules,
transformers' decorators (keyword deprecation, output capture, config defaults, gradient
checkpointing), the hub-kernel routing of each attention's rotary (a ``ContextVar`` set and reset
a call) and the keyword dicts handed down every layer. None of it does anything for the engine's
call: no cache object, no mask, nothing captured, no hooks.

``DirectForward`` runs the same modules' ``forward`` in the same order on the same tensors, so its
logits equal the model's bit for bit. It is a copy of transformers' code, so it runs only where
that code is what the model runs: the bodies of the model's causal-LM, model, decoder-layer,
attention and MLP ``forward`` must be statements this copy was written from (their fingerprints
below, transformers 5.17 and 5.25; a modular copy in another model's file counts; any change, and
the model runs as it is): Llama's (SmolLM2, Helium), and Qwen2's, Qwen3's and Mistral's, whose
attentions pass a sliding window (Qwen3's also norms its queries and keys). Off where any module
has hooks (tensor parallelism sums each rank's partial outputs in forward hooks) and for Llama-4's
chunked layers (the attention is told each layer's chunk).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import textwrap
from typing import Callable

import torch
from torch import nn

from vmemkv.engine.models.native_rotary import kernel_funcs


@dataclasses.dataclass(frozen=True)
class AttentionCode:
    """What an attention ``forward`` this copy follows does beyond Llama's."""

    family: str
    qk_norm: bool  # q_norm / k_norm on each head's query and key before the rotary (Qwen3)
    window: Callable[[nn.Module], int | None]  # the sliding window it passes the attention function


LLAMA = AttentionCode("Llama", False, lambda attention: None)
QWEN2 = AttentionCode("Qwen2", False, lambda attention: attention.sliding_window)
QWEN3 = AttentionCode("Qwen3", True, lambda attention: attention.sliding_window)
MISTRAL = AttentionCode("Mistral", False, lambda attention: getattr(attention.config, "sliding_window", None))

# Per part, the fingerprints (``fingerprint``) of the forward bodies this copy follows, as
# transformers 5.25 and 5.17 (the GPU image's) write them, each the same on Python 3.10-3.13.
# 5.17's differ in names only (``past_key_values`` for ``cache``, whose branch the engine's call
# skips) and in slicing the logits' rows inline (``DirectForward`` slices as both do). One causal
# LM, decoder layer and MLP body serve all four families; the model bodies differ only in the
# masks they build, which the engine's attention does not read.
CAUSAL_LMS = {"28beac74e63845e4", "48b0973c969c5ae2"}
MODELS = {"c420fd66a28c7081", "ce66e0218dc7adbe", "83f46b8e1dc01c30",  # Llama, Qwen2 and Qwen3, Mistral
          "1f1b3fa4cff36bc4", "2b95658a553d4f71", "b2f7b4843861e54b"}  # the same in 5.17
DECODER_LAYERS = {"90bbd346dc9f66e3", "d9b336e9c69c9c55"}
MLPS = {"2b121b3b8f52cfef"}
ATTENTIONS = {"589e2f3afd8e67dc": LLAMA, "a7b7642abadcc99f": QWEN2, "0cd530063f807b66": QWEN3, "bdfd743a3d27c57b": MISTRAL,
              "8e192cb40b1991f8": LLAMA, "5138e9e226da3d34": QWEN2, "9bd44098ae520199": QWEN3, "b26c400e5575b621": MISTRAL}


def fingerprint(function: Callable) -> str:
    """A hash of ``function``'s statements as parsed (its docstring left out): the same for the same
    code whatever the file it is in, the decorators around it or the Python version (fields a newer
    ``ast`` adds empty, and positions, do not count)."""
    source = textwrap.dedent(inspect.getsource(inspect.unwrap(function)))
    body = ast.parse(source).body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return hashlib.sha256(repr(_tree(body)).encode()).hexdigest()[:16]


def _tree(node):
    """A node as nested tuples of its class name and its non-empty fields."""
    if isinstance(node, list):
        return tuple(_tree(item) for item in node)
    if isinstance(node, ast.AST):
        return type(node).__name__, tuple((name, _tree(value)) for name, value in ast.iter_fields(node)
                                          if value is not None and value != [])
    return repr(node)


def _parts(model: nn.Module) -> dict[str, Callable] | str:
    """The class ``forward`` of each part (causal LM, model, decoder layer, attention, MLP), or why the
    model has no such parts."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers) or not hasattr(model, "lm_head"):
        return "not a Llama-style causal LM (model.model.layers, lm_head)"
    kinds = {(type(layer), type(getattr(layer, "self_attn", None)), type(getattr(layer, "mlp", None)))
             for layer in layers}
    if len(kinds) != 1:
        return "its layers are not all of one kind"
    layer, attention, mlp = next(iter(kinds))
    if type(None) in (attention, mlp):
        return "its layers have no self_attn and mlp"
    return {"causal LM": type(model).forward, "model": type(model.model).forward, "decoder layer": layer.forward,
            "attention": attention.forward, "MLP": mlp.forward}


def direct_code(model: nn.Module) -> AttentionCode | str:
    """The attention code of a model ``DirectForward`` computes exactly, else why it does not."""
    parts = _parts(model)
    if isinstance(parts, str):
        return parts
    known = {"causal LM": CAUSAL_LMS, "model": MODELS, "decoder layer": DECODER_LAYERS, "attention": ATTENTIONS,
             "MLP": MLPS}
    prints = {}
    for part, forward in parts.items():
        try:
            prints[part] = fingerprint(forward)
        except (OSError, TypeError, SyntaxError, IndexError):  # no source to read
            prints[part] = None
        if prints[part] not in known[part]:
            return (f"its {part}'s forward is not code this path copies (Llama, Qwen2/3, Mistral in "
                    "transformers 5.17 or 5.25)")
    hooked = [name or "the model" for name, module in model.named_modules()
              if module._forward_hooks or module._forward_pre_hooks]
    if hooked:
        return f"{hooked[0]} has forward hooks, which direct calls would skip"
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        return "global module hooks are registered, which direct calls would skip"
    return ATTENTIONS[prints["attention"]]


def why_not_direct(model: nn.Module) -> str:
    """"" when ``DirectForward`` computes what ``model`` computes, else why not."""
    code = direct_code(model)
    return code if isinstance(code, str) else ""


def _rotary(attention: nn.Module) -> Callable:
    """What the attention's ``apply_rotary_pos_emb(...)`` calls: transformers routes the module-level
    function to the instance's private wrapper (``kernel_funcs``; vmemkv's ``NativeRotary`` where
    swapped) while its forward runs, else it is the function itself."""
    function = inspect.unwrap(type(attention).forward).__globals__["apply_rotary_pos_emb"]
    name = getattr(function, "__name__", None) or getattr(function, "kernel_layer_name", None)
    return kernel_funcs(attention).get(name, function)


def _call(module) -> Callable:
    """A module's ``forward`` (what calling it runs, without hooks), or a plain function itself."""
    return module.forward if isinstance(module, nn.Module) else module


class _Layer:
    """One decoder layer's calls: the decoder-layer, attention and MLP bodies inlined."""

    def __init__(self, layer: nn.Module, code: AttentionCode):
        attention, mlp = layer.self_attn, layer.mlp
        self.index, self.head_dim, self.scaling = attention.layer_idx, attention.head_dim, attention.scaling
        self.window = code.window(attention)
        self.input_norm, self.post_norm = _call(layer.input_layernorm), _call(layer.post_attention_layernorm)
        self.q, self.k, self.v, self.o = (_call(getattr(attention, name))
                                          for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
        self.q_norm, self.k_norm = (_call(attention.q_norm), _call(attention.k_norm)) if code.qk_norm else (None, None)
        self.rotary = _rotary(attention)
        self.gate, self.up, self.down = (_call(getattr(mlp, name)) for name in ("gate_proj", "up_proj", "down_proj"))
        self.act = _call(mlp.act_fn)

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention) -> torch.Tensor:
        residual = hidden
        hidden = self.input_norm(hidden)
        input_shape = hidden.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query, key = self.q(hidden).view(hidden_shape), self.k(hidden).view(hidden_shape)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        value = self.v(hidden).view(hidden_shape).transpose(1, 2)
        query, key = self.rotary(query, key, cos, sin)
        # what model_runner._attention passes these layers: their window; no soft-cap, sinks or chunk
        output = attention(self.index, query, key, value, self.scaling, window=self.window)
        hidden = residual + self.o(output.reshape(*input_shape, -1).contiguous())
        residual = hidden
        hidden = self.post_norm(hidden)
        return residual + self.down(self.act(self.gate(hidden)) * self.up(hidden))


class DirectForward:
    """``model(input_ids=..., position_ids=..., logits_to_keep=...).logits`` for a model whose
    ``direct_code`` is ``code``, with the engine's attention object: its modules captured once (build
    it after every module swap: packing, native norms and rotaries)."""

    def __init__(self, model: nn.Module, code: AttentionCode):
        base = model.model
        self.family = code.family
        self.embed, self.rotary_emb, self.norm = _call(base.embed_tokens), _call(base.rotary_emb), _call(base.norm)
        self.layers = [_Layer(layer, code) for layer in base.layers[: base.config.num_hidden_layers]]
        self.lm_head = _call(model.lm_head)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention,
                 logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        cos, sin = self.rotary_emb(hidden, position_ids=position_ids)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, attention)
        hidden = self.norm(hidden)
        # the rows the causal LM keeps: the last ``logits_to_keep`` (0: all), or those a 1-D tensor names
        rows = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return self.lm_head(hidden[:, rows, :])
