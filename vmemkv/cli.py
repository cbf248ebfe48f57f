"""The ``vmemkv`` command: ``vmemkv generate`` (offline) and ``vmemkv serve`` (OpenAI API).

Engine options are shared by every subcommand through ``add_engine_args``; options left unset
keep ``EngineConfig``'s own defaults.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine options (one per ``EngineConfig`` field)."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default="tiny-llama",
                       help="a built-in model name or a local Hugging Face model directory")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                       help="weights and KV dtype; auto: float32 on CPU, bfloat16 on CUDA")
    group.add_argument("--device", default=None, help="cpu or cuda[:N]; default: cuda if available")
    group.add_argument("--max-num-seqs", type=int, default=None,
                       help="sequences running at once (KV slots)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output, in tokens")
    group.add_argument("--num-blocks", type=int, default=None,
                       help="KV pool size in pages; default: derived from the other sizes")
    group.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="tokens computed per step (chunked prefill budget)")
    group.add_argument("--tokens-per-page", type=int, default=None, help="tokens in one KV page")
    group.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    group.add_argument("--preemption-mode", default=None, choices=["auto", "swap", "recompute"],
                       help="how a preempted request gives back its pages")
    group.add_argument("--swap-space-gb", type=float, default=None,
                       help="host memory for swapped-out KV pages, in GiB")
    group.add_argument("--kv-backend", default=None, choices=["vmem", "paged"],
                       help="vmem: virtually contiguous slots; paged: the block-table baseline")
    group.add_argument("--layout", default=None, choices=["token_major", "per_layer"],
                       help="KV layout in a page: all layers of a token (default) or vAttention's per layer")
    group.add_argument("--attention", default=None, choices=["auto", "sdpa", "triton"],
                       help="decode attention: triton (CUDA only, reads the cache in place) or sdpa")
    group.add_argument("--policy", default=None, choices=["fcfs", "priority"], help="scheduling policy")
    group.add_argument("--lookahead-tokens", type=int, default=None,
                       help="map the page of a decoding request's next N tokens in the background (0: off)")
    group.add_argument("--seed", type=int, default=None,
                       help="engine seed: makes sampling of unseeded requests reproducible")


def engine_config_from_args(args: argparse.Namespace):
    """An ``EngineConfig`` from parsed ``add_engine_args`` options."""
    from vmemkv.engine.config import EngineConfig

    device = args.device or _default_device()
    dtype = args.dtype
    if dtype == "auto":
        dtype = "float32" if device == "cpu" else "bfloat16"
    fields: dict[str, Any] = {
        "model": args.model,
        "dtype": dtype,
        "device": device,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "num_blocks": args.num_blocks,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "tokens_per_page": args.tokens_per_page,
        "enable_prefix_caching": not args.no_prefix_caching,
        "preemption_mode": args.preemption_mode,
        "swap_space_bytes": None if args.swap_space_gb is None else int(args.swap_space_gb * 2**30),
        "seed": args.seed,
        "kv_backend": args.kv_backend,
        "layout": args.layout,
        "policy": args.policy,
        "attention": args.attention,
        "lookahead_tokens": args.lookahead_tokens,
    }
    # Unset options keep EngineConfig's defaults (num_blocks=None means "derive" there too).
    return EngineConfig(**{name: value for name, value in fields.items() if value is not None})


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _build_engine(args: argparse.Namespace):
    from vmemkv.engine.llm_engine import LLMEngine

    return LLMEngine(engine_config_from_args(args))


# ---- vmemkv generate --------------------------------------------------------------------------

def _add_generate_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="complete prompts offline and print the results")
    add_engine_args(parser)
    parser.add_argument("--prompt", action="append", required=True,
                        help="a prompt (repeat the option for several)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 is off")
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--n", type=int, default=1, help="completions per prompt")
    parser.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from vmemkv.engine.sampling_params import SamplingParams

    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p,
                            max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos)
    engine = _build_engine(args)
    for i, prompt in enumerate(args.prompt):
        engine.add_request(str(i), prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    many = len(args.prompt) > 1 or args.n > 1
    for i, prompt in enumerate(args.prompt):
        for completion in finished[str(i)].outputs:
            if many:
                print(f"--- prompt {i}, completion {completion.index} "
                      f"({completion.finish_reason}) ---")
            print(prompt + completion.text)
    return 0


# ---- vmemkv serve -----------------------------------------------------------------------------

def _add_serve_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve an OpenAI-compatible API")
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("VMEMKV_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $VMEMKV_API_KEY)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: --model)")
    parser.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from vmemkv.engine.server import run_server

    run_server(_build_engine(args), host=args.host, port=args.port, api_key=args.api_key,
               served_model_name=args.served_model_name)
    return 0


# ---- entry point ------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vmemkv", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(subparsers)
    _add_serve_parser(subparsers)
    _add_ab_parser(subparsers)
    return parser


def _add_ab_parser(subparsers) -> None:
    from vmemkv.ab.cli import add_ab_arguments  # its own model and sizes: no engine options

    add_ab_arguments(subparsers.add_parser(
        "ab", help="A/B: the same engine and requests on vmem slots vs block tables"))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as exc:  # bad options (ConfigError, RequestTooLongError are ValueErrors)
        print(f"vmemkv: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
