"""Bytes of recurrent state per request for hybrid models, against their attention layers' KV
bytes per token (issue: hybrid models with recurrent state).

Each state layer holds a fixed state per request (``RecurrentStateSpec``: its parts' shapes and
dtypes, as the model computes them); each attention layer K and V per token. For each model shape
(Qwen3-Next-80B-A3B: transformers' ``Qwen3NextConfig`` defaults, which are that model's config, and
the engine's own ``state_specs``; Nemotron-H-8B: its published config, Mamba2 layers of a conv window
and an SSM state, given here as a spec since the engine does not serve it yet) this prints the
state's bytes per layer and per request, the pages a request's state takes in vmemkv's state group
on CUDA's 2 MiB pages, the KV bytes per token, how many tokens of KV one state weighs, and how many
requests of 8,192 tokens fit in 8 GiB (state pages + KV bytes). Model dtype bf16; the SSM / delta
state in float32 where the model computes it so (Qwen3-Next's delta rule); Nemotron-H both ways.

    python experiments/report_state_bytes.py                 # the table
    python experiments/report_state_bytes.py --json          # one JSON object
    python experiments/report_state_bytes.py --out experiments/results   # state_bytes.md / .json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import Qwen3NextConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import report_main  # noqa: E402

from vmemkv import CacheConfig  # noqa: E402
from vmemkv.cache.group import RecurrentStateGroup  # noqa: E402
from vmemkv.cache.kv_spec import RecurrentStateSpec, StatePart  # noqa: E402
from vmemkv.engine.models.state_mixers import state_specs  # noqa: E402

REQUEST_TOKENS = 8192
BUDGET_BYTES = 8 << 30
PAGE = 2 << 20  # CUDA pages
DTYPE = torch.bfloat16
# Nemotron-H-8B-Base-8K: 52 layers, 24 Mamba2 (M), 4 attention (*), 24 MLP (-)
NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"


def nemotron_h_8b(ssm_dtype: torch.dtype) -> tuple[RecurrentStateSpec, int, int, tuple[int, int]]:
    """Its Mamba2 state (conv window over x, B and C; SSM state per head), state and attention
    layer counts, and (KV heads, head dim)."""
    heads, head_dim, state, groups, kernel = 128, 64, 128, 8, 4
    conv_dim = heads * head_dim + 2 * groups * state
    spec = RecurrentStateSpec((StatePart("conv", (conv_dim, kernel), DTYPE),
                               StatePart("ssm", (heads, head_dim, state), ssm_dtype)))
    return spec, NEMOTRON_H_8B_PATTERN.count("M"), NEMOTRON_H_8B_PATTERN.count("*"), (8, 128)


def qwen3_next_80b() -> tuple[RecurrentStateSpec, int, int, tuple[int, int]]:
    config = Qwen3NextConfig()  # its defaults are Qwen3-Next-80B-A3B's
    specs = state_specs(config, DTYPE)
    state = [spec for spec in specs if spec is not None]
    return state[0], len(state), specs.count(None), (config.num_key_value_heads, config.head_dim)


def row(spec: RecurrentStateSpec, state_layers: int, attention_layers: int, kv: tuple[int, int]) -> dict:
    kv_per_token = 2 * kv[0] * kv[1] * 2 * attention_layers  # K and V, bf16, every attention layer
    state_request = spec.bytes_per_layer * state_layers
    config = CacheConfig(num_layers=attention_layers, num_kv_heads=kv[0], head_dim=kv[1], num_blocks=1,
                         max_num_seqs=1, max_model_len=REQUEST_TOKENS, dtype=DTYPE, device="cpu")
    pages = RecurrentStateGroup.state_config(config, spec, state_layers, PAGE).max_model_len
    request = pages * PAGE + REQUEST_TOKENS * kv_per_token
    return {
        "state": spec.describe(), "state_layers": state_layers, "attention_layers": attention_layers,
        "state_bytes_per_layer": spec.bytes_per_layer, "state_bytes_per_request": state_request,
        "state_pages_per_request": pages, "kv_bytes_per_token": kv_per_token,
        "state_in_kv_tokens": round(state_request / kv_per_token),
        "requests_in_budget": BUDGET_BYTES // request,
        "attention_only_requests_in_budget": BUDGET_BYTES // (REQUEST_TOKENS * kv_per_token),
    }


def report() -> dict:
    models = {"qwen3-next-80b-a3b": row(*qwen3_next_80b()),
              "nemotron-h-8b (SSM state bf16)": row(*nemotron_h_8b(torch.bfloat16)),
              "nemotron-h-8b (SSM state fp32)": row(*nemotron_h_8b(torch.float32))}
    return {"dtype": "bfloat16", "request_tokens": REQUEST_TOKENS, "budget_bytes": BUDGET_BYTES,
            "page_bytes": PAGE, "models": models}


def markdown(result: dict) -> str:
    lines = ["# Recurrent state per request against KV per token (bf16)", "",
             "`python experiments/report_state_bytes.py --out experiments/results`: each model's state "
             "(per layer, per request, in 2 MiB pages of vmemkv's state group), its attention layers' "
             "KV bytes per token, how many tokens of KV one request's state weighs, and requests of "
             "8,192 tokens in 8 GiB (state pages + KV; the last column: the attention layers alone).", "",
             "| model | state per layer | layers state / attention | state B / layer | state MiB / request "
             "| 2 MiB pages | KV B / token | state in KV tokens | requests in 8 GiB | without state |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in result["models"].items():
        lines.append(f"| {name} | {r['state']} | {r['state_layers']} / {r['attention_layers']} | "
                     f"{r['state_bytes_per_layer']:,} | {r['state_bytes_per_request'] / 2**20:.2f} | "
                     f"{r['state_pages_per_request']} | {r['kv_bytes_per_token']:,} | "
                     f"{r['state_in_kv_tokens']:,} | {r['requests_in_budget']} | "
                     f"{r['attention_only_requests_in_budget']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return report_main("state_bytes", __doc__.split("\n\n")[0], report, markdown, argv)


if __name__ == "__main__":
    sys.exit(main())
