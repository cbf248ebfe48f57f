"""The intra-op threads torch computes with: ``EngineConfig.threads`` is applied when the engine
starts (None leaves torch's setting, as the A/B harness and the tests set their own), and the entry
points default to the usable cores less one (``engine/threads.py``)."""

from __future__ import annotations

import os

import pytest
import torch

from vmemkv.cli import build_parser, engine_config_from_args
from vmemkv.engine import EngineConfig, LLMEngine
from vmemkv.engine.core.llm import LLM
from vmemkv.engine.core.threads import available_cores, default_threads
from vmemkv.errors import ConfigError

SMALL = dict(max_num_seqs=2, max_model_len=64)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_default_leaves_one_usable_core(monkeypatch):
    assert available_cores() == len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert default_threads() == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    assert default_threads() == 1


def test_the_engine_applies_threads_and_none_leaves_them(restore_threads):
    torch.set_num_threads(1)
    LLMEngine(EngineConfig(**SMALL, threads=2)).close()
    assert torch.get_num_threads() == 2
    LLMEngine(EngineConfig(**SMALL)).close()  # threads=None: as they were
    assert torch.get_num_threads() == 2


def test_llm_and_the_cli_default_to_the_usable_cores_less_one(restore_threads, monkeypatch):
    monkeypatch.setattr("vmemkv.engine.core.llm.default_threads", lambda: 1)
    torch.set_num_threads(2)
    LLM(**SMALL).engine.close()
    assert torch.get_num_threads() == 1
    LLM(**SMALL, threads=2).engine.close()
    assert torch.get_num_threads() == 2
    assert engine_config_from_args(build_parser().parse_args(["generate", "--prompt", "x"])).threads \
        == default_threads()
    assert engine_config_from_args(build_parser().parse_args(
        ["generate", "--prompt", "x", "--threads", "2"])).threads == 2


def test_bad_threads_are_a_config_error():
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(ConfigError, match="threads is"):
            EngineConfig(threads=bad)
