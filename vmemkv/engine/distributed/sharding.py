"""One rank's shard of a Hugging Face model, by the model's own tensor-parallel plan.

transformers describes how to split each architecture that supports tensor parallelism
(``config.base_model_tp_plan``: Llama, Qwen2, Mistral, ... split q/k/v and gate/up by columns,
o and down by rows with an all-reduce after them). ``apply_tensor_parallelism`` carries such a plan
out on a model already built (ours are built from a config with seeded random weights, or loaded
whole), on CPU with gloo as on GPUs with NCCL. The embedding and the LM head stay whole, so every
rank computes the full logits and rank 0 samples from its own.

After sharding, the model's config describes the shard: ``num_attention_heads`` and
``num_key_value_heads`` divided by the number of ranks, ``head_dim`` written out. Everything
downstream (the KV layout, the attention choice) then sizes itself for this rank's heads.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from ...errors import ConfigError, UnsupportedModelError
from ...hf_support import kv_shape, text_config


def check_shardable(model_config, size: int) -> None:
    """Refuse, before any process starts, a model that cannot be split ``size`` ways.

    GQA with fewer KV heads than ranks is refused rather than replicated: each rank's cache holds
    whole KV heads of its own, so the heads must divide evenly."""
    text = text_config(model_config)
    if not getattr(text, "base_model_tp_plan", None):
        raise UnsupportedModelError(
            f"tensor_parallel_size={size}: transformers has no tensor-parallel plan for "
            f"{type(text).__name__} (model type {getattr(text, 'model_type', '?')!r}); use a model "
            "with one (Llama, Qwen2, Mistral, ...) or tensor_parallel_size=1")
    _, kv_heads, _ = kv_shape(text)
    heads = text.num_attention_heads
    if kv_heads < size:
        raise ConfigError(
            f"tensor_parallel_size={size} needs at least {size} KV heads, one per rank; the model "
            f"has {kv_heads} (KV heads are not replicated across ranks): use tensor_parallel_size "
            f"<= {kv_heads}")
    for what, count in (("attention heads", heads), ("KV heads", kv_heads),
                        ("intermediate size", getattr(text, "intermediate_size", size))):
        if count % size:
            raise ConfigError(f"tensor_parallel_size={size} must divide the model's {what} "
                              f"({count}); choose a divisor of it")


def shard_model(model: torch.nn.Module, size: int, device_type: str) -> torch.nn.Module:
    """Split ``model`` in place across the default process group (``size`` ranks) by its plan."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    check_shardable(model.config, size)
    text = text_config(model.config)
    _, kv_heads, head_dim = kv_shape(text)
    mesh = dist.init_device_mesh(device_type, (size,))
    apply_tensor_parallelism(model, mesh, _expand_plan(model, text.base_model_tp_plan))
    text.head_dim = head_dim  # kept: no longer hidden_size // num_attention_heads below
    text.num_attention_heads //= size
    text.num_key_value_heads = kv_heads // size
    return model


def _expand_plan(model: torch.nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The plan's patterns (``layers.*.self_attn.q_proj``, relative to the base model) as full
    module names, with each module's own parameters (``.weight``, ``.bias``): the module entry
    installs the forward hooks, the parameter entries shard the tensors."""
    prefix = getattr(model, "base_model_prefix", "model")
    patterns = [(re.compile(rf"(?:{re.escape(prefix)}\.)?"
                            + re.escape(pattern).replace(r"\*", r"\d+") + "$"), style)
                for pattern, style in plan.items()]
    expanded: dict[str, str] = {}
    for name, module in model.named_modules():
        for pattern, style in patterns:
            if pattern.match(name):
                expanded[name] = style
                expanded.update((f"{name}.{param}", style)
                                for param, _ in module.named_parameters(recurse=False))
                break
    if not expanded:
        raise UnsupportedModelError(f"the tensor-parallel plan of {type(model).__name__} "
                                    "matches none of its modules")
    return expanded
