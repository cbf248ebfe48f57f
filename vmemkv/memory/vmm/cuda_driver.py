"""The CUDA driver through cuda-python: loading the bindings, the one check every call goes through,
and what the backend's calls are made of (the device, allocation and access descriptors).

cuda-python is imported lazily (``load_driver``), so importing this module needs nothing beyond
the standard library; ``check_result`` and ``call_driver`` are tested on CPU against fake drivers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vmemkv.errors import ConfigError, CudaDriverError

_INSTALL_HINT = ("pip install cuda-bindings (or install vmemkv with the [cuda] extra: "
                 "pip install 'vmemkv[cuda]')")

# The allocation granularity of every GPU with VMM support so far: what the backend reports where
# the driver cannot be asked (no GPU, no cuda-python).
DEFAULT_GRANULARITY = 2 << 20


def load_driver() -> Any:
    """cuda-python's driver module: ``cuda.bindings.driver``, or ``cuda.cuda`` of old releases."""
    try:
        from cuda.bindings import driver  # cuda-python >= 12.6
        return driver
    except ImportError:
        pass
    try:
        from cuda import cuda as driver  # cuda-python < 12.6
        return driver
    except ImportError as exc:
        raise ConfigError(f"the CUDA backend needs cuda-python's driver bindings, which are not "
                          f"installed: {_INSTALL_HINT}") from exc


def _driver_text(driver: Any, getter: str, err: Any) -> str | None:
    try:
        status, text = getattr(driver, getter)(err)
    except Exception:  # the lookup itself must never hide the real error
        return None
    if status != driver.CUresult.CUDA_SUCCESS or not text:
        return None
    return text.decode() if isinstance(text, (bytes, bytearray)) else str(text)


def check_result(driver: Any, function: str, result: Any,
                 context: str | Callable[[], str] = "") -> Any:
    """Check what a cuda-python driver call returned: ``(CUresult, *values)``.

    Returns ``None`` when the call has no outputs, the value when it has one, else the tuple.
    Raises :class:`CudaDriverError` carrying the function, the driver's error name and string;
    ``context`` (a string, or a function making one, called only on failure) says what was asked.
    """
    if not isinstance(result, tuple):
        result = (result,)
    err, values = result[0], result[1:]
    if err != driver.CUresult.CUDA_SUCCESS:
        name = (_driver_text(driver, "cuGetErrorName", err) or getattr(err, "name", None)
                or f"CUresult {int(err)}")
        text = _driver_text(driver, "cuGetErrorString", err) or "no description"
        message = f"{function} failed: {name}: {text}"
        if callable(context):
            context = context()
        if context:
            message += f" ({context})"
        exc = CudaDriverError(message)
        exc.function, exc.error_name, exc.error_string, exc.code = function, name, text, int(err)
        raise exc
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def call_driver(driver: Any, function: str, *args: Any,
                context: str | Callable[[], str] = "") -> Any:
    """Call ``driver.<function>(*args)`` and check its result (see :func:`check_result`)."""
    return check_result(driver, function, getattr(driver, function)(*args), context)


def allocation_prop(driver: Any, ordinal: int) -> Any:
    """``CUmemAllocationProp`` for pinned memory on GPU ``ordinal``: what every page is made of."""
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    return prop


def allocation_granularity(driver: Any, prop: Any) -> int:
    """The driver's minimum allocation granularity (bytes) for pages made with ``prop``."""
    flags = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(call_driver(driver, "cuMemGetAllocationGranularity", prop, flags))


def access_desc(driver: Any, ordinal: int) -> Any:
    """``CUmemAccessDesc``: read and write for GPU ``ordinal``, what every mapping is opened with."""
    desc = driver.CUmemAccessDesc()
    desc.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = ordinal
    desc.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def resolve_device(device: "int | str | torch.device") -> "torch.device":
    """``device`` as ``cuda:<index>`` of a GPU this process sees (else ConfigError)."""
    import numpy as np
    import torch

    if isinstance(device, (int, np.integer)) and not isinstance(device, bool):
        dev = torch.device("cuda", int(device))
    else:
        dev = torch.device(device)
    if dev.type != "cuda":
        raise ConfigError(f"the CUDA backend needs a cuda device; got {dev}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    count = torch.cuda.device_count()
    if not 0 <= dev.index < count:
        raise ConfigError(f"GPU {dev.index} does not exist; this process sees {count} GPU(s) "
                          f"(0..{count - 1})")
    return dev
