"""Page geometry of hybrid models' layer groups: what one shared pool needs (issue: one KV cache
coordinator for every model).

vLLM's hybrid allocator splits a model's layers into groups of equal size, each of one attention
kind, so that every group's block has the same bytes and one pool serves them all. In vmemkv's
token-major layout a page holds whole tokens of a group's layers, so the group size also sets the
tokens per page. For each model shape this prints, on CPU pages (4 KiB granules) and on CUDA's
2 MiB pages, bf16, the page vmemkv chooses (``CacheConfig.make_layout``: at least 16 tokens, at
most 7 % row padding):

* **today's split**: one group per kind (all local layers, all global layers), two pools whose
  blocks differ in bytes;
* **equal groups**: groups of ``g`` layers (``g`` = the fewest layers of any kind), every group's
  page the same size, so one pool.

Model shapes as in the models' published Hugging Face configs (layers, KV heads, head dim, kinds).

    python experiments/report_group_pages.py                 # the table
    python experiments/report_group_pages.py --json          # one JSON object
    python experiments/report_group_pages.py --out experiments/results   # group_pages.md / .json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import report_main  # noqa: E402

from vmemkv import CacheConfig  # noqa: E402

# name: (layers, kv heads, head dim, local layers per global layer, window)
MODELS = {
    "gemma-2-9b": (42, 8, 256, 1, 4096),
    "gemma-2-27b": (46, 16, 128, 1, 4096),
    "gemma-3-4b": (34, 4, 256, 5, 1024),
    "gemma-3-27b": (62, 16, 128, 5, 1024),
    "gpt-oss-20b": (24, 8, 64, 1, 128),
    "gpt-oss-120b": (36, 8, 64, 1, 128),
}
PAGES = {"cpu": 4096, "cuda": 2 << 20}


def kinds(layers: int, local_per_global: int) -> tuple[int, int]:
    """(local, global) layer counts: ``local_per_global`` local layers, then a global one."""
    num_global = sum(1 for i in range(layers) if i % (local_per_global + 1) == local_per_global)
    return layers - num_global, num_global


def page(layers: int, kv_heads: int, head_dim: int, granularity: int) -> dict:
    layout = CacheConfig(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, num_blocks=1,
                         max_num_seqs=1, max_model_len=16, dtype=torch.bfloat16, device="cpu",
                         page_granularity=granularity).make_layout()
    return {"layers": layers, "tokens_per_page": layout.tokens_per_page, "page_bytes": layout.page_size,
            "padding": round(layout.padding_fraction, 4)}


def report() -> dict:
    rows = {}
    for name, (layers, kv_heads, head_dim, ratio, window) in MODELS.items():
        num_local, num_global = kinds(layers, ratio)
        size = min(num_local, num_global)
        groups = -(-num_local // size) + -(-num_global // size)
        rows[name] = {
            "layers": layers, "local": num_local, "global": num_global, "window": window,
            "kv_heads": kv_heads, "head_dim": head_dim, "equal_group_layers": size,
            "equal_groups": groups, "padded_layers": groups * size - layers,
            **{device: {"split_local": page(num_local, kv_heads, head_dim, granule),
                        "split_global": page(num_global, kv_heads, head_dim, granule),
                        "equal": page(size, kv_heads, head_dim, granule)}
               for device, granule in PAGES.items()}}
    return {"dtype": "bfloat16", "granularity_bytes": PAGES, "models": rows}


def markdown(result: dict) -> str:
    def cell(p: dict) -> str:
        return (f"{p['tokens_per_page']} tok / {p['page_bytes'] >> 10} KiB"
                + (f" (+{p['padding']:.1%})" if p["padding"] else ""))
    lines = ["# Page geometry of hybrid layer groups (bf16)", "",
             "`python experiments/report_group_pages.py --out experiments/results`: tokens per page "
             "for today's split (all local layers / all global layers: two pools) and for equal "
             "groups of g layers (one pool: every group's page has the same bytes); CPU pages on "
             "4 KiB granules, CUDA on 2 MiB.", "",
             "| model | local : global | g (groups, padded layers) | CPU split local / global | "
             "CPU equal | CUDA split local / global | CUDA equal |",
             "|---|---|---|---|---|---|---|"]
    for name, row in result["models"].items():
        cpu, cuda = row["cpu"], row["cuda"]
        lines.append(f"| {name} | {row['local']} : {row['global']} | {row['equal_group_layers']} "
                     f"({row['equal_groups']}, {row['padded_layers']}) | {cell(cpu['split_local'])} / "
                     f"{cell(cpu['split_global'])} | {cell(cpu['equal'])} | {cell(cuda['split_local'])} / "
                     f"{cell(cuda['split_global'])} | {cell(cuda['equal'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return report_main("group_pages", __doc__.split("\n\n")[0], report, markdown, argv)


if __name__ == "__main__":
    sys.exit(main())
