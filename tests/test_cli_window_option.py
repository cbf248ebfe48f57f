"""`--keep-blocks-behind-window` (`vmemkv generate` / `serve`): EngineConfig.release_behind_window
False, so a sliding-window model keeps every block; the default gives blocks back. The text is the
same either way."""

from __future__ import annotations

import pytest

import vmemkv.cli
from vmemkv.cli import build_parser, engine_config_from_args, main


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["serve"]])
def test_the_option_reaches_the_engine_config(command):
    args = build_parser().parse_args(command + ["--device", "cpu"])
    assert engine_config_from_args(args).release_behind_window is True
    args = build_parser().parse_args(command + ["--device", "cpu", "--keep-blocks-behind-window"])
    assert engine_config_from_args(args).release_behind_window is False


def test_generate_keeps_every_block_with_the_option(capsys, monkeypatch):
    """tiny-gemma2 (local layers of window 128) generating past its window: released blocks by
    default, none with the option, the same greedy text."""
    engines = []
    build = vmemkv.cli._build_engine

    def recording_build(args):
        engines.append(build(args))
        return engines[-1]

    monkeypatch.setattr(vmemkv.cli, "_build_engine", recording_build)
    texts, released = [], []
    for extra in ([], ["--keep-blocks-behind-window"]):
        assert main(["generate", "--model", "tiny-gemma2", "--device", "cpu", "--prompt", "hello",
                     "--max-tokens", "200", "--ignore-eos", *extra]) == 0
        texts.append(capsys.readouterr().out)
        engine = engines[-1]
        released.append(engine.manager.cache_stats().blocks_released_behind_window)
        engine.close()
    assert texts[0] == texts[1] and texts[0].strip()
    assert released[0] > 0 and released[1] == 0
