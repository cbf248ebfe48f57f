"""Builds the native batch mapper (plain C, no CUDA needed at build time)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "vmemkv._native",
            sources=["native/vmemkv_native.c"],
            extra_compile_args=["-O2", "-std=c11", "-D_GNU_SOURCE"],
            libraries=["dl"],
        )
    ]
)
