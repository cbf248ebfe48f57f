"""The A/B harness's workloads: seeded, deterministic request sets, each with the engine sizes it
needs (pool, slots, step budget), identical for every variant.

Token ids are drawn from ``[1, 250]`` (bytes of the built-in models' byte vocabulary; the special
ids 256/257 never appear) and every request sets ``ignore_eos=True``, so prompt and output lengths
are exactly as drawn. ``quick=True`` gives a much smaller version of each workload for smoke runs
and tests.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine.sampling_params import SamplingParams

TOKEN_MIN, TOKEN_MAX = 1, 250

Request = tuple[str, list[int], SamplingParams]


@dataclass
class Workload:
    name: str
    description: str
    requests: list[Request]
    # EngineConfig fields this workload sets (pool size, slots, step budget, ...): every variant
    # gets the same values, so only the KV backend and layout differ between variants.
    engine: dict = field(default_factory=dict)
    greedy: bool = True  # greedy: all variants must give identical tokens
    expect_preemption: bool = False  # the pool is sized to force preemptions

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for _, ids, _ in self.requests)

    @property
    def num_output_tokens(self) -> int:
        """Tokens the requests will generate (all of them: ``ignore_eos``, ``n`` completions)."""
        return sum(params.max_tokens * params.n for _, _, params in self.requests)

    def describe(self) -> dict:
        prompts = [len(ids) for _, ids, _ in self.requests]
        return {"description": self.description, "num_requests": len(self.requests),
                "num_sequences": sum(p.n for _, _, p in self.requests),
                "prompt_tokens": self.num_prompt_tokens, "output_tokens": self.num_output_tokens,
                "prompt_len_min": min(prompts), "prompt_len_max": max(prompts),
                "greedy": self.greedy, "expect_preemption": self.expect_preemption,
                "engine": dict(self.engine)}


# --- helpers ----------------------------------------------------------------------------------------
def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randint(TOKEN_MIN, TOKEN_MAX) for _ in range(count)]


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    """A log-normal length with the given median, clipped to ``[low, high]``."""
    return int(min(max(round(rng.lognormvariate(math.log(median), sigma)), low), high))


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# --- the workloads ----------------------------------------------------------------------------------
def chat(seed: int = 0, quick: bool = False) -> Workload:
    """Chat-like traffic: log-normal prompt and output lengths (long tails, clipped), greedy."""
    rng = random.Random(f"chat-{seed}")
    count, prompt_cap, output_cap = (8, 128, 24) if quick else (24, 512, 96)
    requests = []
    for i in range(count):
        prompt = _lognormal(rng, 96, 0.8, 8, prompt_cap)
        output = _lognormal(rng, 24, 0.7, 4, output_cap)
        requests.append((f"chat-{i}", _tokens(rng, prompt), _greedy(output)))
    return Workload("chat", "mixed chat-like lengths: prompts log-normal (median 96, clipped to "
                    f"{prompt_cap}), outputs log-normal (median 24, clipped to {output_cap}), greedy",
                    requests, {"max_num_seqs": 16, "max_model_len": 1024, "num_blocks": 512,
                               "max_num_batched_tokens": 512})


def shared_prefix(seed: int = 0, quick: bool = False) -> Workload:
    """Groups of requests that share a long system prompt, each with its own question."""
    rng = random.Random(f"shared-prefix-{seed}")
    groups, per_group, system_len, output = (2, 3, 64, 8) if quick else (3, 6, 256, 16)
    requests = []
    for g in range(groups):
        system = _tokens(rng, system_len)
        for q in range(per_group):
            question = _tokens(rng, rng.randint(8, 40))
            requests.append((f"prefix-{g}-{q}", system + question, _greedy(output)))
    return Workload("shared-prefix", f"{groups} groups x {per_group} questions (8-40 tokens) after "
                    f"a shared {system_len}-token system prompt, {output} output tokens, greedy",
                    requests, {"max_num_seqs": 16, "max_model_len": 1024, "num_blocks": 512,
                               # a step budget of one system prompt: a group's first prefill
                               # fills (and caches) the shared pages before the rest of the
                               # group is admitted, so they hit
                               "max_num_batched_tokens": system_len})


def parallel_n4(seed: int = 0, quick: bool = False) -> Workload:
    """Parallel sampling, n=4: copy-on-write forks of one prompt, seeded temperature sampling."""
    rng = random.Random(f"parallel-n4-{seed}")
    count, output = (3, 12) if quick else (6, 32)
    requests = []
    for i in range(count):
        params = SamplingParams(n=4, temperature=0.8, top_p=0.95, max_tokens=output,
                                seed=seed * 1000 + i, ignore_eos=True)
        requests.append((f"n4-{i}", _tokens(rng, rng.randint(48, 160)), params))
    return Workload("parallel-n4", f"{count} prompts (48-160 tokens) x n=4 completions of {output} "
                    "tokens, temperature 0.8, top-p 0.95, seeded per request", requests,
                    {"max_num_seqs": 32, "max_model_len": 1024, "num_blocks": 512,
                     "max_num_batched_tokens": 512}, greedy=False)


def pressure(seed: int = 0, quick: bool = False) -> Workload:
    """A pool smaller than the working set: running requests must be preempted (swap or
    recompute, the scheduler's "auto" choice) to let others grow."""
    rng = random.Random(f"pressure-{seed}")
    if quick:
        count, prompt_range, output, num_blocks = 6, (48, 64), 48, 20
    else:
        count, prompt_range, output, num_blocks = 12, (64, 128), 64, 56
    requests = [(f"pressure-{i}", _tokens(rng, rng.randint(*prompt_range)), _greedy(output))
                for i in range(count)]
    working_set = sum(-(-(len(ids) + output) // 16) for _, ids, _ in requests)
    return Workload("pressure", f"{count} requests of {prompt_range[0]}-{prompt_range[1]} prompt + "
                    f"{output} output tokens (about {working_set} pages at full length) on a "
                    f"{num_blocks}-page pool: forces preemption, greedy", requests,
                    {"max_num_seqs": count, "max_model_len": 1024, "num_blocks": num_blocks,
                     "max_num_batched_tokens": 512, "preemption_mode": "auto"},
                    expect_preemption=True)


def long_context(seed: int = 0, quick: bool = False) -> Workload:
    """Few requests with long prompts and long decodes: attention over long contexts dominates."""
    rng = random.Random(f"long-context-{seed}")
    if quick:
        count, prompt_range, output, max_len = 2, (300, 400), 24, 512
    else:
        count, prompt_range, output, max_len = 3, (600, 800), 96, 1024
    requests = [(f"long-{i}", _tokens(rng, rng.randint(*prompt_range)), _greedy(output))
                for i in range(count)]
    return Workload("long-context", f"{count} requests of {prompt_range[0]}-{prompt_range[1]} "
                    f"prompt tokens, {output} output tokens each, greedy", requests,
                    {"max_num_seqs": count, "max_model_len": max_len,
                     "num_blocks": count * (max_len // 16), "max_num_batched_tokens": 1024})


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "chat": chat,
    "shared-prefix": shared_prefix,
    "parallel-n4": parallel_n4,
    "pressure": pressure,
    "long-context": long_context,
}


def make_workload(name: str, seed: int = 0, quick: bool = False) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name](seed=seed, quick=quick)
