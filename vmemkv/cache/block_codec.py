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
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from vmemkv.errors import ConfigError

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
        x = blocks.view(self.dtype).reshape(len(blocks), -1, self.group).float()
        scale = x.abs().amax(dim=-1, keepdim=True) / self.levels
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.round(x / safe).clamp_(-self.levels, self.levels).to(torch.int8)
        q = q.reshape(len(blocks), -1)
        if self.bits == 4:
            nibbles = (q & 0x0F).to(torch.uint8)
            values = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
        else:
            values = q.view(torch.uint8)
        return CompressedBlocks(values.contiguous(), scale.reshape(len(blocks), -1).contiguous())

    def decompress(self, packed: CompressedBlocks) -> torch.Tensor:
        """``packed`` as ``[n, block_bytes]`` uint8 rows of the model's dtype."""
        values, n = packed.values, len(packed.values)
        if self.bits == 4:
            low = (values & 0x0F).to(torch.int8)
            high = (values >> 4).to(torch.int8)
            q = torch.stack((low, high), dim=-1).reshape(n, -1)
            q = torch.where(q > 7, q - 16, q)  # the nibbles' sign
        else:
            q = values.view(torch.int8)
        x = q.reshape(n, -1, self.group).float() * packed.scales.reshape(n, -1, 1)
        return x.to(self.dtype).reshape(n, -1).view(torch.uint8)
