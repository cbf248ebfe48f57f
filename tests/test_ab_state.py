"""``vmemkv ab`` on a recurrent hybrid (tiny-qwen3-next, tiny-lfm2): the state lives in virtual
memory only, so the A/B runs the vmem variants and refuses the block-table ones naming why; every
run reports the positions its forward passes computed, beside the prefix hit rate."""

from __future__ import annotations

import json

import pytest

from vmemkv.ab import make_workload
from vmemkv.ab.cli import main
from vmemkv.ab.variants import DEFAULT_VARIANTS, default_variants

from test_state_engine import STATE_MIXERS_ROUTED


def test_a_state_model_gets_the_vmem_variants_by_default():
    assert default_variants(["shared-prefix"], "tiny-qwen3-next") == ["vmem", "vmem-per-layer"]
    assert default_variants(["shared-prefix"], "tiny-llama") == list(DEFAULT_VARIANTS)


def test_a_block_table_variant_is_refused_for_a_state_model_naming_the_choices(capsys):
    assert main(["--quick", "--no-progress", "--out", "", "--workloads", "shared-prefix",
                 "--variants", "vmem,paged", "--model", "tiny-lfm2"]) == 2
    err = capsys.readouterr().err
    assert "tiny-lfm2 keeps a recurrent state" in err and "paged cannot run it" in err
    assert "vmem, vmem-per-layer, vmem-keep" in err


@pytest.mark.parametrize("model", ["tiny-llama", pytest.param("tiny-qwen3-next", marks=STATE_MIXERS_ROUTED)])
def test_shared_prefix_reports_the_tokens_computed_and_the_hit_rate(model, capsys):
    """Every prompt token not served by a prefix hit is computed once, then one position per
    output token after the first (the pool is roomy: nothing is preempted)."""
    assert main(["--quick", "--json", "--no-progress", "--out", "", "--workloads", "shared-prefix",
                 "--variants", "vmem", "--model", model]) == 0
    metrics = {key: spread["median"]
               for key, spread in json.loads(capsys.readouterr().out)["results"]["shared-prefix"]["vmem"]
               ["metrics"].items()}
    requests = make_workload("shared-prefix", quick=True).requests
    prompt_tokens = sum(len(prompt) for _, prompt, _ in requests)
    decode_tokens = sum(params.max_tokens - 1 for _, _, params in requests)
    hit_tokens = round(metrics["prefix_hit_rate"] * prompt_tokens)
    assert metrics["preemptions"] == 0
    assert metrics["tokens_computed"] == prompt_tokens - hit_tokens + decode_tokens
    if model == "tiny-llama":
        assert hit_tokens > 0  # the shared system prompts' pages
