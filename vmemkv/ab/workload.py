"""One A/B workload: a seeded request set with the engine sizes it needs (``Workload``), sized in
pages of ``tokens_per_page`` tokens (``workloads.py`` makes them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vmemkv.engine.core.sampling_params import SamplingParams

TOKEN_MIN, TOKEN_MAX = 1, 250
DEFAULT_TOKENS_PER_PAGE = 16  # EngineConfig's default on CPU

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
    # The sliding window the pool was sized for (None: any model): the model must attend to at
    # most this many tokens back, and no request may be preempted (blocks behind the window go
    # back to the pool in every variant).
    sliding_window: int | None = None
    tokens_per_page: int = DEFAULT_TOKENS_PER_PAGE  # the page the sizes above were chosen for
    # The model mixes local layers (of at most ``sliding_window``) and global ones (the engine's
    # two layout groups), rather than every layer sliding.
    hybrid: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for _, ids, _ in self.requests)

    @property
    def num_output_tokens(self) -> int:
        """Tokens the requests will generate (all of them: ``ignore_eos``, ``n`` completions)."""
        return sum(params.max_tokens * params.n for _, _, params in self.requests)

    def pages_at_full_length(self, tokens_per_page: int) -> int:
        """Pages every sequence needs at full length at once, nothing shared."""
        return sum(full_length_pages(self.requests, tokens_per_page))

    def engine_for(self, tokens_per_page: int) -> dict:
        """The engine sizes for a variant whose pages hold ``tokens_per_page`` tokens: this
        workload's own when it was sized for that page, else a pool of the same tokens (never
        smaller than the largest request, nor, without expected pressure, than everything)."""
        engine = dict(self.engine)
        if tokens_per_page != self.tokens_per_page:
            pool_tokens = engine["num_blocks"] * self.tokens_per_page
            each = full_length_pages(self.requests, tokens_per_page)
            floor = max(each) if self.expect_preemption else sum(each)
            engine["num_blocks"] = max(pages(pool_tokens, tokens_per_page), floor)
        return engine

    def check_model(self, model) -> None:
        """ValueError unless ``model`` suits this workload: one sized for a sliding window needs
        every layer to attend at most that many tokens back (its pool holds no more)."""
        if self.sliding_window is None:
            return
        from vmemkv.engine.models.hf_support import hybrid_layer_windows, uniform_window  # torch

        if self.hybrid:
            windows = hybrid_layer_windows(model.config, self.engine["max_model_len"])
            if not windows or max(w for w in windows if w) > self.sliding_window:
                raise ValueError(f"workload {self.name!r} needs a model mixing local layers (a "
                                 f"sliding window of at most {self.sliding_window} tokens) with "
                                 f"global ones; {model.config.model_type} does not: use "
                                 "--model tiny-gemma2")
            return
        window = uniform_window(model.config)
        if window is None or window > self.sliding_window:
            raise ValueError(f"workload {self.name!r} needs a model whose every layer has a sliding "
                             f"window of at most {self.sliding_window} tokens (its pool holds only "
                             f"that); {model.config.model_type} has "
                             f"sliding_window={getattr(model.config, 'sliding_window', None)}: use "
                             "--model tiny-mistral")

    def describe(self) -> dict:
        prompts = [len(ids) for _, ids, _ in self.requests]
        return {"description": self.description, "num_requests": len(self.requests),
                "num_sequences": sum(p.n for _, _, p in self.requests),
                "prompt_tokens": self.num_prompt_tokens, "output_tokens": self.num_output_tokens,
                "prompt_len_min": min(prompts), "prompt_len_max": max(prompts),
                "greedy": self.greedy, "expect_preemption": self.expect_preemption,
                "sliding_window": self.sliding_window,
                "tokens_per_page": self.tokens_per_page, "engine": dict(self.engine)}


def pages(tokens: int, tokens_per_page: int) -> int:
    """Pages that hold ``tokens`` tokens."""
    return -(-tokens // tokens_per_page)


def full_length_pages(requests: list[Request], tokens_per_page: int) -> list[int]:
    """The pages each request's sequences (all ``n`` of them) need at full length."""
    return [pages(len(ids) + p.max_tokens, tokens_per_page) * p.n for _, ids, p in requests]
