"""The CUDA backend.

The first half runs everywhere: the pure logic the backend uses (run coalescing, the driver
result check against a fake driver, index validation, the DLPack view builder on CPU memory,
page copies through a window: ``vmemkv.memory.vmm.cuda``, ``cuda_driver``, ``dlpack`` and the shared
checks in ``base``), and the backend's driver protocol against a strict fake driver. The second half, ``TestOnGpu``, needs a CUDA GPU and
cuda-python and is skipped with the reason otherwise; ``experiments/gpu_check.sh`` runs it.
"""

from __future__ import annotations

import enum
import gc
import importlib.util
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vmemkv.errors import ConfigError, CudaDriverError, MappingError
from vmemkv.memory.vmm import base as vbase
from vmemkv.memory.vmm import cuda as vcuda
from vmemkv.memory.vmm import dlpack
from vmemkv.memory.vmm.base import VirtualRange


def _has_cuda_python() -> bool:
    for name in ("cuda.bindings.driver", "cuda.cuda"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ImportError:  # the parent package "cuda" is missing
            continue
    return False


HAS_GPU = torch.cuda.is_available()
HAS_CUDA_PYTHON = _has_cuda_python()
if not HAS_GPU:
    GPU_SKIP_REASON = "no CUDA GPU: torch.cuda.is_available() is False"
elif not HAS_CUDA_PYTHON:
    GPU_SKIP_REASON = "cuda-python is not installed: pip install cuda-bindings"
else:
    GPU_SKIP_REASON = ""

requires_gpu = pytest.mark.skipif(not (HAS_GPU and HAS_CUDA_PYTHON), reason=GPU_SKIP_REASON)


def _vrange(num_pages: int, page_size: int = 4096) -> VirtualRange:
    return VirtualRange(address=0, num_pages=num_pages, page_size=page_size,
                        page_table=np.full(num_pages, -1, dtype=np.int64))


# ============================================================================================
# CPU: pure logic
# ============================================================================================

class TestRuns:
    def test_consecutive_runs(self):
        assert vbase.consecutive_runs([]) == []
        assert vbase.consecutive_runs([4]) == [(4, 1)]
        assert vbase.consecutive_runs([0, 1, 2, 5, 6, 9]) == [(0, 3), (5, 2), (9, 1)]
        assert vbase.consecutive_runs(np.arange(10, 20)) == [(10, 10)]

    def test_paired_runs_need_both_sides_consecutive(self):
        src = np.array([0, 1, 2, 7, 8])
        dst = np.array([4, 5, 9, 10, 11])
        assert vbase.paired_runs(src, dst) == [(0, 4, 2), (2, 9, 1), (7, 10, 2)]
        assert vbase.paired_runs(np.zeros(0, np.int64), np.zeros(0, np.int64)) == []


class FakeResult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2


def _fake_driver(**functions):
    names = {1: b"CUDA_ERROR_INVALID_VALUE", 2: b"CUDA_ERROR_OUT_OF_MEMORY"}
    texts = {1: b"invalid argument", 2: b"out of memory"}
    driver = SimpleNamespace(
        CUresult=FakeResult,
        cuGetErrorName=lambda err: (FakeResult.CUDA_SUCCESS, names[int(err)]),
        cuGetErrorString=lambda err: (FakeResult.CUDA_SUCCESS, texts[int(err)]),
    )
    for name, fn in functions.items():
        setattr(driver, name, fn)
    return driver


class TestDriverCheck:
    def test_success_unpacks_outputs(self):
        driver = _fake_driver(
            cuNothing=lambda: (FakeResult.CUDA_SUCCESS,),
            cuOne=lambda x: (FakeResult.CUDA_SUCCESS, x + 1),
            cuTwo=lambda: (FakeResult.CUDA_SUCCESS, 1, 2),
        )
        assert vcuda.call_driver(driver, "cuNothing") is None
        assert vcuda.call_driver(driver, "cuOne", 41) == 42
        assert tuple(vcuda.call_driver(driver, "cuTwo")) == (1, 2)

    def test_failure_raises_with_function_name_and_driver_text(self):
        driver = _fake_driver(cuMemCreate=lambda *a: (FakeResult.CUDA_ERROR_OUT_OF_MEMORY, None))
        with pytest.raises(CudaDriverError) as info:
            vcuda.call_driver(driver, "cuMemCreate", 1, 2, 3, context="creating page 7 of 9")
        message = str(info.value)
        assert "cuMemCreate" in message
        assert "CUDA_ERROR_OUT_OF_MEMORY" in message
        assert "out of memory" in message
        assert "creating page 7 of 9" in message
        assert info.value.function == "cuMemCreate"
        assert info.value.error_name == "CUDA_ERROR_OUT_OF_MEMORY"
        assert info.value.code == 2

    def test_failing_error_lookup_falls_back_to_the_enum_name(self):
        def broken(err):
            raise RuntimeError("no driver")

        driver = _fake_driver(cuMemMap=lambda *a: (FakeResult.CUDA_ERROR_INVALID_VALUE,))
        driver.cuGetErrorName = broken
        driver.cuGetErrorString = lambda err: (FakeResult.CUDA_ERROR_INVALID_VALUE, None)
        with pytest.raises(CudaDriverError, match="cuMemMap failed: CUDA_ERROR_INVALID_VALUE"):
            vcuda.call_driver(driver, "cuMemMap", 0, 0, 0, 0, 0)

    def test_missing_cuda_python_is_a_config_error_with_the_install_hint(self, monkeypatch):
        for name in ("cuda", "cuda.bindings", "cuda.bindings.driver", "cuda.cuda"):
            monkeypatch.setitem(sys.modules, name, None)  # makes `import` raise ImportError
        with pytest.raises(ConfigError, match="pip install cuda-bindings"):
            vcuda.load_driver()

    @pytest.mark.skipif(HAS_GPU, reason="checks the error raised where there is no GPU")
    def test_backend_without_gpu_is_a_config_error(self):
        with pytest.raises(ConfigError, match="torch.cuda.is_available"):
            vcuda.CudaBackend(num_pages=4)

    def test_bad_num_pages_is_a_config_error(self):
        with pytest.raises(ConfigError, match="num_pages"):
            vcuda.CudaBackend(num_pages=0)


class TestValidation:
    def test_map_request_sorted_by_virtual_page(self):
        v, p = vcuda.validate_map_request(_vrange(8), [5, 1, 3], [0, 7, 2], pool_pages=8)
        assert v.tolist() == [1, 3, 5] and p.tolist() == [7, 2, 0]
        assert v.dtype == np.int64 and p.dtype == np.int64

    @pytest.mark.parametrize("virtual, physical, match", [
        ([8], [0], "virtual page 8 is outside the range of 8 pages"),
        ([-1], [0], "virtual page -1"),
        ([0], [4], "physical page 4 is outside the pool of 4 pages"),
        ([0], [-2], "physical page -2"),
        ([0, 1], [0], "2 virtual pages but 1 physical"),
        ([2, 2], [0, 1], "virtual page 2 appears twice"),
        ([0.5], [1], "integer page indices"),
    ])
    def test_bad_map_requests(self, virtual, physical, match):
        with pytest.raises(MappingError, match=match):
            vcuda.validate_map_request(_vrange(8), virtual, physical, pool_pages=4)

    def test_empty_requests(self):
        v, p = vcuda.validate_map_request(_vrange(8), [], [], pool_pages=4)
        assert v.size == 0 and p.size == 0
        assert vcuda.validate_unmap_request(_vrange(8), []).size == 0

    def test_unmap_request(self):
        assert vcuda.validate_unmap_request(_vrange(8), [6, 1, 6, 2]).tolist() == [1, 2, 6]
        with pytest.raises(MappingError, match="virtual page 8 is outside"):
            vcuda.validate_unmap_request(_vrange(8), [1, 8])


class TestViewsOnCpuMemory:
    """The DLPack view builder works the same on CPU memory, so its logic is tested here."""

    def test_tensor_from_address_shares_memory_and_frees_its_capsule(self):
        gc.collect()
        before = len(dlpack._LIVE_CAPSULES)
        buffer = np.zeros(256, dtype=np.uint8)
        t = dlpack.tensor_from_address(buffer.ctypes.data, buffer.nbytes, torch.device("cpu"))
        assert t.dtype == torch.uint8 and t.shape == (256,) and t.data_ptr() == buffer.ctypes.data
        t[10] = 77
        assert buffer[10] == 77
        buffer[11] = 5
        assert int(t[11]) == 5
        assert len(dlpack._LIVE_CAPSULES) == before + 1
        view = t[100:]
        del t
        gc.collect()
        assert len(dlpack._LIVE_CAPSULES) == before + 1  # a view keeps the storage alive
        del view
        gc.collect()
        assert len(dlpack._LIVE_CAPSULES) == before

    def test_bf16_strided_view(self):
        base = torch.zeros(4096, dtype=torch.uint8)
        # token-major [token][layer][k|v][head][dim]: 8 tokens, 2 layers, 2 heads, dim 16
        tokens, layers, heads, dim = 8, 2, 2, 16
        full = vbase.strided_view(base, torch.bfloat16, (tokens, layers, 2, heads, dim),
                                  (layers * 2 * heads * dim, 2 * heads * dim, heads * dim, dim, 1))
        values = torch.randn(tokens, layers, 2, heads, dim).to(torch.bfloat16)
        full.copy_(values)
        layer1_v = vbase.strided_view(base, torch.bfloat16, (tokens, heads, dim),
                                      (layers * 2 * heads * dim, dim, 1),
                                      offset_bytes=(2 * heads * dim + heads * dim) * 2)
        assert layer1_v.dtype == torch.bfloat16
        assert torch.equal(layer1_v, values[:, 1, 1])
        assert layer1_v.data_ptr() == base.data_ptr() + (2 * heads * dim + heads * dim) * 2

    def test_view_bounds(self):
        base = torch.zeros(1024, dtype=torch.uint8)
        assert vbase.strided_view(base, torch.float32, (256,), (1,)).shape == (256,)
        assert vbase.strided_view(base, torch.float32, (255,), (1,), 4).shape == (255,)
        assert vbase.strided_view(base, torch.float32, (0, 5), (5, 1), 1024).numel() == 0
        with pytest.raises(MappingError, match="reaches byte 1028 but the range holds 1024"):
            vbase.strided_view(base, torch.float32, (256,), (1,), 4)
        with pytest.raises(MappingError):
            vbase.strided_view(base, torch.float16, (2, 300), (300, 1))
        with pytest.raises(ConfigError, match="multiple of the"):
            vbase.strided_view(base, torch.float32, (4,), (1,), 2)
        with pytest.raises(ConfigError, match="one stride per dim"):
            vbase.strided_view(base, torch.float32, (4, 4), (1,))
        with pytest.raises(ConfigError, match="non-negative"):
            vbase.strided_view(base, torch.float32, (4,), (-1,), 64)


class TestCopyWindowPages:
    @staticmethod
    def _window(num_pages=32, page_size=64):
        return torch.randint(0, 256, (num_pages, page_size), dtype=torch.uint8)

    def test_runs_and_scattered(self):
        w = self._window()
        old = w.clone()
        vbase.copy_window_pages(w, [0, 1, 2, 9], [20, 21, 22, 5])
        for s, d in [(0, 20), (1, 21), (2, 22), (9, 5)]:
            assert torch.equal(w[d], old[s])
        untouched = [i for i in range(32) if i not in (20, 21, 22, 5)]
        assert torch.equal(w[untouched], old[untouched])

    def test_many_scattered_pages_go_through_chunked_gathers(self):
        w = self._window(64)
        old = w.clone()
        src = np.arange(0, 40, 2)
        dst = np.arange(41, 61)[::-1].copy()
        vbase.copy_window_pages(w, src, dst, chunk_pages=3, max_run_copies=2)
        assert torch.equal(w[torch.as_tensor(dst)], old[torch.as_tensor(src)])

    def test_overlapping_sources_and_targets_read_before_write(self):
        w = self._window()
        old = w.clone()
        vbase.copy_window_pages(w, [0, 1, 2], [1, 2, 3])
        assert torch.equal(w[1:4], old[0:3])
        assert torch.equal(w[0], old[0])

    def test_errors(self):
        w = self._window(8)
        with pytest.raises(MappingError, match="destination page 8 is outside the pool of 8"):
            vbase.copy_window_pages(w, [0], [8])
        with pytest.raises(MappingError, match="source page -1"):
            vbase.copy_window_pages(w, [-1], [0])
        with pytest.raises(MappingError, match="same destination page twice"):
            vbase.copy_window_pages(w, [0, 1], [3, 3])
        with pytest.raises(MappingError, match="2 sources but 1 destinations"):
            vbase.copy_window_pages(w, [0, 1], [3])
        vbase.copy_window_pages(w, [], [])
        vbase.copy_window_pages(w, [2], [2])


# ============================================================================================
# CPU: the backend's driver protocol, against a strict fake of the driver's VMM rules
# ============================================================================================

class FakeVmmDriver:
    """Enough of ``cuda.bindings.driver`` to run CudaBackend, enforcing the rules of the real
    VMM API that the backend must respect: granularity alignment, no mapping over a mapping,
    unmapping whole mappings only, access only on mapped addresses, freeing only empty
    reservations of the exact size, releasing known handles once, a per-thread context stack."""

    GRANULARITY = 2 << 20

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1
        CUDA_ERROR_OUT_OF_MEMORY = 2
        CUDA_ERROR_INVALID_CONTEXT = 201

    CUdevice_attribute = SimpleNamespace(
        CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED="vmm")
    CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED="pinned")
    CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE="device")
    CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE="rw")
    CUmemAllocationGranularity_flags = SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM="min")

    @staticmethod
    def CUmemAllocationProp():
        return SimpleNamespace(type=None, location=SimpleNamespace(type=None, id=None))

    @staticmethod
    def CUmemAccessDesc():
        return SimpleNamespace(flags=None, location=SimpleNamespace(type=None, id=None))

    def __init__(self, memory_pages: int = 1 << 20):
        ok = self.CUresult.CUDA_SUCCESS
        self.OK, self.BAD = ok, self.CUresult.CUDA_ERROR_INVALID_VALUE
        self.log: list[tuple] = []
        self.reservations: dict[int, int] = {}
        self.mappings: dict[int, tuple[int, int]] = {}  # address -> (size, handle)
        self.accessible: set[int] = set()  # mapping start addresses opened for the device
        self.handles: dict[int, int] = {}  # handle -> size
        self.memory_left = memory_pages * self.GRANULARITY
        self.next_address, self.next_handle = 1 << 40, 1
        self.retained = 0
        self.stacks: dict[int, list[int]] = {}
        self.primary_context = 0xC0

    # -- helpers
    def _stack(self):
        return self.stacks.setdefault(threading.get_ident(), [])

    def _need_context(self):
        stack = self._stack()
        return bool(stack) and stack[-1] == self.primary_context

    def cuGetErrorName(self, err):
        return self.OK, self.CUresult(err).name.encode()

    def cuGetErrorString(self, err):
        return self.OK, b"fake driver error"

    # -- device and context
    def cuInit(self, flags):
        return (self.OK,)

    def cuDeviceGet(self, ordinal):
        return (self.OK, ordinal) if ordinal == 0 else (self.BAD, None)

    def cuDeviceGetAttribute(self, attribute, device):
        return self.OK, 1

    def cuDevicePrimaryCtxRetain(self, device):
        self.retained += 1
        return self.OK, self.primary_context

    def cuDevicePrimaryCtxRelease(self, device):
        self.retained -= 1
        return (self.OK,)

    def cuCtxGetCurrent(self):
        stack = self._stack()
        return self.OK, (stack[-1] if stack else 0)

    def cuCtxPushCurrent(self, ctx):
        self._stack().append(int(ctx))
        return (self.OK,)

    def cuCtxPopCurrent(self):
        stack = self._stack()
        return (self.OK, stack.pop()) if stack else (self.CUresult.CUDA_ERROR_INVALID_CONTEXT, 0)

    # -- memory
    def cuMemGetAllocationGranularity(self, prop, option):
        assert prop.type == "pinned" and prop.location.type == "device" and prop.location.id == 0
        return self.OK, self.GRANULARITY

    def cuMemCreate(self, size, prop, flags):
        if not self._need_context() or size % self.GRANULARITY or flags != 0:
            return self.BAD, None
        if size > self.memory_left:
            return self.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None
        self.memory_left -= size
        handle, self.next_handle = self.next_handle, self.next_handle + 1
        self.handles[handle] = size
        return self.OK, handle

    def cuMemRelease(self, handle):
        if handle not in self.handles:
            return (self.BAD,)
        self.memory_left += self.handles.pop(handle)
        return (self.OK,)

    def cuMemAddressReserve(self, size, alignment, addr, flags):
        if size % self.GRANULARITY or alignment & (alignment - 1) or flags != 0:
            return self.BAD, None
        address = self.next_address
        self.next_address += size + (1 << 30)
        self.reservations[address] = size
        return self.OK, address

    def cuMemAddressFree(self, ptr, size):
        if self.reservations.get(ptr) != size:
            return (self.BAD,)
        if any(ptr <= a < ptr + size for a in self.mappings):
            return (self.BAD,)  # still mapped
        del self.reservations[ptr]
        return (self.OK,)

    def _inside_reservation(self, ptr, size):
        return any(a <= ptr and ptr + size <= a + s for a, s in self.reservations.items())

    def cuMemMap(self, ptr, size, offset, handle, flags):
        self.log.append(("map", ptr, size, handle))
        if (not self._need_context() or ptr % self.GRANULARITY or offset != 0
                or self.handles.get(handle) != size or not self._inside_reservation(ptr, size)):
            return (self.BAD,)
        if any(a < ptr + size and ptr < a + s for a, (s, _) in self.mappings.items()):
            return (self.BAD,)  # CUDA cannot map over a mapping
        self.mappings[ptr] = (size, handle)
        return (self.OK,)

    def _covering(self, ptr, size):
        """Mapping starts that exactly tile [ptr, ptr+size), or None."""
        starts, at = [], ptr
        while at < ptr + size:
            if at not in self.mappings:
                return None
            starts.append(at)
            at += self.mappings[at][0]
        return starts if at == ptr + size else None

    def cuMemSetAccess(self, ptr, size, descs, count):
        self.log.append(("access", ptr, size))
        starts = self._covering(ptr, size)
        if starts is None or count != len(descs) or descs[0].flags != "rw" \
                or descs[0].location.id != 0:
            return (self.BAD,)
        self.accessible.update(starts)
        return (self.OK,)

    def cuMemUnmap(self, ptr, size):
        self.log.append(("unmap", ptr, size))
        starts = self._covering(ptr, size)
        if starts is None:
            return (self.BAD,)
        for a in starts:
            del self.mappings[a]
            self.accessible.discard(a)
        return (self.OK,)


@pytest.fixture
def fake(monkeypatch):
    driver = FakeVmmDriver()
    monkeypatch.setattr(vcuda, "load_driver", lambda: driver)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: driver.log.append(("sync",)))
    # Views over fake addresses: meta tensors have shapes and strides but no memory.
    monkeypatch.setattr(vcuda, "tensor_from_address",
                        lambda address, nbytes, device: torch.empty(nbytes, dtype=torch.uint8,
                                                                    device="meta"))
    return driver


class TestProtocolAgainstFakeDriver:
    def test_granularity_comes_from_the_driver(self, fake):
        from vmemkv.memory.vmm import device_granularity

        fake.GRANULARITY = 4 << 20
        assert device_granularity("cuda:0") == vcuda.CudaBackend.device_granularity(0) == 4 << 20
        b = vcuda.CudaBackend(num_pages=2)
        assert b.granularity == b.page_size == 4 << 20
        b.close()
        fake.cuInit = lambda flags: (fake.BAD,)  # a driver that cannot answer: the default
        assert device_granularity("cuda") == vcuda.DEFAULT_GRANULARITY == 2 << 20

    def test_lifecycle(self, fake):
        g = fake.GRANULARITY
        b = vcuda.CudaBackend(num_pages=8)
        assert b.page_size == g and len(fake.handles) == 8 and fake.retained == 1
        assert fake.cuCtxGetCurrent()[1] == 0  # the caller's (empty) context is restored
        r = b.reserve(6)
        b.map(r, [4, 0, 1, 5], [7, 2, 3, 0])
        assert r.page_table.tolist() == [2, 3, -1, -1, 7, 0]
        accesses = [e for e in fake.log if e[0] == "access"]
        assert accesses == [("access", r.address, 2 * g), ("access", r.address + 4 * g, 2 * g)]
        assert b.stats.map_calls == 4 and b.access_calls == 2 and b.stats.pages_mapped == 4
        assert fake.accessible == {r.address + k * g for k in (0, 1, 4, 5)}

        fake.log.clear()
        b.map(r, [1, 2], [6, 5])  # remap 1, fresh 2: unmap 1 (after a sync), then map both
        assert fake.log[0] == ("sync",)
        assert fake.log[1] == ("unmap", r.address + g, g)
        assert ("access", r.address + g, 2 * g) in fake.log
        assert r.page_table.tolist() == [2, 6, 5, -1, 7, 0]

        fake.log.clear()
        b.unmap(r, [5, 0, 1, 2, 3])
        assert fake.log == [("sync",), ("unmap", r.address, 3 * g),
                            ("unmap", r.address + 5 * g, g)]
        assert r.page_table.tolist() == [-1, -1, -1, -1, 7, -1]
        assert b.stats.unmap_calls == 3 and b.stats.pages_unmapped == 5

        view = b.tensor(r, torch.bfloat16, (4, 8), (16, 1), offset_bytes=2 * g)
        assert view.shape == (4, 8) and view.stride() == (16, 1)
        assert view.storage_offset() == g
        window = b.pool_window()
        assert window.shape == (8, g)
        b.copy_pages([0, 1], [2, 3])

        b.release(r)
        assert r.address not in fake.reservations
        b.reserve(2)
        b.close()
        assert fake.mappings == {} and fake.reservations == {} and fake.handles == {}
        assert fake.retained == 0
        b.close()
        with pytest.raises(MappingError, match="closed"):
            b.reserve(1)

    def test_close_with_everything_still_mapped(self, fake):
        b = vcuda.CudaBackend(num_pages=4)
        r1, r2 = b.reserve(3), b.reserve(3)
        b.map(r1, [0, 1, 2], [0, 1, 2])
        b.map(r2, [0, 2], [3, 1])
        b.pool_window()
        b.close()
        assert fake.mappings == {} and fake.reservations == {} and fake.handles == {}

    def test_out_of_memory_names_the_request_and_frees_what_was_made(self, fake):
        fake.memory_left = 3 * fake.GRANULARITY
        with pytest.raises(CudaDriverError) as info:
            vcuda.CudaBackend(num_pages=5)
        message = str(info.value)
        assert "cuMemCreate" in message and "CUDA_ERROR_OUT_OF_MEMORY" in message
        assert "creating physical page 3 of 5" in message and "lower num_pages" in message
        assert fake.handles == {} and fake.retained == 0

    def test_page_size_rules(self, fake):
        g = fake.GRANULARITY
        with pytest.raises(ConfigError, match=f"page_size {g // 2} .* granularity {g} bytes"):
            vcuda.CudaBackend(page_size=g // 2, num_pages=2)
        assert fake.handles == {} and fake.retained == 0
        b = vcuda.CudaBackend(page_size=3 * g, num_pages=2)  # not a power of two: still aligned
        r = b.reserve(2)
        b.map(r, [0, 1], [1, 0])
        assert fake.mappings[r.address] == (3 * g, 2) and b.access_calls == 1
        b.close()

    def test_errors_before_driver_calls(self, fake):
        b = vcuda.CudaBackend(num_pages=2)
        r = b.reserve(2)
        calls = len(fake.log)
        with pytest.raises(MappingError):
            b.map(r, [0, 2], [0, 1])
        with pytest.raises(MappingError):
            b.map(r, [0], [2])
        with pytest.raises(MappingError, match="reaches byte"):
            b.tensor(r, torch.uint8, (r.size + 1,), (1,))
        assert len(fake.log) == calls and (r.page_table == -1).all()
        with pytest.raises(ConfigError, match="cuda device"):
            vcuda.CudaBackend(num_pages=1, device="cpu")
        with pytest.raises(ConfigError, match="GPU 3 does not exist"):
            vcuda.CudaBackend(num_pages=1, device=3)
        b.close()

    def test_a_failed_map_leaves_the_page_table_true(self, fake):
        b = vcuda.CudaBackend(num_pages=4)
        r = b.reserve(4)
        b.map(r, [0], [0])
        real_map = fake.cuMemMap
        calls = {"n": 0}

        def flaky_map(*args):
            calls["n"] += 1
            return (fake.BAD,) if calls["n"] == 3 else real_map(*args)

        fake.cuMemMap = flaky_map
        with pytest.raises(CudaDriverError, match="cuMemMap"):
            b.map(r, [1, 2, 3], [1, 2, 3])  # one run: the first two pages are rolled back
        assert r.page_table.tolist() == [0, -1, -1, -1]
        assert set(fake.mappings) == {r.address}
        fake.cuMemMap = real_map
        b.map(r, [1, 2, 3], [1, 2, 3])
        assert r.page_table.tolist() == [0, 1, 2, 3]
        b.close()
        assert fake.mappings == {} and fake.handles == {}


    def test_giving_pages_back_releases_their_handles_and_every_mapping(self, fake):
        g = fake.GRANULARITY
        b = vcuda.CudaBackend(num_pages=4)
        r = b.reserve(4)
        b.map(r, [0, 1, 2, 3], [3, 1, 2, 0])
        b.pool_window()
        memory = fake.memory_left
        fake.log.clear()
        assert b.discard_pages([1, 2, 2]) == 2
        assert fake.log[0] == ("sync",)  # the device may still read them
        assert r.page_table.tolist() == [3, -1, -1, 0]  # the range's mappings of them went
        assert fake.memory_left == memory + 2 * g  # the driver has the memory back
        assert len(fake.handles) == 2 and b.resident_bytes() == 2 * g
        window = b._window_address
        assert window + g not in fake.mappings and window + 2 * g not in fake.mappings
        assert b.stats.pages_discarded == 2
        assert b.discard_pages([1]) == 0  # given back already

        b.map(r, [2], [1])  # a map takes the page again: a new handle, in the window too
        assert r.page_table.tolist() == [3, -1, 1, 0] and len(fake.handles) == 3
        assert window + g in fake.mappings and window + g in fake.accessible
        b.take_pages([0, 2])  # page 2 again; page 0 has memory: left as it is
        assert len(fake.handles) == 4 and b.resident_bytes() == 4 * g
        assert fake.memory_left == memory
        b.close()
        assert fake.mappings == {} and fake.reservations == {} and fake.handles == {}

    def test_pages_given_back_before_the_window_is_made_are_left_out_of_it(self, fake):
        g = fake.GRANULARITY
        b = vcuda.CudaBackend(num_pages=4)
        b.discard_pages([1])
        window = b.pool_window()
        assert window.shape == (4, g)
        address = b._window_address
        assert address + g not in fake.mappings and len(fake.mappings) == 3
        b.copy_pages([0], [1])  # a copy onto a page given back takes it first
        assert address + g in fake.mappings and len(fake.handles) == 4
        b.discard_pages([0, 1, 2, 3])  # every page given back, then closed: nothing left over
        b.close()
        assert fake.mappings == {} and fake.reservations == {} and fake.handles == {}

    def test_a_failed_take_leaves_the_page_given_back(self, fake):
        b = vcuda.CudaBackend(num_pages=2)
        r = b.reserve(2)
        b.pool_window()
        b.discard_pages([0])
        fake.memory_left = 0  # another process took the GPU's memory meanwhile
        with pytest.raises(CudaDriverError, match="taking physical page 0 again"):
            b.map(r, [0], [0])
        assert r.page_table.tolist() == [-1, -1] and b.resident_bytes() == b.page_size
        fake.memory_left = fake.GRANULARITY
        real_map = fake.cuMemMap
        fake.cuMemMap = lambda *args: (fake.BAD,)  # the handle is made, the window refuses it
        with pytest.raises(CudaDriverError, match="in the window"):
            b.map(r, [0], [0])
        fake.cuMemMap = real_map
        b.map(r, [0], [0])  # the next take puts the page in the window, then maps it
        assert r.page_table.tolist() == [0, -1] and b._window_address in fake.mappings
        assert len(fake.handles) == 2
        b.close()
        assert fake.mappings == {} and fake.handles == {}


# ============================================================================================
# GPU: the real driver
# ============================================================================================

NUM_PAGES = 16


@pytest.fixture
def backend():
    b = vcuda.CudaBackend(num_pages=NUM_PAGES, device=0)
    yield b
    b.close()


def _fill_page(b, page: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=b.device).manual_seed(seed)
    data = torch.randint(0, 256, (b.page_size,), dtype=torch.uint8, device=b.device, generator=g)
    b.pool_window()[page].copy_(data)
    return data


def _bytes(b, vrange, first_page: int, num_pages: int = 1) -> torch.Tensor:
    return b.tensor(vrange, torch.uint8, (num_pages * b.page_size,), (1,),
                    first_page * b.page_size)


@requires_gpu
@pytest.mark.gpu
class TestOnGpu:
    def test_granularity_page_size_and_window(self, backend):
        b = backend
        assert b.granularity > 0 and b.granularity % 4096 == 0
        assert b.page_size == b.granularity
        w = b.pool_window()
        assert w.shape == (NUM_PAGES, b.page_size) and w.dtype == torch.uint8
        assert w.device == torch.device("cuda", 0)
        assert b.pool_window() is w

    def test_two_mappings_of_one_page_show_the_same_bytes(self, backend):
        b = backend
        r1, r2 = b.reserve(4), b.reserve(4)
        b.map(r1, [0], [3])
        b.map(r2, [2], [3])
        pattern = torch.randint(0, 256, (b.page_size,), dtype=torch.uint8, device=b.device)
        _bytes(b, r1, 0).copy_(pattern)
        assert torch.equal(_bytes(b, r2, 2), pattern)
        assert torch.equal(b.pool_window()[3], pattern)
        assert r1.page_table.tolist() == [3, -1, -1, -1]
        assert r2.page_table.tolist() == [-1, -1, 3, -1]

    def test_view_made_before_mapping_works_after(self, backend):
        b = backend
        r = b.reserve(2)
        view = _bytes(b, r, 0, 2)  # nothing mapped yet: making the view must not touch memory
        b.map(r, [0, 1], [6, 2])
        view.fill_(9)
        assert bool((b.pool_window()[6] == 9).all()) and bool((b.pool_window()[2] == 9).all())

    def test_contiguous_view_over_scattered_pages(self, backend):
        b = backend
        r = b.reserve(3)
        b.map(r, [0, 1, 2], [7, 2, 9])
        n = 3 * b.page_size // 4
        ints = b.tensor(r, torch.int32, (n,), (1,))
        ints.copy_(torch.arange(n, dtype=torch.int32, device=b.device))
        w = b.pool_window()
        per_page = b.page_size // 4
        for k, page in enumerate([7, 2, 9]):
            expect = torch.arange(k * per_page, (k + 1) * per_page, dtype=torch.int32,
                                  device=b.device)
            assert torch.equal(w[page].view(torch.int32), expect)

    def test_unmap_then_map_another_page_at_the_same_address(self, backend):
        b = backend
        one, two = _fill_page(b, 1, seed=1), _fill_page(b, 2, seed=2)
        r = b.reserve(2)
        view = _bytes(b, r, 0)
        b.map(r, [0], [1])
        assert torch.equal(view, one)
        b.unmap(r, [0])
        assert r.page_table.tolist() == [-1, -1]
        b.map(r, [0], [2])
        assert torch.equal(view, two)
        assert torch.equal(b.pool_window()[1], one)

    def test_remap_without_unmap_keeps_the_old_page_intact(self, backend):
        b = backend
        one, two = _fill_page(b, 1, seed=3), _fill_page(b, 2, seed=4)
        r = b.reserve(2)
        b.map(r, [0, 1], [1, 5])
        unmaps = b.stats.unmap_calls
        b.map(r, [0], [2])
        assert b.stats.unmap_calls == unmaps + 1
        assert r.page_table.tolist() == [2, 5]
        assert torch.equal(_bytes(b, r, 0), two)
        assert torch.equal(b.pool_window()[1], one)
        maps = b.stats.map_calls
        b.map(r, [0, 1], [2, 5])  # already there: no driver call
        assert b.stats.map_calls == maps

    def test_coalesced_access_and_unmap_calls(self, backend):
        b = backend
        r = b.reserve(8)
        maps, access = b.stats.map_calls, b.access_calls
        b.map(r, [6, 0, 5, 2, 1], [10, 11, 12, 13, 14])
        assert b.stats.map_calls - maps == 5  # one cuMemMap per page (a handle is one page)
        assert b.access_calls - access == 2  # runs 0..2 and 5..6
        assert r.page_table.tolist() == [11, 14, 13, -1, -1, 12, 10, -1]
        _bytes(b, r, 0, 3).fill_(1)
        _bytes(b, r, 5, 2).fill_(2)
        unmaps, pages = b.stats.unmap_calls, b.stats.pages_unmapped
        b.unmap(r, [6, 0, 5, 2, 1, 3])  # 3 is not mapped: nothing to do for it
        assert b.stats.unmap_calls - unmaps == 2
        assert b.stats.pages_unmapped - pages == 5
        assert (r.page_table == -1).all()
        w = b.pool_window()
        assert bool((w[[11, 14, 13]] == 1).all()) and bool((w[[12, 10]] == 2).all())

    def test_bf16_strided_views_and_sdpa(self, backend):
        b = backend
        layers, heads, dim = 2, 4, 64
        token_bytes = layers * 2 * heads * dim * 2
        tokens = 2 * b.page_size // token_bytes
        r = b.reserve(4)
        b.map(r, [0, 1], [5, 1])
        token_stride = layers * 2 * heads * dim
        full = b.tensor(r, torch.bfloat16, (tokens, layers, 2, heads, dim),
                        (token_stride, 2 * heads * dim, heads * dim, dim, 1))
        values = torch.randn(tokens, layers, 2, heads, dim, device=b.device).to(torch.bfloat16)
        full.copy_(values)
        w = b.pool_window()
        through_window = torch.cat([w[5], w[1]]).view(torch.bfloat16).view(values.shape)
        assert torch.equal(through_window, values)
        for layer in range(layers):
            k = b.tensor(r, torch.bfloat16, (tokens, heads, dim), (token_stride, dim, 1),
                         offset_bytes=layer * 2 * heads * dim * 2)
            v = b.tensor(r, torch.bfloat16, (tokens, heads, dim), (token_stride, dim, 1),
                         offset_bytes=(layer * 2 * heads * dim + heads * dim) * 2)
            assert k.stride() == (token_stride, dim, 1)
            assert torch.equal(k, values[:, layer, 0]) and torch.equal(v, values[:, layer, 1])
            q = torch.randn(1, heads, 1, dim, device=b.device).to(torch.bfloat16)
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None])
            ref = torch.nn.functional.scaled_dot_product_attention(
                q, values[:, layer, 0].permute(1, 0, 2)[None].contiguous(),
                values[:, layer, 1].permute(1, 0, 2)[None].contiguous())
            torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)

    def test_copy_pages(self, backend):
        b = backend
        pages = {p: _fill_page(b, p, seed=10 + p) for p in range(4)}
        b.copy_pages([0, 1, 2], [8, 9, 12])
        w = b.pool_window()
        assert torch.equal(w[8], pages[0]) and torch.equal(w[9], pages[1])
        assert torch.equal(w[12], pages[2])
        b.copy_pages([0, 1, 2], [1, 2, 3])  # overlapping: all reads happen before writes
        assert torch.equal(w[1], pages[0]) and torch.equal(w[2], pages[1])
        assert torch.equal(w[3], pages[2]) and torch.equal(w[0], pages[0])
        r = b.reserve(1)
        b.map(r, [0], [12])
        assert torch.equal(_bytes(b, r, 0), pages[2])

    def test_mapping_errors_change_nothing(self, backend):
        b = backend
        r = b.reserve(4)
        b.map(r, [1], [0])
        maps = b.stats.map_calls
        with pytest.raises(MappingError, match="virtual page 4 is outside"):
            b.map(r, [0, 4], [1, 2])
        with pytest.raises(MappingError, match=f"physical page {NUM_PAGES} is outside"):
            b.map(r, [0, 2], [1, NUM_PAGES])
        with pytest.raises(MappingError, match="outside"):
            b.unmap(r, [9])
        assert r.page_table.tolist() == [-1, 0, -1, -1]
        assert b.stats.map_calls == maps

    def test_view_outside_the_range(self, backend):
        b = backend
        r = b.reserve(2)
        with pytest.raises(MappingError):
            b.tensor(r, torch.uint8, (r.size + 1,), (1,))
        with pytest.raises(MappingError):
            b.tensor(r, torch.bfloat16, (2, r.size // 4), (r.size // 4, 1), offset_bytes=2)
        with pytest.raises(ConfigError):
            b.tensor(r, torch.bfloat16, (4,), (1,), offset_bytes=1)

    def test_page_size_must_be_a_multiple_of_the_granularity(self, backend):
        g = backend.granularity
        for bad in (g // 2, g + g // 2):
            with pytest.raises(ConfigError) as info:
                vcuda.CudaBackend(page_size=bad, num_pages=1)
            assert str(g) in str(info.value) and str(bad) in str(info.value)

    @pytest.mark.parametrize("multiple", [2, 3])
    def test_larger_page_sizes(self, multiple, backend):
        g = backend.granularity
        with vcuda.CudaBackend(page_size=multiple * g, num_pages=3) as b:
            assert b.page_size == multiple * g
            r = b.reserve(2)
            b.map(r, [0, 1], [2, 0])
            _bytes(b, r, 0, 2).fill_(4)
            w = b.pool_window()
            assert w.shape == (3, multiple * g)
            assert bool((w[[2, 0]] == 4).all())

    def test_release_keeps_page_contents(self, backend):
        b = backend
        data = _fill_page(b, 4, seed=5)
        r = b.reserve(3)
        b.map(r, [0, 1], [4, 6])
        unmaps = b.stats.unmap_calls
        b.release(r)
        assert b.stats.unmap_calls == unmaps + 1
        assert (r.page_table == -1).all()
        assert torch.equal(b.pool_window()[4], data)
        with pytest.raises(MappingError, match="released"):
            b.map(r, [0], [1])
        with pytest.raises(MappingError):
            b.release(r)

    def test_pages_given_back_free_device_memory_and_come_back_writable(self, backend):
        b = backend
        r = b.reserve(4)
        b.map(r, [0, 1, 2, 3], [0, 1, 2, 3])
        kept = {page: _fill_page(b, page, seed=page) for page in (0, 3)}
        window = b.pool_window()
        free_before = torch.cuda.mem_get_info(b.device)[0]
        assert b.discard_pages([1, 2]) == 2
        assert r.page_table.tolist() == [0, -1, -1, 3]
        assert torch.cuda.mem_get_info(b.device)[0] >= free_before + 2 * b.page_size
        assert b.resident_bytes() == (NUM_PAGES - 2) * b.page_size
        for page, data in kept.items():  # the pages kept, read through the range and the window
            assert torch.equal(_bytes(b, r, page), data) and torch.equal(window[page], data)
        b.map(r, [1, 2], [2, 1])  # taken again: new memory, mapped in the window as before
        data = _fill_page(b, 2, seed=9)
        assert torch.equal(_bytes(b, r, 1), data)
        assert b.resident_bytes() == NUM_PAGES * b.page_size

    def test_mapping_from_another_thread_leaves_its_context_alone(self, backend):
        b = backend
        data = _fill_page(b, 7, seed=6)
        driver = vcuda.load_driver()
        result = {}

        def work():
            try:
                r = b.reserve(1)
                b.map(r, [0], [7])
                result["range"] = r
                result["ctx_after"] = int(vcuda.call_driver(driver, "cuCtxGetCurrent"))
            except BaseException as exc:  # reported below
                result["error"] = exc

        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        assert "error" not in result, result.get("error")
        assert result["ctx_after"] == 0  # pushed and popped: the new thread had no context
        assert torch.equal(_bytes(b, result["range"], 0), data)

    def test_driver_errors_are_ours(self, backend):
        with pytest.raises(CudaDriverError,
                           match="cuDeviceGet failed: CUDA_ERROR_INVALID_(DEVICE|VALUE)"):
            backend._call("cuDeviceGet", 9999)

    def test_close_is_idempotent_and_frees_memory(self):
        torch.cuda.synchronize()
        free_before, _ = torch.cuda.mem_get_info(0)
        b = vcuda.CudaBackend(num_pages=64)
        size = 64 * b.page_size
        r = b.reserve(4)
        b.map(r, [0, 1, 3], [0, 1, 2])
        b.pool_window()
        free_during, _ = torch.cuda.mem_get_info(0)
        assert free_before - free_during >= size * 0.9
        b.close()
        b.close()
        free_after, _ = torch.cuda.mem_get_info(0)
        assert free_after - free_during >= size * 0.9
        with pytest.raises(MappingError, match="closed"):
            b.reserve(1)
        with pytest.raises(MappingError, match="closed"):
            b.map(r, [0], [0])

    def test_reading_an_unmapped_page_faults_in_a_child_process(self):
        # A fault poisons the CUDA context for good, so it happens in a child process.
        script = textwrap.dedent("""
            import torch
            from vmemkv.memory.vmm.cuda import CudaBackend
            b = CudaBackend(num_pages=2)
            r = b.reserve(2)
            b.map(r, [0], [1])
            view = b.tensor(r, torch.uint8, (2 * b.page_size,), (1,))
            print("VIEW_OK", int(view[: b.page_size].sum()), flush=True)
            print("SUM", int(view[b.page_size:].sum()), flush=True)
            torch.cuda.synchronize()
            print("NO_FAULT", flush=True)
        """)
        root = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True,
                              text=True, timeout=180, env=env)
        assert "VIEW_OK" in proc.stdout, proc.stderr[-2000:]
        assert "NO_FAULT" not in proc.stdout
        assert proc.returncode != 0
