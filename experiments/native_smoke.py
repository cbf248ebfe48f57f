"""The C batch mapper (``vmemkv._native``) maps real pages: built for another interpreter (the GPU
image's Python 3.12), it is loaded from its build folder with nothing but the standard library,
two memfd pages are mapped out of order into a reservation, and bytes written through a second
mapping of the memfd are read back through the reservation.

    python3.12 experiments/native_smoke.py BUILD_LIB   # the folder holding vmemkv/_native*.so
"""

from __future__ import annotations

import array
import ctypes
import glob
import importlib.util
import os
import sys

PAGE = 64 << 10


def load_native(build_lib: str):
    found = glob.glob(os.path.join(build_lib, "vmemkv", "_native*.so"))
    if len(found) != 1:
        sys.exit(f"native_smoke: expected one vmemkv/_native*.so under {build_lib}, found {found}")
    spec = importlib.util.spec_from_file_location("vmemkv._native", found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, found[0]


def main(build_lib: str) -> None:
    native, path = load_native(build_lib)
    fd = os.memfd_create("vmemkv-native-smoke")
    os.ftruncate(fd, 2 * PAGE)
    writer = native.map_shared(fd, 2 * PAGE)
    base = native.reserve(4 * PAGE, PAGE)
    table = array.array("q", [-1] * 4)
    # physical page 1 at virtual page 0, physical page 0 at virtual page 2
    calls, vma_delta = native.map_batch(fd, base, PAGE, 2, table, array.array("q", [0, 2]),
                                        array.array("q", [1, 0]), 1 << 20)
    assert list(table) == [1, -1, 0, -1], list(table)
    ctypes.memmove(writer, b"page zero", 9)
    ctypes.memmove(writer + PAGE, b"page one", 8)
    assert ctypes.string_at(base, 8) == b"page one"
    assert ctypes.string_at(base + 2 * PAGE, 9) == b"page zero"
    native.unmap_batch(base, PAGE, table, array.array("q", [0, 2]), 1 << 20)
    assert list(table) == [-1] * 4, list(table)
    native.release(base, 4 * PAGE)
    native.release(writer, 2 * PAGE)
    os.close(fd)
    print(f"native_smoke: ok on Python {sys.version.split()[0]} ({os.path.basename(path)}: "
          f"{calls} map call(s), vma delta {vma_delta})")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
