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

CPU_KERNELS = [
    Extension(
        "vmemkv._decode_attention",
        sources=["native/decode_attention.c"],
        depends=["native/bf16.h", "native/exp_nonpositive.h", "native/fp8.h"],
        # no errno or traps from float math: its loops vectorize (compare-selects, tanhf);
        # OpenMP: work items on threads, simd reductions; -Wno-psabi: the 8-float vector
        # helpers are always inlined, so no call passes one across the ABI
        extra_compile_args=["-O3", "-std=gnu11", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
                            "-Wno-psabi"],
        extra_link_args=["-fopenmp"],
        optional=True,
    ),
    Extension(
        "vmemkv._prefill_attention",
        sources=["native/prefill_attention.c"],
        depends=["native/bf16.h", "native/exp_nonpositive.h", "native/fp8.h"],
        # as the decode attention: vectorized float math, OpenMP, inlined vector helpers
        extra_compile_args=["-O3", "-std=gnu11", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
                            "-Wno-psabi"],
        extra_link_args=["-fopenmp"],
        optional=True,
    ),
    Extension(
        "vmemkv._rms_norm",
        sources=["native/rms_norm.c"],
        depends=["native/bf16.h"],
        extra_compile_args=["-O3", "-std=gnu11", "-fopenmp"],
        extra_link_args=["-fopenmp"],
        optional=True,
    ),
    Extension(
        "vmemkv._rotary",
        sources=["native/rotary.c"],
        depends=["native/bf16.h"],
        # no fused multiply-adds: each product rounds as transformers' tensor ops round it
        extra_compile_args=["-O3", "-std=gnu11", "-fopenmp", "-ffp-contract=off"],
        extra_link_args=["-fopenmp"],
        optional=True,
    ),
    Extension(
        "vmemkv._panel_linear",
        sources=["native/panel_linear.c"],
        depends=["native/bf16.h"],
        # -Wno-psabi: the 16-float vector helpers are always inlined, no call passes one
        extra_compile_args=["-O3", "-std=gnu11", "-fopenmp", "-Wno-psabi"],
        extra_link_args=["-fopenmp"],
        optional=True,
    ),
]

setup(
    # the extensions compile side by side, one per core: about a minute one after another on 2 cores
    options={"build_ext": {"parallel": os.cpu_count() or 1}},
    ext_modules=[MAPPER] + (CPU_KERNELS if os.environ.get("VMEMKV_NATIVE_CPU_KERNELS", "1") != "0" else []),
)
