"""Host-side checks of the Triton decode kernels' arguments (``triton_decode``): shapes, dtypes,
strides, devices, a layer variant's window, cap and sinks; and, on request, the values of lengths,
slot ids and block-table entries. Each failure is a ``ValueError`` that names the argument."""

from __future__ import annotations

import torch

from vmemkv.memory.quantized_rows import QMAX

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
QUANTIZED_DTYPES = tuple(QMAX)  # int8 and float8_e4m3fn, with float32 scales
MAX_HEAD_DIM = 256


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor,
                  names: tuple[str, str], out: torch.Tensor | None,
                  kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """``kv_scales``: the float32 scales ``[outer, tokens, kv_heads, groups]`` of quantized (int8 / fp8)
    ``k`` and ``v`` (``memory/quantized_rows.py``); None when they hold q's dtype."""
    k_name, v_name = names
    if kv_scales is not None:
        check_scales(k, v, kv_scales, names)
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, num_q_heads, head_dim], got shape {tuple(q.shape)}")
    if k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{k_name} and {v_name} must be 4-D [outer, tokens, kv_heads, head_dim], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"{k_name} {tuple(k.shape)} and {v_name} {tuple(v.shape)} must have the same shape")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if kv_scales is None and (k.dtype != q.dtype or v.dtype != q.dtype):
        raise ValueError(f"q, {k_name} and {v_name} must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    if k.shape[3] != head_dim:
        raise ValueError(f"q head_dim {head_dim} differs from {k_name} head_dim {k.shape[3]}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is not supported; it must be between 1 and {MAX_HEAD_DIM}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if k.stride(3) != 1 or v.stride(3) != 1:
        raise ValueError(f"the last dim of {k_name} and {v_name} must be contiguous (stride 1), got strides "
                         f"{k.stride()} and {v.stride()}")
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be [batch] = [{batch}], got {tuple(seq_lens.shape)}")
    if seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be int32 or int64, got {seq_lens.dtype}")
    tensors = {"q": q, k_name: k, v_name: v, "seq_lens": seq_lens}
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
            raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim, got "
                             f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
        tensors["out"] = out
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"device {q.device} is not supported: CUDA runs compiled, CPU interpreted")


def check_scales(k: torch.Tensor, v: torch.Tensor, kv_scales, names: tuple[str, str]) -> None:
    if k.dtype not in QUANTIZED_DTYPES or v.dtype != k.dtype:
        raise ValueError(f"kv_scales go with int8 or float8_e4m3fn {names[0]} and {names[1]}, got "
                         f"{k.dtype} and {v.dtype}")
    groups = kv_scales[0].shape[-1] if kv_scales[0].dim() == 4 else 0
    for name, scales in zip(names, kv_scales):
        if (scales.dtype != torch.float32 or scales.shape != (*k.shape[:3], groups) or not groups
                or k.shape[3] % groups or scales.stride(3) != 1 or scales.device != k.device):
            raise ValueError(f"the scales of {name} must be float32 [{', '.join(map(str, k.shape[:3]))}, groups] "
                             f"on {k.device}, the groups of a row contiguous and dividing its {k.shape[3]} "
                             f"values, got {scales.dtype} {tuple(scales.shape)} strides {scales.stride()} "
                             f"on {scales.device}")


def check_variant(q: torch.Tensor, window: int | None, softcap: float | None,
                  sinks: torch.Tensor | None) -> None:
    if window is not None and window <= 0:
        raise ValueError(f"window must be a positive number of tokens, got {window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    num_q_heads = q.shape[1]
    if sinks is not None and (sinks.shape != (num_q_heads,) or sinks.device != q.device):
        raise ValueError(f"sinks must be [num_q_heads] = [{num_q_heads}] on {q.device}, got "
                         f"{tuple(sinks.shape)} on {sinks.device}")


def check_values(name: str, values: torch.Tensor, low: int, high: int, high_name: str) -> None:
    if values.numel() == 0:
        return
    lo, hi = int(values.min()), int(values.max())
    if lo < low or hi > high:
        raise ValueError(f"{name} must lie in [{low}, {high}] ({high_name}), got values from {lo} to {hi}")


def check_slot_ids(slot_ids: torch.Tensor, q: torch.Tensor, seq_lens: torch.Tensor, k: torch.Tensor,
                   check_bounds: bool) -> None:
    """Slot ids ``[batch]`` on q's device; with ``check_bounds``, lengths within the view's tokens
    and ids within its slots."""
    if slot_ids.shape != (q.shape[0],) or slot_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_ids must be int32/int64 [batch] = [{q.shape[0]}], got "
                         f"{tuple(slot_ids.shape)} {slot_ids.dtype}")
    if slot_ids.device != q.device:
        raise ValueError(f"slot_ids is on {slot_ids.device}, q on {q.device}")
    num_slots, max_tokens = k.shape[:2]
    if check_bounds and q.shape[0]:
        check_values("seq_lens", seq_lens, 0, max_tokens, "the view's max_tokens")
        check_values("slot_ids", slot_ids, 0, num_slots - 1, "num_slots - 1")


def check_block_tables(block_tables: torch.Tensor, q: torch.Tensor, seq_lens: torch.Tensor,
                       k_blocks: torch.Tensor, window: int | None, check_bounds: bool) -> torch.Tensor:
    """Block tables ``[batch, max_blocks]`` on q's device, returned with a contiguous last dim;
    with ``check_bounds``, lengths within the tables and the entries each sequence reads (from
    its window start: blocks behind it may be released) within ``k_blocks``."""
    batch = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.dtype not in (torch.int32,
                                                                                                 torch.int64):
        raise ValueError(f"block_tables must be int32 [batch = {batch}, max_blocks], got "
                         f"{tuple(block_tables.shape)} {block_tables.dtype}")
    if block_tables.device != q.device:
        raise ValueError(f"block_tables is on {block_tables.device}, q on {q.device}")
    if block_tables.shape[1] and block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    num_blocks, block_size = k_blocks.shape[:2]
    if check_bounds and batch:
        check_values("seq_lens", seq_lens, 0, block_tables.shape[1] * block_size, "max_blocks * block_size")
        starts = torch.arange(block_tables.shape[1], device=q.device)[None, :] * block_size
        used = starts < seq_lens[:, None]
        if window is not None:
            used &= starts + block_size > seq_lens[:, None] - window
        check_values("block table entries in use", block_tables[used], 0, num_blocks - 1, "num_blocks - 1")
    return block_tables


def query_and_output(q: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` with a contiguous last dim (the kernels' row loads), and ``out`` or a new output."""
    if q.stride(2) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return q, out
