"""Virtual-memory backends: reserve ranges, map physical pages into them, view them as tensors."""

from __future__ import annotations

import inspect

from vmemkv.errors import ConfigError
from vmemkv.vmm.base import MapStats, VirtualMemoryBackend, VirtualRange
from vmemkv.vmm.cpu import CpuBackend

__all__ = ["CpuBackend", "MapStats", "VirtualMemoryBackend", "VirtualRange", "create_backend"]


def create_backend(device: str, page_size: int, num_pages: int, **kwargs) -> VirtualMemoryBackend:
    """The backend for ``device`` ("cpu", or "cuda" / "cuda:N"); ``kwargs`` go to its constructor."""
    kind = str(device).split(":")[0]
    if kind == "cpu":
        return CpuBackend(page_size, num_pages, **kwargs)
    if kind == "cuda":
        from vmemkv.vmm.cuda import CudaBackend  # needs cuda-bindings; imported only when asked for

        if ":" in str(device) and "device" not in kwargs \
                and "device" in inspect.signature(CudaBackend).parameters:
            kwargs["device"] = device
        return CudaBackend(page_size, num_pages, **kwargs)
    raise ConfigError(f"unknown device {device!r}; use 'cpu' or 'cuda'")
