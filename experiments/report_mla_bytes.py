"""KV bytes of multi-head latent attention (MLA) models: the latent rows vmemkv holds against the
decompressed per-head K and V a K/V cache would hold (issue: MLA served from its latent cache).

An MLA layer caches one row per token: the compressed KV (``kv_lora_rank``) and the rope'd shared
key (``qk_rope_head_dim``); its decompressed K is ``heads x (qk_nope_head_dim + qk_rope_head_dim)``
and its V ``heads x v_head_dim``. For each model shape (from the published Hugging Face configs)
this prints, in bf16, the bytes per token per layer either way, the latent layout vmemkv builds
(``CacheConfig(latent=True).make_layout()`` on CUDA's 2 MiB pages: tokens per page, padding), and
how many requests of 8,192 tokens fit in 8 GiB of KV memory either way (whole pages for the latent
layout; bytes alone for the decompressed one, which vmemkv does not build).

    python experiments/report_mla_bytes.py                 # the table
    python experiments/report_mla_bytes.py --json          # one JSON object
    python experiments/report_mla_bytes.py --out experiments/results   # mla_bytes.md / .json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import report_main  # noqa: E402

from vmemkv import CacheConfig  # noqa: E402

# name: (layers, heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim)
MODELS = {
    "deepseek-v3": (61, 128, 512, 64, 128, 128),
    "deepseek-v2": (60, 128, 512, 64, 128, 128),
    "minicpm3-4b": (62, 40, 256, 32, 64, 64),
}
REQUEST_TOKENS = 8192
BUDGET_BYTES = 8 << 30
GRANULARITY = 2 << 20  # CUDA pages
ITEMSIZE = 2  # bf16


def row(layers: int, heads: int, rank: int, rope: int, nope: int, value: int) -> dict:
    layout = CacheConfig(num_layers=layers, num_kv_heads=1, head_dim=rank + rope, num_blocks=1,
                         max_num_seqs=1, max_model_len=REQUEST_TOKENS, dtype=torch.bfloat16,
                         device="cpu", page_granularity=GRANULARITY, latent=True).make_layout()
    latent_request = layout.logical_pages_for(REQUEST_TOKENS) * layout.page_size
    decompressed = heads * (nope + rope + value) * ITEMSIZE
    decompressed_request = REQUEST_TOKENS * layers * decompressed
    return {
        "latent_bytes_per_token_per_layer": layout.kv_bytes_per_token_per_layer,
        "decompressed_bytes_per_token_per_layer": decompressed,
        "ratio": round(decompressed / layout.kv_bytes_per_token_per_layer, 1),
        "tokens_per_page": layout.tokens_per_page, "page_bytes": layout.page_size,
        "padding": round(layout.padding_fraction, 4),
        "latent_bytes_per_request": latent_request,
        "decompressed_bytes_per_request": decompressed_request,
        "latent_requests_in_budget": BUDGET_BYTES // latent_request,
        "decompressed_requests_in_budget": BUDGET_BYTES // decompressed_request,
    }


def report() -> dict:
    return {"dtype": "bfloat16", "request_tokens": REQUEST_TOKENS, "budget_bytes": BUDGET_BYTES,
            "granularity_bytes": GRANULARITY, "models": {name: row(*shape) for name, shape in MODELS.items()}}


def markdown(result: dict) -> str:
    lines = ["# KV bytes of MLA models: latent rows against decompressed K/V (bf16)", "",
             "`python experiments/report_mla_bytes.py --out experiments/results`: bytes per token per "
             "layer, the latent layout on 2 MiB CUDA pages, and how many 8,192-token requests fit in "
             "8 GiB of KV memory either way.", "",
             "| model | latent B / token / layer | decompressed B / token / layer | ratio | latent page "
             "| GiB per request latent / decompressed | requests in 8 GiB latent / decompressed |",
             "|---|---|---|---|---|---|---|"]
    for name, r in result["models"].items():
        page = (f"{r['tokens_per_page']} tok / {r['page_bytes'] >> 20} MiB"
                + (f" (+{r['padding']:.1%})" if r["padding"] else ""))
        lines.append(f"| {name} | {r['latent_bytes_per_token_per_layer']:,} | "
                     f"{r['decompressed_bytes_per_token_per_layer']:,} | {r['ratio']}x | {page} | "
                     f"{r['latent_bytes_per_request'] / 2**30:.2f} / {r['decompressed_bytes_per_request'] / 2**30:.1f} | "
                     f"{r['latent_requests_in_budget']} / {r['decompressed_requests_in_budget']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return report_main("mla_bytes", __doc__.split("\n\n")[0], report, markdown, argv)


if __name__ == "__main__":
    sys.exit(main())
