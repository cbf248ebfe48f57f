"""Sampler and SamplingParams: filtering on hand-made logits, seeds, logprobs, validation."""

import math

import pytest
import torch

from vmemkv.engine.core.sampler import (
    Sampler,
    apply_min_p,
    apply_top_k_top_p,
    make_generator,
)
from vmemkv.engine.core.sampling_params import SamplingParams

INF = float("inf")


def _logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log().unsqueeze(0)


def _support(probs: torch.Tensor) -> set[int]:
    """Token ids that can still be drawn."""
    return set(torch.nonzero(probs[0] > 0).flatten().tolist())


def _draws(logits: torch.Tensor, params: SamplingParams, count: int = 300) -> set[int]:
    sampler = Sampler()
    batch = logits.expand(count, -1)
    tokens, _ = sampler.sample(batch, [params] * count, [None] * count)
    return set(tokens.tolist())


# ---- greedy -------------------------------------------------------------------------------------

def test_greedy_is_argmax_whatever_the_other_settings():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2)] * 5
    tokens, logprobs = Sampler().sample(logits, params, [None] * 5)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()
    assert tokens.dtype == torch.long
    assert logprobs == [None] * 5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_any_float_dtype(dtype):
    logits = torch.tensor([[0.0, 3.0, 1.0]], dtype=dtype)
    tokens, _ = Sampler().sample(logits, [SamplingParams(temperature=0)], [None])
    assert tokens.tolist() == [1]


# ---- filters ------------------------------------------------------------------------------------

def test_top_k_keeps_exactly_k_most_likely():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    filtered = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(filtered[0]).tolist() == [False, True, False, True, False]
    assert filtered[0, 1] == 5.0 and filtered[0, 3] == 4.0  # kept logits are unchanged


def test_top_k_keeps_ties_with_the_kth_value():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0]])
    filtered = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(filtered[0]).tolist() == [True, True, True, False]


@pytest.mark.parametrize("top_p, kept", [
    (0.4, {0}),           # the top token alone reaches 0.4
    (0.75, {0, 1}),       # 0.5 < 0.75 <= 0.8
    (0.85, {0, 1, 2}),    # 0.8 < 0.85 <= 0.95
    (1.0, {0, 1, 2, 3}),
])
def test_top_p_keeps_the_smallest_nucleus_reaching_p(top_p, kept):
    logits = _logits_from_probs([0.5, 0.3, 0.15, 0.05])
    filtered = apply_top_k_top_p(logits, torch.tensor([4]), torch.tensor([top_p]))
    assert set(torch.nonzero(torch.isfinite(filtered[0])).flatten().tolist()) == kept


def test_top_p_always_keeps_the_most_likely_token():
    logits = _logits_from_probs([0.1, 0.9])
    filtered = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1e-6]))
    assert torch.isfinite(filtered[0]).tolist() == [False, True]


def test_top_p_applies_after_top_k():
    # Top-k=2 renormalises to 0.625/0.375, so top-p=0.6 then keeps only the first token;
    # on the unfiltered distribution it would have kept two.
    logits = _logits_from_probs([0.5, 0.3, 0.2])
    filtered = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.6]))
    assert torch.isfinite(filtered[0]).tolist() == [True, False, False]


def test_filters_are_per_row():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]] * 2)
    filtered = apply_top_k_top_p(logits, torch.tensor([1, 4]), torch.tensor([1.0, 1.0]))
    assert torch.isfinite(filtered).sum(dim=1).tolist() == [1, 4]


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert _support(apply_min_p(probs, torch.tensor([0.2]))) == {0, 1, 2}  # threshold 0.1
    assert _support(apply_min_p(probs, torch.tensor([0.7]))) == {0}  # threshold 0.35
    assert _support(apply_min_p(probs, torch.tensor([0.0]))) == {0, 1, 2, 3}


def test_sampler_only_draws_tokens_the_filters_keep():
    logits = _logits_from_probs([0.4, 0.3, 0.2, 0.1])
    assert _draws(logits, SamplingParams(top_k=2)) <= {0, 1}
    assert _draws(logits, SamplingParams(top_p=0.65)) <= {0, 1}
    assert _draws(logits, SamplingParams(min_p=0.6)) <= {0, 1}
    assert _draws(logits, SamplingParams(top_k=-1)) == {0, 1, 2, 3}


def test_temperature_sharpens_the_distribution():
    logits = _logits_from_probs([0.6, 0.4])
    cold = _draws(logits, SamplingParams(temperature=0.01), count=200)
    assert cold == {0}


# ---- seeds --------------------------------------------------------------------------------------

def _seeded_tokens(logits: torch.Tensor, seed: int, steps: int, neighbours: int) -> list[int]:
    """Draw `steps` tokens for one seeded row placed among `neighbours` other rows."""
    sampler = Sampler()
    generator = make_generator(seed)
    noise = torch.Generator().manual_seed(1000 + neighbours)
    drawn = []
    for _ in range(steps):
        others = torch.randn(neighbours, logits.size(1), generator=noise)
        batch = torch.cat([others[: neighbours // 2], logits, others[neighbours // 2:]])
        position = neighbours // 2
        params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1)] * batch.size(0)
        generators = [make_generator(7 + i) if i % 2 else None for i in range(batch.size(0))]
        generators[position] = generator
        params[position] = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=seed)
        tokens, _ = sampler.sample(batch, params, generators)
        drawn.append(tokens[position].item())
    return drawn


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(3))
    alone = _seeded_tokens(logits, seed=42, steps=20, neighbours=0)
    assert alone == _seeded_tokens(logits, seed=42, steps=20, neighbours=0)
    assert alone == _seeded_tokens(logits, seed=42, steps=20, neighbours=3)
    assert alone == _seeded_tokens(logits, seed=42, steps=20, neighbours=9)
    assert alone != _seeded_tokens(logits, seed=43, steps=20, neighbours=0)


def test_make_generator():
    assert make_generator(None) is None
    first = torch.rand(3, generator=make_generator(5))
    assert torch.equal(first, torch.rand(3, generator=make_generator(5)))
    make_generator(-1)  # negative seeds are folded into manual_seed's range


# ---- logprobs -----------------------------------------------------------------------------------

def test_logprobs_are_the_raw_log_softmax_top_k_plus_the_sampled_token():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0],
                           [0.0, 0.0, 1.0, 2.0, -2.0],
                           [1.0, 2.0, 3.0, 4.0, 5.0]])
    params = [SamplingParams(temperature=0, logprobs=2),
              SamplingParams(temperature=0.5, top_k=1, logprobs=0),  # temperature must not matter
              SamplingParams(temperature=0)]
    tokens, logprobs = Sampler().sample(logits, params, [None] * 3)
    expected = torch.log_softmax(logits, dim=-1)
    assert tokens.tolist() == [4, 3, 4]
    assert logprobs[0].keys() == {4, 0}
    for token_id, value in logprobs[0].items():
        assert math.isclose(value, expected[0, token_id].item(), rel_tol=1e-6)
    assert logprobs[1].keys() == {3}
    assert math.isclose(logprobs[1][3], expected[1, 3].item(), rel_tol=1e-6)
    assert logprobs[2] is None


def test_logprobs_include_a_sampled_token_outside_the_top():
    # Nearly uniform over 3 tokens: most of the 200 draws are not the top-1 token (2).
    count = 200
    logits = torch.tensor([[0.0, 0.1, 0.2]]).expand(count, -1)
    tokens, logprobs = Sampler().sample(logits, [SamplingParams(logprobs=1)] * count, [None] * count)
    assert set(tokens.tolist()) == {0, 1, 2}
    for token, entry in zip(tokens.tolist(), logprobs):
        assert entry.keys() == {2, token}


def test_logprobs_larger_than_the_vocabulary_are_clamped():
    logits = torch.tensor([[0.0, 1.0]])
    _, logprobs = Sampler().sample(logits, [SamplingParams(temperature=0, logprobs=10)], [None])
    assert logprobs[0].keys() == {0, 1}


def test_mismatched_inputs_are_rejected():
    with pytest.raises(ValueError, match="do not match"):
        Sampler().sample(torch.zeros(2, 4), [SamplingParams()], [None])


# ---- SamplingParams -----------------------------------------------------------------------------

def test_sampling_params_defaults_and_normalisation():
    params = SamplingParams(stop="###")
    assert params.stop == ["###"] and params.stop_token_ids == []
    assert SamplingParams().stop == []
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    assert not SamplingParams(top_k=-1).top_k_enabled and SamplingParams(top_k=3).top_k_enabled


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1}, "temperature must be >= 0, got -1"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"n": 0}, "n must be >= 1, got 0"),
    ({"top_k": -2}, "top_k must be >= -1, got -2"),
    ({"top_p": 0.0}, "top_p must be in \\(0, 1\\]"),
    ({"top_p": 1.5}, "top_p must be <= 1, got 1.5"),
    ({"min_p": -0.1}, "min_p must be >= 0"),
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"max_tokens": 2.5}, "max_tokens must be an integer"),
    ({"max_tokens": True}, "max_tokens must be an integer"),
    ({"stop": ["ok", ""]}, "stop must be non-empty strings"),
    ({"stop_token_ids": [-1]}, "stop_token_ids entry must be >= 0"),
    ({"logprobs": -1}, "logprobs must be >= 0"),
    ({"seed": "7"}, "seed must be an integer"),
    ({"ignore_eos": 1}, "ignore_eos must be a bool"),
])
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
