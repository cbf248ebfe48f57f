"""One host-to-device upload per step for the attention's index tensors.

A step needs several small integer tensors (where to write each new token, the decode rows, slot
ids, lengths, cu_seqlens, block tables). Each ``torch.tensor(list, device="cuda")`` is its own
pageable copy and synchronizes the host; here they are laid out in one host buffer (pinned on
CUDA), copied with one ``non_blocking`` transfer, and handed out as views of the device buffer.
On CPU the host buffer is the result: no copy at all.
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
        offsets, total = [], 0
        for _, array, _, _ in self._parts:
            offsets.append(total)
            total += -(-array.nbytes // _ALIGN) * _ALIGN
        pinned = device.type == "cuda"
        host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=pinned)
        staging = host.numpy()
        for (_, array, _, _), offset in zip(self._parts, offsets):
            staging[offset: offset + array.nbytes] = array.view(np.uint8)
        # The caching host allocator keeps a pinned block until the copy that reads it is done.
        buffer = host.to(device, non_blocking=True) if device.type != "cpu" else host
        self.host = host  # keep the staging buffer alive as long as the step
        return {name: buffer[offset: offset + array.nbytes].view(dtype).view(shape)
                for (name, array, dtype, shape), offset in zip(self._parts, offsets)}
