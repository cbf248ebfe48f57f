"""The one adapter between Hugging Face models and vmemkv: a model's text config, the
``CacheConfig`` shaped for it, and which attention variants vmemkv reproduces.

Used by the engine (``LLMEngine``, through ``EngineConfig.cache_config``), the model runner (which
relies on the engine's :func:`check_attention_supported`) and the transformers integration
(``vmemkv_transformers.cache``).

The engine replaces the model's attention function with
its own, which applies what transformers passes it per layer: the scaling, a sliding window
(local and global layers in one model), logit soft-capping and attention sinks
(``vmemkv.attention.variants``); ``VmemkvCache`` hands a sliding layer's tokens from its window
start (or every token, with ``release_behind_window=False``) to the model's own attention, whose
mask applies the window. A model that attends otherwise would run and silently give other
tokens than transformers, so both refuse it at load time with :func:`check_attention_supported`.
Multi-head latent attention models (DeepSeek-V2/V3, MiniCPM3, Kimi Linear: :data:`LATENT_MODEL_TYPES`)
are sized by their latent row (:func:`latent_dims`, :func:`kv_shape`) and cached as latent rows by both.
This module reads config attributes (and a model's dtype and device) only; it does not import
transformers.
"""

from __future__ import annotations

from typing import Any

from vmemkv.cache.config import CacheConfig
from vmemkv.errors import UnsupportedModelError

# Layer kinds vmemkv applies exactly at any length: the model passes its window as
# ``sliding_window`` to the attention function (engine) and builds its mask (``VmemkvCache``).
_EXACT_KINDS = frozenset({"full_attention", "sliding_attention"})
# Layer kinds that only see the current chunk of W tokens: identical to full attention as long
# as no sequence is longer than W (what ``VmemkvCache``, which runs the model's attention over
# every cached token, relies on; the engine applies the chunks: ``layer_chunks``). The config
# attribute holding W.
_BOUNDED_KINDS = {"chunked_attention": ("chunked attention", "attention_chunk_size")}
CHUNKED_KIND = "chunked_attention"
# Models whose own code applies the chunks (its chunked mask); other configs may list chunked
# layers that their modelling code attends in full.
_CHUNKING_MODEL_TYPES = frozenset({"llama4", "llama4_text"})

# ALiBi position biases, which the model hands to its attention function as an extra argument.
_ALIBI_MODEL_TYPES = frozenset({"bloom"})

# The layer kind that holds both attention K/V and a recurrent state (Falcon-H1's).
HYBRID_KIND = "hybrid"
# Layer kinds that keep a recurrent state instead of K/V (what vmemkv does not cache yet), as
# users know them.
_STATE_KINDS = {"mamba": "Mamba / SSM state", "linear_attention": "linear attention state (gated delta net)",
                "conv": "short convolution state", "recurrent": "recurrent (RG-LRU) state",
                HYBRID_KIND: "attention K/V beside a Mamba / SSM state"}

# Models whose recurrent mixers the engine runs per sequence over their state in the cache
# (vmemkv.engine.models.state_mixers), with the kind of their state layers.
STATE_MODEL_TYPES = {"lfm2": "conv", "qwen3_next": "linear_attention", "qwen3_5_text": "linear_attention",
                     "granitemoehybrid": "linear_attention",  # (Granite-4.0-H's Mamba2 layers)
                     "nemotron_h": "linear_attention",  # (Nemotron-H's Mamba2 layers)
                     "falcon_h1": HYBRID_KIND,  # (every layer: attention and Mamba2 side by side)
                     "kimi_linear": "linear_attention"}  # (Kimi delta attention, beside MLA layers)

# Layer kinds with no memory at all (Nemotron-H's MLP-only and MoE-only layers): no cache group.
MEMORYLESS_KINDS = frozenset({"mlp", "moe"})

# Multi-head latent attention whose attention module the engine runs from the latent rows
# (vmemkv.engine.models.latent_attention) and whose own code hands VmemkvCache the latent.
LATENT_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "minicpm3", "kimi_linear"})


def text_config(config: Any) -> Any:
    """The decoder's text config of a composite (multimodal) config; ``config`` itself otherwise."""
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:  # older transformers: no ``decoder`` argument
        return get()


# Config keys that bound a model's positions, the ones vLLM reads (``_get_and_verify_max_len``).
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "model_max_length", "max_sequence_length", "max_seq_length", "seq_len")
# RoPE types whose factor does not lengthen the limit (their config already gives the full length).
_UNSCALED_ROPE_TYPES = frozenset({"default", "su", "longrope", "llama3", "mrope"})


def model_length_limit(config: Any) -> tuple[int, str] | None:
    """The longest sequence the model's config allows, as vLLM derives it: the smallest of the
    length keys, times the RoPE scaling factor (yarn: times its ``original_max_position_embeddings``);
    with what says so, in words. None when the config names no length."""
    text = text_config(config)
    found = [(value, key) for key in _LENGTH_KEYS
             if isinstance(value := getattr(text, key, None), int) and not isinstance(value, bool)]
    if not found:
        return None
    limit, key = min(found)
    reason = f"{key}={limit}"
    rope = _rope_scaling(text)
    factor = rope.get("factor") if rope else None
    if isinstance(factor, (int, float)) and factor > 0:
        if rope.get("rope_type", rope.get("type")) == "yarn":
            limit = rope.get("original_max_position_embeddings", limit)
            reason = f"original_max_position_embeddings={limit}"
        limit = int(limit * factor)
        reason += f" times its RoPE scaling factor {factor:g}"
    return limit, reason


def _rope_scaling(text: Any) -> dict | None:
    """The RoPE parameters that scale the positions (transformers 5: ``rope_parameters``, possibly
    one per layer kind, then the full-attention layers'; before: ``rope_scaling``), or None."""
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
        rope = rope["full_attention"]
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type")) in _UNSCALED_ROPE_TYPES:
        return None
    return rope


def latent_dims(config: Any) -> tuple[int, int] | None:
    """``(kv_lora_rank, qk_rope_head_dim)`` of a multi-head latent attention model (DeepSeek-V2/V3,
    MiniCPM3, Kimi-K2: every token caches one row of their sum per layer); None otherwise."""
    text = text_config(config)
    rank, rope = getattr(text, "kv_lora_rank", None), getattr(text, "qk_rope_head_dim", None)
    return (int(rank), int(rope)) if rank and rope else None


def kv_shape(config: Any) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of the decoder whose K/V vmemkv holds, from the
    model's own shapes: an MLA model's is one latent "head" of ``kv_lora_rank + qk_rope_head_dim``
    (its ``head_dim`` is the rope part only). A model whose K and V differ in size otherwise is
    refused (``UnsupportedModelError``): one head_dim would size one of them wrong."""
    text = text_config(config)
    heads = text.num_attention_heads
    latent = latent_dims(text)
    if latent:
        return text.num_hidden_layers, 1, sum(latent)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    value_dim = getattr(text, "v_head_dim", None)
    if value_dim and value_dim != head_dim:
        raise UnsupportedModelError(
            f"this {getattr(text, 'model_type', type(text).__name__)} model's values have "
            f"{value_dim} dims per head and its keys {head_dim}: vmemkv caches K and V of one head "
            "size (or MLA's latent rows); use a model whose K and V heads match")
    return text.num_hidden_layers, getattr(text, "num_key_value_heads", None) or heads, head_dim


def storing_layers(config: Any) -> int:
    """How many layers, from the first, hand their K/V to a transformers cache: all but
    Gemma-3n's KV-shared layers (the last ``num_kv_shared_layers``), which reuse an earlier
    layer's K/V and never call ``cache.update``."""
    text = text_config(config)
    return text.num_hidden_layers - (getattr(text, "num_kv_shared_layers", None) or 0)


def cache_config_for(model: Any, max_num_seqs: int, max_model_len: int,
                     num_blocks: int | None = None, *, spare_blocks_per_slot: int = 0,
                     check_token_ids: bool = False, release_behind_window: bool = False,
                     num_layers: int | None = None, **options: Any) -> CacheConfig:
    """A :class:`CacheConfig` shaped for ``model`` (layers, KV heads, head dim, and the model's
    dtype and device unless ``options`` say otherwise).

    ``num_blocks`` defaults to every slot at full length plus ``spare_blocks_per_slot`` (room for
    copy-on-write copies); ``check_token_ids``: the manager checks token ids against the model's
    vocabulary; ``release_behind_window``: the caller's attention reads from each layer's window
    start (the engine's and ``VmemkvCache``'s do), so when every
    layer slides with one window shorter than ``max_model_len`` (:func:`uniform_window`), blocks
    behind it are released while a request runs (``CacheConfig.sliding_window``). Other keyword
    arguments are ``CacheConfig`` fields (``tokens_per_page``, ``enable_prefix_caching``,
    ``kv_backend``, ...). ``num_layers``: hold only the first ``num_layers`` layers
    (``VmemkvCache``: :func:`storing_layers`); every layer by default."""
    if release_behind_window and "sliding_window" not in options:
        window = uniform_window(model.config)
        if window is not None and window < max_model_len:
            options["sliding_window"] = window
    all_layers, num_kv_heads, head_dim = kv_shape(model.config)
    num_layers = num_layers or all_layers
    if "dtype" not in options:
        options["dtype"] = model.dtype
    if "device" not in options:
        options["device"] = str(model.device)
    if check_token_ids:
        options["vocab_size"] = getattr(text_config(model.config), "vocab_size", None)
    options.setdefault("latent", latent_dims(model.config) is not None)
    if options["latent"] and options.get("kv_backend") == "paged":
        raise UnsupportedModelError("this model's multi-head latent attention reads its latent rows "
                                    "from slots, not block tables: use kv_backend='vmem'")
    cache = CacheConfig(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        num_blocks=1 if num_blocks is None else num_blocks,
                        max_num_seqs=max_num_seqs, max_model_len=max_model_len, **options)
    if num_blocks is None:
        per_slot = cache.make_layout().logical_pages_for(max_model_len)
        cache.num_blocks = max_num_seqs * (per_slot + spare_blocks_per_slot)
    return cache


def layer_kinds(config: Any) -> list[str]:
    """Each layer's attention kind ("full_attention", "sliding_attention", ...) as the model's
    own code decides it, also for configs without ``layer_types``."""
    text = text_config(config)
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        return list(layer_types)
    num_layers = text.num_hidden_layers
    window = getattr(text, "sliding_window", None)
    if not window or getattr(text, "use_sliding_window", None) is False:
        return ["full_attention"] * num_layers
    # Mistral, Mixtral, Phi-3, Starcoder2 apply ``sliding_window`` on every layer; configs with
    # ``use_sliding_window`` (older Qwen2) slide from layer ``max_window_layers`` up.
    first = getattr(text, "max_window_layers", 0) if hasattr(text, "use_sliding_window") else 0
    return ["full_attention" if i < first else "sliding_attention" for i in range(num_layers)]


def layer_chunks(config: Any) -> list[int | None] | None:
    """Each layer's attention chunk (None: the layer is not chunked) when some layer of
    ``config`` is chunked local (Llama-4's ``chunked_attention`` layers, in a model whose code
    applies them); None otherwise."""
    text = text_config(config)
    kinds = layer_kinds(text)
    chunk = getattr(text, "attention_chunk_size", None)
    if CHUNKED_KIND not in kinds or not chunk or getattr(text, "model_type", None) not in _CHUNKING_MODEL_TYPES:
        return None
    return [int(chunk) if kind == CHUNKED_KIND else None for kind in kinds]


def uniform_chunk(config: Any) -> int | None:
    """The attention chunk every layer of ``config`` reads within, or None."""
    chunks = layer_chunks(config)
    return chunks[0] if chunks and None not in chunks else None


def uniform_window(config: Any) -> int | None:
    """The window every layer of ``config`` slides with, or None when some layer attends to every
    token (a global layer) or the layers' windows differ."""
    text = text_config(config)
    window = getattr(text, "sliding_window", None)
    if not window or any(kind != "sliding_attention" for kind in layer_kinds(text)):
        return None
    return int(window)


def hybrid_layer_windows(config: Any, max_len: int) -> list[int | None] | None:
    """Each layer's window (None: the layer reads every token) when ``config`` mixes global
    layers with local ones of one window shorter than ``max_len`` (Gemma-2/3, GPT-OSS, Cohere2):
    what ``KVCacheManager(layer_windows=...)`` needs to give back the local layers' blocks behind
    the window.
    None for any other model (every layer global, or every layer sliding: ``uniform_window``)."""
    text = text_config(config)
    window = getattr(text, "sliding_window", None)
    kinds = layer_kinds(text)
    if not window or window >= max_len or set(kinds) != {"sliding_attention", "full_attention"}:
        return None
    return [int(window) if kind == "sliding_attention" else None for kind in kinds]


def check_attention_supported(config: Any, max_len: int, *, replaces_attention: bool,
                              who: str = "vmemkv", limit_name: str = "max_model_len",
                              max_packed_tokens: int = 0) -> None:
    """Raise :class:`UnsupportedModelError` unless vmemkv reproduces ``config``'s attention for
    sequences of up to ``max_len`` tokens: causal attention over every cached token, or over the
    last ``sliding_window`` tokens on sliding layers.

    ``replaces_attention``: the caller runs its own attention function (the engine), not the
    model's (``VmemkvCache``), so changes to the scores inside attention matter too: logit
    soft-capping and sinks are applied, ALiBi and bidirectional attention are refused. ``who``
    and ``limit_name`` word the message; ``max_packed_tokens``: the most tokens one packed forward
    holds (the engine's ``max_num_batched_tokens``)."""
    text = text_config(config)
    model_type = getattr(text, "model_type", None) or type(text).__name__
    kinds = layer_kinds(text)
    problems: list[str] = []
    for kind in dict.fromkeys(kinds):
        if kind in _EXACT_KINDS or (kind == CHUNKED_KIND and replaces_attention
                                    and model_type in _CHUNKING_MODEL_TYPES):
            continue  # (the engine's attention applies the chunks itself: layer_chunks)
        if kind in MEMORYLESS_KINDS:
            continue  # nothing to cache
        if replaces_attention and STATE_MODEL_TYPES.get(model_type) == kind:
            continue  # the engine runs these mixers over their state (state_mixers.py)
        layers = _ranges([i for i, k in enumerate(kinds) if k == kind])
        if kind not in _BOUNDED_KINDS:
            what = (f"keep {_STATE_KINDS[kind]}, which" if kind in _STATE_KINDS
                    else "are a kind of layer")
            problems.append(f"{kind!r} layers ({layers}) {what} vmemkv does not cache (it caches "
                            "full, sliding-window and chunked attention, and MLA's latent rows); "
                            "use a model without them")
            continue
        feature, attribute = _BOUNDED_KINDS[kind]
        size = getattr(text, attribute, None)
        if size is not None and size < max_len:  # a query at position >= size sees fewer tokens
            problems.append(f"{feature} of {size} tokens on layers {layers}, but {limit_name} is "
                            f"{max_len} and {who} keeps every token (full attention): "
                            f"use {limit_name} <= {size}")
    if latent_dims(text) and model_type not in LATENT_MODEL_TYPES:
        problems.append(f"multi-head latent attention, which {who} caches as latent rows for "
                        f"{', '.join(sorted(LATENT_MODEL_TYPES))} models only: use one of them")
    if replaces_attention:
        no_rope = [i for i, rope in enumerate(getattr(text, "no_rope_layers", None) or []) if not rope]
        floor_scale = getattr(text, "floor_scale", None)
        if (getattr(text, "attn_temperature_tuning", False) and no_rope and floor_scale
                and max(max_len, max_packed_tokens) >= floor_scale):
            # Llama-4 scales NoPE layers' queries from position floor_scale - 1 on, taking
            # positions from its cache; the engine's packed forward has none (it counts the
            # packed rows instead), so both lengths must stay below floor_scale.
            problems.append(f"attention temperature tuning on NoPE layers ({_ranges(no_rope)}), "
                            f"which changes queries from position {floor_scale - 1} on, but "
                            f"{limit_name} is {max_len} (and a forward packs up to "
                            f"{max_packed_tokens} tokens): keep both below {floor_scale}")
        if getattr(text, "use_bidirectional_attention", False):
            problems.append(f"bidirectional attention, which {who}'s causal attention does not "
                            "apply: use a causal model")
        attn_config = getattr(text, "attn_config", None)  # MPT keeps its ALiBi flag there
        if (model_type in _ALIBI_MODEL_TYPES or getattr(text, "alibi", False)
                or getattr(attn_config, "alibi", False)):
            problems.append(f"ALiBi position biases, which {who}'s attention does not apply: "
                            "use a RoPE model")
    if problems:
        raise UnsupportedModelError(f"{who} cannot run this {model_type} model as transformers "
                                    "does: " + "; ".join(problems))


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
