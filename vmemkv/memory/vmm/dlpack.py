"""Zero-copy torch tensors over raw addresses, through a DLPack capsule.

DLPack names the device explicitly, so torch never asks the driver about the pointer (which
``__cuda_array_interface__`` makes it do, and which fails on reserved addresses that have nothing
mapped yet), and creating a view never touches memory. Works the same on CPU memory, where it is
tested.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from vmemkv.errors import ConfigError

_DL_CPU, _DL_CUDA = 1, 2
_DL_UINT = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLDeleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                             ("deleter", _DLDeleter)]

# Structures handed to torch, kept alive until torch calls the deleter (when the tensor dies).
_LIVE_CAPSULES: dict[int, tuple[_DLManagedTensor, Any]] = {}


@_DLDeleter
def _release_capsule(managed: Any) -> None:
    try:
        _LIVE_CAPSULES.pop(ctypes.cast(managed, ctypes.c_void_p).value, None)
    except Exception:  # called from torch's deleter, maybe at interpreter shutdown
        pass


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_CAPSULE_NAME = b"dltensor"  # module-level: the capsule keeps a pointer to these bytes


def tensor_from_address(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A 1-D ``uint8`` tensor of ``nbytes`` bytes at ``address`` on ``device`` (zero copy).

    Nothing is read or written; the memory must outlive the tensor (the caller's job). On CUDA
    the device is named explicitly, so the address may be reserved and still unmapped.
    """
    shape = (ctypes.c_int64 * 1)(int(nbytes))
    managed = _DLManagedTensor()
    managed.dl_tensor.data = int(address)
    if device.type == "cuda":
        managed.dl_tensor.device = _DLDevice(_DL_CUDA, device.index or 0)
    elif device.type == "cpu":
        managed.dl_tensor.device = _DLDevice(_DL_CPU, 0)
    else:
        raise ConfigError(f"cannot view raw memory on device {device}; use cpu or cuda")
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _DLDataType(_DL_UINT, 8, 1)
    managed.dl_tensor.shape = shape
    managed.dl_tensor.strides = None
    managed.dl_tensor.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _release_capsule
    key = ctypes.addressof(managed)
    _LIVE_CAPSULES[key] = (managed, shape)
    try:
        capsule = _PyCapsule_New(key, _CAPSULE_NAME, None)
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        _LIVE_CAPSULES.pop(key, None)
        raise
