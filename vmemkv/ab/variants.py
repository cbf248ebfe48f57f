"""The A/B's variants: what each one sets in the engine (KV backend, layout, release behind a
sliding window, the prefix cache's lossy cold tier, quantized live KV), everything else being the same for all of
them."""

from __future__ import annotations

from dataclasses import dataclass

from vmemkv.ab.workloads import make_workload


@dataclass(frozen=True)
class Variant:
    name: str
    kv_backend: str
    layout: str
    description: str
    release: bool = True  # blocks behind a sliding window go back to the pool (else: every block kept)
    cold_tier: str = "off"  # the prefix cache's lossy cold tier ("int8", "int4"): its tokens may differ
    kv_cache_dtype: str = "auto"  # quantized live KV ("int8", "fp8"): its tokens may differ

    @property
    def lossy(self) -> bool:
        return self.cold_tier != "off" or self.kv_cache_dtype != "auto"

    def engine_fields(self, cold_cache_bytes: int = 0) -> dict:
        """Its EngineConfig fields; ``cold_cache_bytes``: a lossy variant's cold tier."""
        fields = {"kv_backend": self.kv_backend, "layout": self.layout,
                  "release_behind_window": self.release}
        if self.cold_tier != "off":
            fields.update(kv_cold_tier=self.cold_tier, kv_cold_cache_bytes=cold_cache_bytes)
        if self.kv_cache_dtype != "auto":
            fields.update(kv_cache_dtype=self.kv_cache_dtype)
        return fields


# How a block-table variant's blocks are read (attention/paged.py); the A/B summary says which
# of these ran.
PAGED_READS = ("the native CPU routines and the GPU kernels read the blocks in place; SDPA reads "
               "them gathered into a copy")

VARIANTS: dict[str, Variant] = {
    "vmem": Variant("vmem", "vmem", "token_major",
                    "virtually contiguous slots, token-major pages (all layers of each token)"),
    "paged": Variant("paged", "paged", "token_major",
                     f"block tables over the same pool ({PAGED_READS})"),
    "vmem-per-layer": Variant("vmem-per-layer", "vmem", "per_layer",
                              "virtually contiguous, vAttention's per-layer K/V tensors "
                              "(2 x layers map calls per page)"),
    "paged-per-layer": Variant("paged-per-layer", "paged", "per_layer",
                               "block tables over the per-layer pool (the same bytes as "
                               f"vmem-per-layer; {PAGED_READS})"),
    # The baselines for sliding-window models: O(length) KV per request, as without release.
    "vmem-keep": Variant("vmem-keep", "vmem", "token_major",
                         "vmem keeping every block: no release behind a sliding window, local "
                         "and global layers in one layout group", release=False),
    "paged-keep": Variant("paged-keep", "paged", "token_major",
                          "block tables keeping every block: no release behind a sliding window, "
                          "local and global layers in one group", release=False),
    # The lossy cold tier (vmemkv/cache/cold_tier.py): evicted cached pages kept compressed and
    # decompressed on a hit; greedy tokens are counted against vmem's, not required equal.
    "vmem-cold-int8": Variant("vmem-cold-int8", "vmem", "token_major",
                              "vmem with the prefix cache's lossy cold tier in int8 (--cold-cache-bytes)",
                              cold_tier="int8"),
    "vmem-cold-int4": Variant("vmem-cold-int4", "vmem", "token_major",
                              "vmem with the prefix cache's lossy cold tier in int4 (--cold-cache-bytes)",
                              cold_tier="int4"),
    # Quantized live KV (memory/quantized_rows.py): half the bytes a token; tokens counted, not required equal.
    "vmem-int8": Variant("vmem-int8", "vmem", "token_major",
                         "vmem with int8 K/V rows and a float32 scale per 32 values", kv_cache_dtype="int8"),
    "vmem-fp8": Variant("vmem-fp8", "vmem", "token_major",
                        "vmem with fp8 (e4m3) K/V rows and a float32 scale per 32 values",
                        kv_cache_dtype="fp8"),
    # ... and the same rows through block tables: the A/B of addressing at the quantized dtype
    "paged-int8": Variant("paged-int8", "paged", "token_major",
                          f"block tables over int8 K/V rows and their scales ({PAGED_READS})",
                          kv_cache_dtype="int8"),
    "paged-fp8": Variant("paged-fp8", "paged", "token_major",
                         f"block tables over fp8 (e4m3) K/V rows and their scales ({PAGED_READS})",
                         kv_cache_dtype="fp8"),
}
REFERENCE_VARIANT = "vmem"  # token ids of the other variants are compared with this one's
DEFAULT_VARIANTS = ("vmem", "paged", "vmem-per-layer", "paged-per-layer")
KEEP_VARIANTS = ("vmem-keep", "paged-keep")


def default_variants(workloads: list[str], model_name: str = "tiny-llama") -> list[str]:
    """Every layout and backend; with a sliding-window workload, the keep-every-block variants
    too (on the others they would only repeat vmem and paged); on a model keeping recurrent state,
    the virtual-memory variants only (see ``check_variants``)."""
    from vmemkv.engine.models.zoo import model_config

    windowed = any(make_workload(name, quick=True).sliding_window is not None for name in workloads)
    names = list(DEFAULT_VARIANTS) + (list(KEEP_VARIANTS) if windowed else [])
    if keeps_recurrent_state(model_config(model_name)):
        names = [name for name in names if VARIANTS[name].kv_backend == "vmem"]
    return names


def keeps_recurrent_state(config) -> bool:
    import torch  # here, not at import: `vmemkv --help` loads no torch

    from vmemkv.engine.models.state_mixers import state_specs

    return state_specs(config, torch.float32) is not None


def check_variants(variants: list[str], config, model_name: str) -> None:
    """A recurrent state is kept in virtual memory only (one contiguous range per slot): the
    block-table variants cannot run such a model, so the A/B says so before anything runs."""
    paged = [name for name in variants if VARIANTS[name].kv_backend != "vmem"]
    if paged and keeps_recurrent_state(config):
        vmem = [name for name in VARIANTS if VARIANTS[name].kv_backend == "vmem"]
        raise ValueError(f"{model_name} keeps a recurrent state per request, which is kept in virtual "
                         f"memory only: the block-table variant(s) {', '.join(paged)} cannot run it; "
                         f"choose --variants from {', '.join(vmem)}")
