"""``dtype="auto"``, as vLLM's: the checkpoint's dtype where the device computes it natively.

vLLM users run the dtype their checkpoint was published in (bfloat16 for nearly every current
model), so the engine does too: on CUDA a half-precision checkpoint keeps its dtype and a float32
one runs in bfloat16; on a CPU a bfloat16 checkpoint runs in bfloat16 where the CPU has bfloat16
dot products (AVX-512 BF16 or AMX), a float16 one in float16 where it has AVX-512 FP16 or AMX-FP16,
and everything else in float32 (an AVX2-only CPU widens every bfloat16 product: slower than
float32, never faster). ``dtype="float32"`` gives outputs bit-equal to Hugging Face ``generate``
in float32, which the tests compare token for token.
"""

from __future__ import annotations

import functools

import torch

# the CPU flags (/proc/cpuinfo) with which a CPU multiplies each half-precision dtype natively
NATIVE_CPU_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"),
                    torch.float16: ("avx512_fp16", "amx_fp16")}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This machine's CPU flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_computes(dtype: torch.dtype, flags: frozenset[str] | None = None) -> bool:
    """Whether a CPU with ``flags`` (this one's by default) computes ``dtype`` natively."""
    if dtype == torch.float32:
        return True
    flags = cpu_flags() if flags is None else flags
    return any(flag in flags for flag in NATIVE_CPU_FLAGS.get(dtype, ()))


def checkpoint_dtype(model_config) -> torch.dtype | None:
    """The dtype the model's config records (``dtype``, or the older ``torch_dtype``), if any."""
    for name in ("dtype", "torch_dtype"):
        value = getattr(model_config, name, None)
        if isinstance(value, str):
            value = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(value, torch.dtype):
            return value
    return None


def auto_dtype(recorded: torch.dtype | None, device: str,
               flags: frozenset[str] | None = None) -> tuple[torch.dtype, str]:
    """The dtype ``auto`` runs a checkpoint recorded in ``recorded`` on ``device``, and why."""
    recorded = recorded or torch.float32
    name = str(recorded).removeprefix("torch.")
    if str(device).startswith("cuda"):
        if recorded in (torch.bfloat16, torch.float16):
            return recorded, f"the checkpoint's {name}"
        return torch.bfloat16, f"bfloat16 on CUDA for a {name} checkpoint"
    if recorded == torch.float32:
        return torch.float32, "the checkpoint's float32"
    if cpu_computes(recorded, flags):
        native = "/".join(NATIVE_CPU_FLAGS[recorded])
        return recorded, f"the checkpoint's {name}, which this CPU computes natively ({native})"
    if recorded in NATIVE_CPU_FLAGS:
        wanted = " or ".join(NATIVE_CPU_FLAGS[recorded])
        return torch.float32, (f"float32: the checkpoint is {name}, but this CPU has no {wanted} "
                               "(it would widen every product); --dtype " + name + " forces it")
    return torch.float32, f"float32 for a {name} checkpoint"
