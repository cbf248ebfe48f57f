"""The A/B harness's real-text chat workload (chat-real): the stored prompts load, render through a
chat template, and the requests of one assistant share its system prompt's pages."""

from __future__ import annotations

import os

import pytest

from vmemkv.ab import VARIANTS, make_workload, run_once
from vmemkv.ab.cli import add_ab_arguments
from vmemkv.ab.workloads import (DEFAULT_WORKLOADS, REAL_MODEL_WORKLOADS, default_workloads,
                                 load_chat_prompts, pages, render_chat)
from vmemkv.engine.core.chat import has_chat_template
from vmemkv.engine.models.zoo import load_model


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _by_assistant(workload) -> dict[str, list[list[int]]]:
    groups: dict[str, list[list[int]]] = {}
    for request_id, ids, _ in workload.requests:
        groups.setdefault(request_id.split("-")[2], []).append(ids)
    return groups


def test_the_stored_prompts_load_and_are_plain_ascii():
    data = load_chat_prompts()
    assistants = data["assistants"]
    assert len(assistants) >= 3
    assert len({a["name"] for a in assistants}) == len(assistants)
    assert sum(len(a["questions"]) for a in assistants) >= 40
    for assistant in assistants:
        assert len(assistant["system"]) > 800  # a system prompt of realistic length
        assert len(set(assistant["questions"])) == len(assistant["questions"])
        for text in [assistant["system"], *assistant["questions"]]:
            assert text.isascii() and text.strip() == text


@pytest.mark.parametrize("quick", [True, False])
def test_requests_of_an_assistant_share_its_system_prompt_as_bytes(quick):
    workload = make_workload("chat-real", quick=quick)  # no tokenizer: UTF-8 bytes
    systems = {a["name"]: len(a["system"]) for a in load_chat_prompts()["assistants"]}
    groups = _by_assistant(workload)
    assert len(groups) == (2 if quick else len(systems))
    for name, prompts in groups.items():
        assert len(prompts) >= 3
        for ids in prompts[1:]:
            assert _common_prefix(prompts[0], ids) >= systems[name]
    # the assistants take turns: no two neighbours share an assistant
    names = [rid.split("-")[2] for rid, _, _ in workload.requests]
    assert all(a != b for a, b in zip(names, names[1:]))


def test_a_real_model_gets_the_chat_workload_by_default():
    assert "chat-real" in REAL_MODEL_WORKLOADS and "chat-real" not in DEFAULT_WORKLOADS
    assert default_workloads("tiny-llama") == DEFAULT_WORKLOADS
    assert default_workloads("smollm2-135m-instruct") == REAL_MODEL_WORKLOADS
    assert default_workloads("HuggingFaceTB/SmolLM2-135M-Instruct") == REAL_MODEL_WORKLOADS
    import argparse

    parser = argparse.ArgumentParser()
    add_ab_arguments(parser)
    help_text = " ".join(parser.format_help().split())
    assert "smollm2-135m-instruct" in help_text and "Hub id" in help_text


def test_a_tiny_engine_run_hits_the_system_prompt_pages():
    """Quick chat-real on tiny-llama (byte tokenizer, plain text): the later requests of each
    assistant hit its system prompt's pages, alike for vmem and paged, with the same tokens."""
    model, tokenizer = load_model("tiny-llama")
    workload = make_workload("chat-real", quick=True, tokenizer=tokenizer)
    assert not has_chat_template(tokenizer)
    runs = {name: run_once(model, tokenizer, "tiny-llama", workload, VARIANTS[name])
            for name in ("vmem", "paged")}
    # 2 assistants x 3 questions: up to 4 requests hit their system prompt's whole pages (fewer
    # when one is admitted in the step that prefills its assistant's first request)
    page = runs["vmem"].tokens_per_page
    system_pages = min(len(a["system"]) // page for a in load_chat_prompts()["assistants"][:2])
    prompt_tokens = workload.num_prompt_tokens
    for run in runs.values():
        assert run.metrics["prefix_hit_rate"] >= 2 * system_pages * page / prompt_tokens
    assert runs["vmem"].metrics["prefix_hit_rate"] == runs["paged"].metrics["prefix_hit_rate"]
    assert runs["vmem"].tokens == runs["paged"].tokens


def test_the_real_model_renders_through_its_chat_template(real_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.fspath(real_model_dir))
    assert has_chat_template(tokenizer)
    assistants = {a["name"]: a for a in load_chat_prompts()["assistants"]}
    workload = make_workload("chat-real", tokenizer=tokenizer)
    assert "chat template" in workload.description
    for name, prompts in _by_assistant(workload).items():
        system = assistants[name]["system"]
        text = tokenizer.decode(prompts[0])
        assert text.startswith("<|im_start|>system\n" + system + "<|im_end|>")
        assert text.endswith("<|im_start|>assistant\n")
        system_ids = render_chat(tokenizer, system, "?")
        system_len = _common_prefix(system_ids, prompts[0])
        assert system_len > 200  # the system prompt's tokens, in full
        for ids in prompts[1:]:
            assert _common_prefix(prompts[0], ids) >= system_len
        # whole 16-token pages of the shared prefix: what the prefix cache can hit
        assert system_len // 16 >= 12 and pages(max(map(len, prompts)), 16) > system_len // 16
