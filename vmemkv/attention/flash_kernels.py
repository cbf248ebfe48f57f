"""The FlashAttention-2 kernels vmemkv can call, found by feature detection, and how to call them.

* **bundled**: ``torch.ops.aten._flash_attention_forward``, PyTorch's own copy of FlashAttention-2
  (CUDA builds, sm80+). Its varlen path takes ``cum_seq_q``/``cum_seq_k`` and, since torch 2.5,
  ``seqused_k`` (needed for slots); newer builds (2.12's schema has it; 2.13 here) add
  ``block_table``. We read the op's schema rather than trust a version number.
* **package**: ``flash_attn`` when importable. Its public ``flash_attn_varlen_func`` has no
  ``seqused_k``, so slots go through ``_flash_attn_varlen_forward`` where its signature has
  ``seqused_k`` (2.6.3 and later); block tables through ``flash_attn_varlen_func(block_table=)``;
  decode-only steps may use ``flash_attn_with_kvcache(cache_batch_idx=)`` (vAttention's call) when
  every slot offset fits 32 bits (flash-attention issue 772, open: no release is known to fix it).

Every kernel receives the same ``VarlenArgs`` (as device tensors) that the CPU tests check against
``varlen_attention_reference``. Whether a kernel is used at all is decided once per engine by
``probe`` (a tiny call checked against the reference), so a kernel that exists but computes
something else (say, ignores ``seqused_k``) is never chosen.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from vmemkv.attention.flash_args import FlashUnsupportedError, INT32_MAX

FLASH_DTYPES = (torch.float16, torch.bfloat16)


# --- feature detection ------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelFeatures:
    """What one kernel entry point accepts."""

    name: str  # "bundled" or "package"
    available: bool
    seqused_k: bool = False  # varlen over slots
    block_table: bool = False  # varlen over block tables
    kvcache_batch_idx: bool = False  # flash_attn_with_kvcache(cache_batch_idx=) (package only)
    window: bool = False  # a sliding window (window_size_left)
    softcap: bool = False  # logit soft-capping
    version: str = ""
    reason: str = ""


def schema_features(schema: Any) -> KernelFeatures:
    """Features of ``aten::_flash_attention_forward`` from its schema (a ``FunctionSchema``)."""
    names = [argument.name for argument in schema.arguments]
    if len(names) < 10 or names[:3] != ["query", "key", "value"]:
        return KernelFeatures("bundled", False, reason=f"unexpected schema {schema}")
    return KernelFeatures("bundled", True, seqused_k="seqused_k" in names,
                          block_table="block_table" in names, window="window_size_left" in names,
                          softcap="softcap" in names, version=torch.__version__)


@functools.cache
def bundled_features() -> KernelFeatures:
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None:
        return KernelFeatures("bundled", False, reason="torch has no aten::_flash_attention_forward")
    if getattr(torch.version, "hip", None):  # AOTriton/CK backends: seqused_k not verified there
        return KernelFeatures("bundled", False, reason="ROCm's flash backend is not verified with seqused_k")
    return schema_features(op.default._schema)


def package_features_of(varlen_forward: Callable | None, with_kvcache: Callable | None,
                        version: str) -> KernelFeatures:
    """Features of a ``flash_attn`` install from its functions' signatures."""
    params = inspect.signature(varlen_forward).parameters if varlen_forward is not None else {}
    kvcache = inspect.signature(with_kvcache).parameters if with_kvcache is not None else {}
    return KernelFeatures("package", bool(params or kvcache), seqused_k="seqused_k" in params,
                          block_table="block_table" in params,
                          kvcache_batch_idx="cache_batch_idx" in kvcache,
                          window="window_size_left" in params or "window_size" in params,
                          softcap="softcap" in params, version=version)


@functools.cache
def package_features() -> KernelFeatures:
    try:
        import flash_attn
        from flash_attn import flash_attn_interface as interface
    except Exception as exc:  # ImportError, or a build that fails to load its CUDA library
        return KernelFeatures("package", False, reason=f"flash_attn not importable: {exc}")
    return package_features_of(getattr(interface, "_flash_attn_varlen_forward", None),
                               getattr(interface, "flash_attn_with_kvcache", None),
                               getattr(flash_attn, "__version__", "?"))


def max_kvcache_offset(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """The largest element offset ``flash_attn_with_kvcache`` computes into a
    ``[num_slots, tokens, heads, dim]`` cache: last slot, last token, last head, last element."""
    return sum((size - 1) * stride for size, stride in zip(shape, strides))


def kvcache_batch_index_safe(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether every offset fits int32. flash-attention issue 772: with ``cache_batch_idx`` and a
    batch stride of 2^30 elements, some versions read and wrote the wrong slot (32-bit index
    math). Our slot strides are huge (a whole slot of all layers), so this usually says no."""
    return max_kvcache_offset(shape, strides) <= INT32_MAX


def check_kvcache_batch_index(shape: tuple[int, ...], strides: tuple[int, ...]) -> None:
    if not kvcache_batch_index_safe(shape, strides):
        raise FlashUnsupportedError(
            f"flash_attn_with_kvcache over a {tuple(shape)} cache with strides {tuple(strides)} reaches "
            f"element offset {max_kvcache_offset(shape, strides)} > 2^31 - 1, where flash-attn's 32-bit "
            "batch index math (flash-attention issue 772) can address the wrong slot; use the varlen "
            "kernel (seqused_k) or fewer/shorter slots")


# --- calls ------------------------------------------------------------------------------------------

def bundled_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, seqused_k: torch.Tensor, max_seqlen_q: int,
                   max_seqlen_k: int, scale: float, block_table: torch.Tensor | None = None,
                   window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """One varlen FlashAttention-2 call through PyTorch's bundled kernel; ``[total_q, Hq, D]``.
    ``window``: the last ``window`` keys of each query (``window_size_left = window - 1``)."""
    extra: dict[str, Any] = {"scale": scale, "seqused_k": seqused_k}
    if block_table is not None:
        extra["block_table"] = block_table
    if window:
        extra["window_size_left"], extra["window_size_right"] = window - 1, 0
    if softcap:
        extra["softcap"] = softcap  # only called so where the schema has it (KernelFeatures.softcap)
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, True, False, **extra)
    return out[0]


def package_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, seqused_k: torch.Tensor, max_seqlen_q: int,
                   max_seqlen_k: int, scale: float, block_table: torch.Tensor | None = None,
                   window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """The same call through the ``flash_attn`` package's varlen forward (keywords by name, since
    its positional parameters changed between 2.6 and 2.7)."""
    from flash_attn.flash_attn_interface import _flash_attn_varlen_forward

    extra = _package_variant(_flash_attn_varlen_forward, window, softcap)
    out = _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     dropout_p=0.0, softmax_scale=scale, causal=True,
                                     seqused_k=seqused_k, block_table=block_table, **extra)
    return out[0]


def _package_variant(function: Callable, window: int | None, softcap: float | None) -> dict[str, Any]:
    """flash_attn's keywords for a window and soft-capping: 2.7 takes ``window_size_left`` and
    ``window_size_right``, 2.6 one ``window_size`` pair."""
    extra: dict[str, Any] = {}
    if window:
        if "window_size_left" in inspect.signature(function).parameters:
            extra["window_size_left"], extra["window_size_right"] = window - 1, 0
        else:
            extra["window_size"] = (window - 1, 0)
    if softcap:
        extra["softcap"] = softcap
    return extra


def package_kvcache_decode(q: torch.Tensor, k_view: torch.Tensor, v_view: torch.Tensor,
                           lengths: torch.Tensor, slots: torch.Tensor, max_length: int,
                           scale: float, window: int | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """Decode ``q`` ``[B, Hq, D]`` (one query per sequence) over slot views with
    ``cache_batch_idx``, as vAttention does. The cache is narrowed to the longest length, because
    the kernel sizes its split-KV scratch from ``k_cache.size(1)``."""
    from flash_attn import flash_attn_with_kvcache

    k_cache, v_cache = k_view[:, :max_length], v_view[:, :max_length]
    check_kvcache_batch_index(tuple(k_cache.shape), k_cache.stride())
    out = flash_attn_with_kvcache(q[:, None], k_cache, v_cache, cache_seqlens=lengths,
                                  cache_batch_idx=slots, softmax_scale=scale, causal=True,
                                  **_package_variant(flash_attn_with_kvcache, window, softcap))
    return out[:, 0]


# --- choosing -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FlashKernel:
    """A varlen FlashAttention-2 entry point usable for this engine's shapes."""

    name: str  # "bundled" or "package"
    varlen: Callable[..., torch.Tensor]
    kvcache_decode: bool = False  # decode-only steps may use flash_attn_with_kvcache
    window: bool = False  # takes a sliding window
    softcap: bool = False  # takes logit soft-capping

    def runs(self, window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> bool:
        """Whether this kernel computes a layer with this variant (FlashAttention-2 has no
        sinks); the caller falls back to SDPA or the explicit path otherwise."""
        return sinks is None and (not window or self.window) and (softcap is None or self.softcap)


def flash_kernel_for(paged: bool, kvcache_safe: bool = False) -> tuple[FlashKernel | None, str]:
    """The preferred kernel with the features this addressing needs (bundled first: it ships
    with torch), or ``None`` and why not. No GPU call is made; see ``probe``."""
    needed = "block_table" if paged else "seqused_k"
    reasons = []
    for features, call in ((bundled_features(), bundled_varlen), (package_features(), package_varlen)):
        if not features.available:
            reasons.append(f"{features.name}: {features.reason}")
        elif not getattr(features, needed):
            reasons.append(f"{features.name} {features.version}: no {needed} argument")
        else:
            decode = features.name == "package" and features.kvcache_batch_idx and kvcache_safe and not paged
            return FlashKernel(features.name, call, decode, features.window, features.softcap), ""
    return None, "; ".join(reasons)


def shape_supported(dtype: torch.dtype, head_dim: int, num_q_heads: int, num_kv_heads: int) -> str:
    """Why FlashAttention-2 cannot run these shapes, or "" when it can. head_dim % 8: otherwise it
    pads (copies) the whole K/V tensor, which would touch a reservation's unmapped pages."""
    if dtype not in FLASH_DTYPES:
        return f"FlashAttention-2 runs float16/bfloat16 only, the KV cache is {dtype}"
    if head_dim % 8 or not 8 <= head_dim <= 256:
        return f"FlashAttention-2 needs head_dim a multiple of 8 up to 256, got {head_dim}"
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        return f"{num_q_heads} query heads are not a multiple of {num_kv_heads} kv heads"
    return ""
