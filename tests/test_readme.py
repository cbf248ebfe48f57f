"""The README's Python blocks marked ``<!-- runnable -->`` run as written on CPU; those marked
``<!-- runnable: smollm2-135m-instruct -->`` too, once the real model can be obtained."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"<!-- runnable(?P<needs>: [\w.-]+)? -->\n```python\n(?P<code>.*?)```", re.S)


def runnable_blocks() -> list:
    blocks = [(m["code"], (m["needs"] or "")[2:]) for m in BLOCK.finditer(README.read_text())]
    return [pytest.param(code, needs, id=f"block{i}-line{code.splitlines()[0][:30]}")
            for i, (code, needs) in enumerate(blocks)]


def test_the_library_snippet_is_marked_runnable():
    assert any("KVCacheManager(" in param.values[0] for param in runnable_blocks())


@pytest.mark.parametrize("code,needs", runnable_blocks())
def test_readme_block_runs(code, needs, request, capsys):
    if needs:
        assert needs == "smollm2-135m-instruct", f"unknown requirement {needs!r}"
        request.getfixturevalue("real_model_dir")  # skips with the reason when unavailable
    exec(compile(code, f"README.md block ({code.splitlines()[0]})", "exec"), {"__name__": "__readme__"})
    if "capital of France" in code:
        assert "Paris" in capsys.readouterr().out
