"""Virtual-memory backends: reserve ranges, map physical pages into them, view them as tensors."""

from __future__ import annotations

from vmemkv.errors import ConfigError
from vmemkv.memory.vmm.base import MapStats, VirtualMemoryBackend, VirtualRange
from vmemkv.memory.vmm.cpu import CpuBackend

__all__ = ["CpuBackend", "DEFAULT_DEVICE", "MapStats", "VirtualMemoryBackend", "VirtualRange",
           "backend_class", "create_backend", "device_granularity"]

DEFAULT_DEVICE = "cpu"  # CacheConfig.device's default


def _device_kind(device: str) -> str:
    kind = str(device).split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {device!r}; use 'cpu' or 'cuda'")
    return kind


def backend_class(device: str) -> type[VirtualMemoryBackend]:
    """The backend class for ``device`` ("cpu", or "cuda" / "cuda:N"): what the cache asks of
    the device (filler pages, hole pages, host copies) before it builds one."""
    if _device_kind(device) == "cpu":
        return CpuBackend
    from vmemkv.memory.vmm.cuda import CudaBackend  # imports without a GPU; builds need one

    return CudaBackend


def create_backend(device: str, page_size: int, num_pages: int, **kwargs) -> VirtualMemoryBackend:
    """The backend for ``device`` ("cpu", or "cuda" / "cuda:N"); ``kwargs`` go to its constructor."""
    if _device_kind(device) == "cpu":
        return CpuBackend(page_size, num_pages, **kwargs)
    from vmemkv.memory.vmm.cuda import CudaBackend  # needs cuda-bindings; imported only when asked for

    if ":" in str(device):
        kwargs.setdefault("device", device)
    return CudaBackend(page_size, num_pages, **kwargs)


def device_granularity(device: str) -> int:
    """The bytes that page sizes on ``device`` ("cpu", "cuda", "cuda:N") must be multiples of.

    The OS page on CPU; on CUDA the driver's allocation granularity where a GPU and cuda-python
    are present, else the documented 2 MiB (so configuring for a GPU works on a CPU machine).
    """
    if _device_kind(device) == "cpu":
        return CpuBackend.granularity
    from vmemkv.memory.vmm.cuda import CudaBackend

    return CudaBackend.device_granularity(device)
