"""Lossy compression of whole KV blocks, for the prefix cache's cold tier (``cold_tier.py``).

A block is ``block_bytes`` of the model's dtype: every layer's K and V rows (or MLA latent rows)
for ``tokens_per_page`` tokens. The codec reads it as groups of ``group`` consecutive elements,
none crossing a head's row (``group`` divides the head dimension and the token stride), and keeps
each group as signed integers of ``bits`` bits (8, or 4 packed two to a byte) times one float32
scale: symmetric, the group's largest magnitude mapped to the largest integer (GGUF's Q8_0 and
Q4_0, whose float16 scale would overflow on large activations; float32 costs one bit a value
more). A decompressed block is written back in the model's dtype, so attention kernels read
ordinary rows. Quantizing a decompressed block again gives the same integers and scales (up to
the dtype's rounding): a lossy block evicted twice loses no more.

A block of quantized live KV (``kv_cache_dtype`` int8 / fp8: each row's bytes with their float32
scales beside them, ``memory/quantized_rows.py``) is read row by row through the layout's block
geometry (``QuantizedBlockCodec``): its rows' values are compressed as the float ones are, and a
decompressed block is quantized again into the live format, its padding zero. int8 rows under an
int8 cold tier come back as they were (the same groups of 32, the largest value at 127 both times).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch

from vmemkv.errors import ConfigError
from vmemkv.memory.quantized_rows import SCALE_DTYPE, dequantize, quantize

if TYPE_CHECKING:
    from vmemkv.memory.layout import KVLayout

COLD_FORMATS = {"int8": 8, "int4": 4}
MAX_GROUP = 32


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)


class CompressedBlocks(NamedTuple):
    """``n`` compressed blocks: ``values`` ``[n, elems * bits / 8]`` uint8 and ``scales``
    ``[n, elems / group]`` float32."""
    values: torch.Tensor
    scales: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes

    def block(self, index: int) -> "CompressedBlocks":
        """Block ``index`` alone, in host memory (as the swap space's rows) and its own storage
        (a slice would keep the others alive)."""
        return CompressedBlocks(*(host_copy(part[index:index + 1]) for part in self))

    def to(self, device: torch.device | str) -> "CompressedBlocks":
        return CompressedBlocks(self.values.to(device), self.scales.to(device))

    @staticmethod
    def concat(parts: "list[CompressedBlocks]") -> "CompressedBlocks":
        return CompressedBlocks(torch.cat([p.values for p in parts]), torch.cat([p.scales for p in parts]))


class BlockCodec:
    """``BlockCodec(fmt, dtype, block_bytes, head_dim, token_stride_elems)``: ``fmt`` one of
    ``COLD_FORMATS``; the block's elements are ``dtype`` (a floating type)."""

    def __init__(self, fmt: str, dtype: torch.dtype, block_bytes: int, head_dim: int,
                 token_stride_elems: int):
        if fmt not in COLD_FORMATS:
            raise ConfigError(f"cold tier format must be one of {', '.join(COLD_FORMATS)}, got {fmt!r}")
        if not dtype.is_floating_point:
            raise ConfigError(f"the cold tier compresses floating-point KV, got {dtype}")
        self.fmt, self.bits, self.dtype = fmt, COLD_FORMATS[fmt], dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.elems = block_bytes // itemsize
        self.group = math.gcd(MAX_GROUP, head_dim, token_stride_elems, self.elems)
        self.block_bytes = block_bytes
        self.levels = (1 << (self.bits - 1)) - 1  # 127 or 7: symmetric, -levels..levels

    @property
    def compressed_bytes(self) -> int:
        """Bytes one compressed block holds (values and scales)."""
        return self.elems * self.bits // 8 + (self.elems // self.group) * 4

    def compress(self, blocks: torch.Tensor) -> CompressedBlocks:
        """``blocks``: ``[n, block_bytes]`` uint8 rows (the pool's window); returns their copy in
        fewer bits."""
        return self._pack(blocks.view(self.dtype).reshape(len(blocks), -1).float())

    def decompress(self, packed: CompressedBlocks) -> torch.Tensor:
        """``packed`` as ``[n, block_bytes]`` uint8 rows of the model's dtype."""
        return self._unpack(packed).to(self.dtype).view(torch.uint8)

    def _pack(self, x: torch.Tensor) -> CompressedBlocks:
        """Values ``[n, elems]`` (float32) as integers of ``bits`` bits, a scale a group."""
        n = len(x)
        x = x.reshape(n, -1, self.group)
        scale = x.abs().amax(dim=-1, keepdim=True) / self.levels
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.round(x / safe).clamp_(-self.levels, self.levels).to(torch.int8)
        q = q.reshape(n, -1)
        if self.bits == 4:
            nibbles = (q & 0x0F).to(torch.uint8)
            values = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
        else:
            values = q.view(torch.uint8)
        return CompressedBlocks(values.contiguous(), scale.reshape(n, -1).contiguous())

    def _unpack(self, packed: CompressedBlocks) -> torch.Tensor:
        """``_pack``'s values back, ``[n, elems]`` float32."""
        values, n = packed.values, len(packed.values)
        if self.bits == 4:
            low = (values & 0x0F).to(torch.int8)
            high = (values >> 4).to(torch.int8)
            q = torch.stack((low, high), dim=-1).reshape(n, -1)
            q = torch.where(q > 7, q - 16, q)  # the nibbles' sign
        else:
            q = values.view(torch.int8)
        return (q.reshape(n, -1, self.group).float() * packed.scales.reshape(n, -1, 1)).reshape(n, -1)


class QuantizedBlockCodec(BlockCodec):
    """``QuantizedBlockCodec(fmt, layout)``: blocks of a quantized ``KVLayout`` (int8 / fp8 rows
    and their scales), their rows' values compressed as ``BlockCodec``'s, in groups of at most 32
    values of one head's row."""

    def __init__(self, fmt: str, layout: "KVLayout"):
        head_elems = layout.num_kv_heads * layout.head_dim
        self.layout = layout
        kinds = (0,) if layout.latent else (0, 1)  # an MLA layout's one latent row a layer, else K and V
        self.rows = [(layer, kv) for layer in range(layout.num_layers) for kv in kinds]
        values_bytes = len(self.rows) * layout.tokens_per_page * head_elems  # one byte a value
        super().__init__(fmt, torch.float32, values_bytes * 4, layout.head_dim, head_elems)
        self.block_bytes = layout.block_bytes

    def compress(self, blocks: torch.Tensor) -> CompressedBlocks:
        rows = [dequantize(values, scales, torch.float32) for values, scales in self.row_views(blocks)]
        return self._pack(torch.stack(rows, dim=1).reshape(len(blocks), -1))

    def decompress(self, packed: CompressedBlocks) -> torch.Tensor:
        n, layout = len(packed.values), self.layout
        floats = self._unpack(packed).reshape(n, len(self.rows), layout.tokens_per_page, layout.num_kv_heads,
                                              layout.head_dim)
        blocks = torch.zeros(n, self.block_bytes, dtype=torch.uint8, device=packed.values.device)
        for row, (values, scales) in enumerate(self.row_views(blocks)):
            values[...], scales[...] = quantize(floats[:, row], values.dtype)
        return blocks

    def row_views(self, blocks: torch.Tensor):
        """Per row (layer, K or V) of ``blocks`` (``[n, block_bytes]`` uint8, contiguous): its
        values ``[n, tokens, kv_heads, head_dim]`` and scales ``[n, tokens, kv_heads, groups]``,
        views into ``blocks`` where the layout puts them."""
        layout, n = self.layout, len(blocks)
        values_of, scales_of = blocks.view(layout.dtype), blocks.view(SCALE_DTYPE)
        tokens = (n, layout.tokens_per_page, layout.num_kv_heads)
        for layer, kv in self.rows:
            strides, offset = layout.block_view_geometry(layer, kv)
            values = values_of.as_strided((*tokens, layout.head_dim), strides,
                                          values_of.storage_offset() + offset)
            strides, offset = layout.block_scale_view_geometry(layer, kv)
            scales = scales_of.as_strided((*tokens, layout.scale_groups), strides,
                                          scales_of.storage_offset() + offset)
            yield values, scales
