"""A Llama-family model run by direct calls of its modules (engine/models/direct_forward.py): the same
logits as the model's own forward, bit for bit, and the model's forward wherever that could differ."""

import random

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Qwen3Config

from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
from vmemkv.engine.core.model_runner import BATCH_KWARG, ModelRunner
from vmemkv.engine.models.direct_forward import DirectForward, direct_code, fingerprint, why_not_direct
from vmemkv.engine.models.native_norm import swap_rms_norms
from vmemkv.engine.models.native_rotary import swap_rotaries
from vmemkv.engine.models.packed_linear import pack_linears
from vmemkv.engine.models.zoo import load_model

# Qwen3's attention norms its queries and keys; alternating sliding and full layers (Qwen2/3's
# layer_types): each layer's own window reaches the attention
TINY_QWEN3 = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         initializer_range=0.1, use_sliding_window=True, sliding_window=5,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def build_tiny(name: str, dtype: torch.dtype = torch.float32):
    if name == "tiny-qwen3":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return AutoModelForCausalLM.from_config(TINY_QWEN3, dtype=dtype).eval()
    return load_model(name, dtype)[0]


class CausalAttention:
    """The engine's attention object, reduced to one causal sequence (no cache): SDPA over the
    step's own rows. Records how each layer called it."""

    def __init__(self):
        self.calls = []

    def __call__(self, layer, query, key, value, scaling, **variant):
        self.calls.append((layer, tuple(query.shape), scaling, variant))
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2)


def run_both(model, tokens: int, keep):
    """The model's own forward and DirectForward's on one batch: (logits, attention calls) each."""
    ModelRunner(model, direct=False)  # the vmemkv attention implementation, as the engine sets it
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=generator)
    positions = torch.arange(tokens)[None]
    own, direct = CausalAttention(), CausalAttention()
    with torch.inference_mode():
        want = model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=keep,
                     **{BATCH_KWARG: own}).logits
        got = DirectForward(model, direct_code(model))(ids, positions, direct, keep)
    return (want, own.calls), (got, direct.calls)


FAMILIES = {"tiny-llama": "Llama", "tiny-qwen2": "Qwen2", "tiny-mistral": "Mistral", "tiny-qwen3": "Qwen3"}


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prepared", [False, True], ids=["as-loaded", "packed-native"])
@pytest.mark.parametrize("keep", [0, "rows"])
def test_direct_calls_give_the_models_logits_bit_for_bit(name, dtype, prepared, keep):
    model = build_tiny(name, dtype)
    if prepared:  # as the engine prepares a model it loaded on the CPU
        assert pack_linears(model) and swap_rms_norms(model)
        swap_rotaries(model)  # where transformers has the per-instance hook (5.25; not 5.17)
    assert direct_code(model).family == FAMILIES[name]
    keep = torch.tensor([3, 7, 12]) if keep == "rows" else keep
    (want, own_calls), (got, direct_calls) = run_both(model, 13, keep)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)
    # each layer's attention called once, in order, with what model_runner._attention passes these
    # layers: the same window (Mistral's and Qwen3's sliding layers have one), no soft-cap or sinks
    assert [c[:3] for c in direct_calls] == [c[:3] for c in own_calls]
    assert [c[3] for c in direct_calls] == [{"window": c[3]["window"]} for c in own_calls]
    assert all(c[3]["softcap"] is None and c[3]["sinks"] is None for c in own_calls)
    if name in ("tiny-mistral", "tiny-qwen3"):
        assert any(c[3]["window"] for c in own_calls)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])
def test_an_engine_decodes_the_same_tokens_with_and_without_direct_calls(name):
    def answers(direct: bool):
        engine = LLMEngine(EngineConfig(model=name, device="cpu", threads=1, max_num_seqs=4,
                                        max_model_len=256, direct_forward=direct))
        rng = random.Random(0)
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        for index in range(4):  # prompts of several lengths: chunks, decodes, both in one step
            engine.add_request(f"r{index}", [rng.randrange(10, 500) for _ in range(20 + 9 * index)], params)
        out = {}
        while engine.has_unfinished_requests():
            out.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        said = engine.direct_forward
        engine.close()
        return out, said

    on, said_on = answers(True)
    off, said_off = answers(False)
    layers = load_model(name)[0].config.num_hidden_layers
    assert said_on == f"on: {FAMILIES[name]}'s code, {layers} layers" and said_off == "off: turned off"
    assert on == off and len(on) == 4


def test_the_model_runs_as_it_is_where_direct_calls_could_differ():
    # another family's code (Gemma-2 soft-caps its logits, norms four times a layer, ...)
    assert why_not_direct(build_tiny("tiny-gemma2")) == ("its causal LM's forward is not code this path copies "
                                                         "(Llama, Qwen2/3, Mistral in transformers 5.17 or 5.25)")
    # not a decoder-only causal LM of that shape
    assert why_not_direct(torch.nn.Linear(2, 2)).startswith("not a Llama-style causal LM")
    # a hook direct calls would skip (tensor parallelism sums partial outputs in forward hooks)
    model = build_tiny("tiny-llama")
    model.model.layers[1].self_attn.o_proj.register_forward_hook(lambda module, args, out: out)
    assert why_not_direct(model) == "model.layers.1.self_attn.o_proj has forward hooks, which direct calls would skip"
    runner = ModelRunner(model)
    assert runner.direct is None and runner.direct_forward.startswith("off: model.layers.1")


def _body_a(x):
    """A docstring."""
    y = x + 1
    return y * 2


def _body_b(x):
    y = x + 1
    return y * 2


def _body_c(x):
    y = x + 1
    return y * 3


def test_fingerprints_read_the_statements_not_the_docstring_or_the_decorators():
    decorated = torch.no_grad()(_body_b)
    assert fingerprint(_body_a) == fingerprint(_body_b) == fingerprint(decorated)
    assert fingerprint(_body_c) != fingerprint(_body_b)
