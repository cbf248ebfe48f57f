"""Where a decode step of ``LLM.generate`` goes, by cProfile: one timed ``generate`` of ``--batch``
requests of ``--prompt-tokens`` random token ids (their prefixes cached by a warm-up), each
decoding ``--new-tokens``, greedy, ``ignore_eos``; the functions with the most own time.

    python experiments/profile_generate.py --dtype bfloat16 --batch 32 --prompt-tokens 80
    python experiments/profile_generate.py --dtype bfloat16 --batch 4 --prompt-tokens 1500

Run with ``PYTHONPATH=<tree>`` to profile that tree's vmemkv (before/after comparisons). The
profiler's own cost is small here (the time is in a few hundred native calls a step), so its
per-step totals are close to an unprofiled run's.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

from vmemkv.engine import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=80)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, threads=args.threads, max_num_seqs=args.batch,
              max_model_len=args.prompt_tokens + args.new_tokens + 16)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.runcall(llm.generate, prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    print(f"{args.model} {args.dtype}, {args.batch} x {args.prompt_tokens} tokens, {args.new_tokens} steps: "
          f"{seconds / args.new_tokens * 1e3:.1f} ms a step, {args.batch * args.new_tokens / seconds:.1f} tok/s")
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
