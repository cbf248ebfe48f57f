"""Builds the native parts (plain C, no CUDA or torch needed at build time): the batch page mapper,
and the CPU decode and prefill attention, linear layers, RMS norm and rotary embedding. The last four are
optional: where they do not build (no C compiler with OpenMP), the engine runs SDPA, oneDNN's linear
layers and the model's own norm and rotary embedding on the CPU instead. VMEMKV_NATIVE_CPU_KERNELS=0
leaves those out of the build (experiments/gpu_check.sh on a GPU machine: the CPU decode attention
alone takes ~45 s to compile on one core)."""

import os

from setuptools import Extension, setup

MAPPER = Extension(
    "vmemkv._native",
    sources=["native/vmemkv_native.c"],
    extra_compile_args=["-O2", "-std=c11", "-D_GNU_SOURCE"],
    libraries=["dl"],
)

def cpu_kernel(name: str, *flags: str, headers: tuple[str, ...] = ("bf16.h",)) -> Extension:
    """native/<name>.c as the optional extension vmemkv._<name>: -O3, OpenMP, and ``flags``."""
    return Extension(f"vmemkv._{name}", sources=[f"native/{name}.c"], depends=[f"native/{h}" for h in headers],
                     extra_compile_args=["-O3", "-std=gnu11", "-fopenmp", *flags], extra_link_args=["-fopenmp"],
                     optional=True)


ATTENTION_HEADERS = ("bf16.h", "exp_nonpositive.h", "fp8.h")
CPU_KERNELS = [
    # no errno or traps from float math: its loops vectorize (compare-selects, tanhf); OpenMP: work
    # items on threads, simd reductions; -Wno-psabi: the vector helpers are always inlined, so no
    # call passes one across the ABI (the prefill attention and the linear layers' too)
    cpu_kernel("decode_attention", "-fno-math-errno", "-fno-trapping-math", "-Wno-psabi", headers=ATTENTION_HEADERS),
    cpu_kernel("prefill_attention", "-fno-math-errno", "-fno-trapping-math", "-Wno-psabi", headers=ATTENTION_HEADERS),
    cpu_kernel("rms_norm"),
    # no fused multiply-adds: each product rounds as transformers' tensor ops round it
    cpu_kernel("rotary", "-ffp-contract=off"),
    cpu_kernel("panel_linear", "-Wno-psabi"),
]

setup(
    # the extensions compile side by side, one per core: about a minute one after another on 2 cores
    options={"build_ext": {"parallel": os.cpu_count() or 1}},
    ext_modules=[MAPPER] + (CPU_KERNELS if os.environ.get("VMEMKV_NATIVE_CPU_KERNELS", "1") != "0" else []),
)
