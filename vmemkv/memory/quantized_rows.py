"""Quantized KV rows: ``kv_cache_dtype`` "int8" or "fp8" (vLLM's ``--kv-cache-dtype``).

Each K (or V) row of one token and one KV head, ``head_dim`` values, is stored in one byte a value
with one float32 scale per group of ``SCALE_GROUP`` values of the row (one per row when
``head_dim`` is not a multiple of it), symmetric: ``value ~= stored * scale``,
``scale = max|group| / QMAX`` (fp8 is e4m3, whose largest value is 448). Groups, not whole rows
(vLLM's int8 KV has one scale per token and head): with one scale per 64-value row, 6 of 16 of
SmolLM2-135M's greedy answers stayed the exact run's in int8 (mean KL 0.0008 nats a token); its
outlier channels need the finer scales the cold tier's codec uses too. The scales sit in the same
token row as the values (``KVLayout``: after the row's values), so every copy of a page
(copy-on-write, swap, the host tier, a prefix hit) carries them; no other table exists.

A row's scales are fixed when the row is written, so reading never re-quantizes: attention either
reads the bytes and scales where they lie (the native CPU decode routine) or dequantizes the rows
it reads (``dequantize``) for SDPA.
"""

from __future__ import annotations

import torch

from vmemkv.errors import ConfigError

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4
SCALE_GROUP = 32  # values one scale covers


def scale_group(head_dim: int) -> int:
    """The values one scale covers in rows of ``head_dim``: ``SCALE_GROUP``, or the whole row."""
    return SCALE_GROUP if head_dim % SCALE_GROUP == 0 else head_dim


def groups_per_row(head_dim: int) -> int:
    """Scales one row of ``head_dim`` values carries."""
    return head_dim // scale_group(head_dim)


def storage_dtype(model_dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    """The dtype a cache of ``kv_cache_dtype`` stores its values in (``auto``: the model's)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype is {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    return model_dtype if kv_cache_dtype == "auto" else STORAGE[kv_cache_dtype]


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether rows of ``dtype`` carry a scale each (int8 and fp8 storage)."""
    return dtype in QMAX


def quantize(rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` ``[..., D]`` as ``(values [..., D] in dtype, scales [..., groups_per_row(D)]
    float32)``: one scale per group, its largest magnitude over ``QMAX`` (1 for an all-zero one)."""
    head_dim = rows.shape[-1]
    wide = rows.float().unflatten(-1, (groups_per_row(head_dim), scale_group(head_dim)))
    scale = wide.abs().amax(dim=-1) / QMAX[dtype]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled = (wide / scale[..., None]).flatten(-2)
    if dtype == torch.int8:
        return scaled.round_().clamp_(-127, 127).to(torch.int8), scale
    return scaled.clamp_(-448.0, 448.0).to(dtype), scale


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``values`` ``[..., D]`` with their ``scales`` ``[..., groups]`` back in ``dtype`` (a new
    tensor)."""
    groups = scales.shape[-1]
    wide = values.float().unflatten(-1, (groups, values.shape[-1] // groups))
    return (wide * scales[..., None]).flatten(-2).to(dtype)


def write_rows(values: torch.Tensor, scales: torch.Tensor | None, index: tuple, rows: torch.Tensor) -> None:
    """Quantize ``rows`` and store them at ``values[index]`` and their scales at ``scales[index]``;
    with no ``scales`` (a plain cache), store them in ``values``' dtype."""
    if scales is None:
        values[index] = rows.to(values.dtype)
        return
    quantized, scale = quantize(rows, values.dtype)
    values[index] = quantized
    scales[index] = scale


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None,
             index: tuple, key: torch.Tensor, value: torch.Tensor) -> None:
    """``key`` and ``value`` stored at ``index`` of a layer's K and V (slot views or block tensors),
    as ``write_rows`` stores them."""
    k_scales, v_scales = scales if scales is not None else (None, None)
    write_rows(k_cache, k_scales, index, key)
    write_rows(v_cache, v_scales, index, value)
