"""One host-to-device upload per step for the attention's index tensors.

A step needs several small integer tensors (where to write each new token, the decode rows, slot
ids, lengths, cu_seqlens, block tables). Each ``torch.tensor(list, device="cuda")`` is its own
pageable copy and synchronizes the host; here they are laid out in one host buffer (pinned on
CUDA), copied with one ``non_blocking`` transfer, and handed out as views of the device buffer.
On CPU each array becomes its tensor as it is (``torch.from_numpy``): no buffer, no copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_ALIGN = 16  # bytes: every part starts aligned for any integer dtype (and vectorized loads)
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


class StepMetadata:
    """``add`` named integer arrays, then ``upload(device)`` once: a dict of device tensors."""

    def __init__(self) -> None:
        self._parts: list[tuple[str, np.ndarray, torch.dtype, tuple[int, ...]]] = []

    def add(self, name: str, values: Sequence[int] | Sequence[Sequence[int]] | np.ndarray,
            dtype: torch.dtype = torch.int64) -> None:
        if dtype not in _NUMPY:
            raise ValueError(f"metadata must be int32 or int64, got {dtype}")
        array = np.asarray(values, dtype=_NUMPY[dtype])
        self._parts.append((name, array.reshape(-1), dtype, array.shape))

    def upload(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        device = torch.device(device)
        if device.type == "cpu":  # nothing to transfer: each array is its tensor (no staging copy)
            return {name: torch.from_numpy(array).view(shape) for name, array, _, shape in self._parts}
        host, offsets = self.pack(pinned=device.type == "cuda")
        # The caching host allocator keeps a pinned block until the copy that reads it is done.
        return self._views(host.to(device, non_blocking=True), offsets)

    def pack(self, pinned: bool = False) -> tuple[torch.Tensor, list[int]]:
        """Every array in one host buffer (``self.host``, kept alive as long as the step), each at
        an aligned offset; returns the buffer and the offsets (``_views`` reads them)."""
        offsets, total = [], 0
        for _, array, _, _ in self._parts:
            offsets.append(total)
            total += -(-array.nbytes // _ALIGN) * _ALIGN
        host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=pinned)
        staging = host.numpy()
        for (_, array, _, _), offset in zip(self._parts, offsets):
            staging[offset: offset + array.nbytes] = array.view(np.uint8)
        self.host = host
        return host, offsets

    def _views(self, buffer: torch.Tensor, offsets: list[int]) -> dict[str, torch.Tensor]:
        """Each array's typed view of a packed ``buffer`` (the host one or its device copy)."""
        return {name: buffer[offset: offset + array.nbytes].view(dtype).view(shape)
                for (name, array, dtype, shape), offset in zip(self._parts, offsets)}
