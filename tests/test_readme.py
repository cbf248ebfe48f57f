"""The Python blocks marked ``<!-- runnable -->`` in the README and in ``docs/*.md`` run as written on
CPU; those marked ``<!-- runnable: smollm2-135m-instruct -->`` too, once the real model can be
obtained. The relative links between those pages point at files (and headings) that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"<!-- runnable(?P<needs>: [\w.-]+)? -->\n```python\n(?P<code>.*?)```", re.S)
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def page_name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def runnable_blocks(pages: list[Path] = PAGES) -> list:
    params = []
    for page in pages:
        for i, m in enumerate(BLOCK.finditer(page.read_text())):
            code, needs = m["code"], (m["needs"] or "")[2:]
            params.append(pytest.param(code, needs, page_name(page),
                                       id=f"{page_name(page)}-block{i}-line{code.splitlines()[0][:30]}"))
    return params


def test_the_library_snippet_is_marked_runnable():
    for page in (README, ROOT / "docs" / "library.md"):
        assert any("KVCacheManager(" in param.values[0] for param in runnable_blocks([page])), page_name(page)


@pytest.mark.parametrize("code,needs,page", runnable_blocks())
def test_readme_block_runs(code, needs, page, request, capsys):
    if needs:
        assert needs == "smollm2-135m-instruct", f"unknown requirement {needs!r}"
        request.getfixturevalue("real_model_dir")  # skips with the reason when unavailable
    exec(compile(code, f"{page} block ({code.splitlines()[0]})", "exec"), {"__name__": "__readme__"})
    if "capital of France" in code:
        assert "Paris" in capsys.readouterr().out


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    anchors, seen = set(), {}
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    for line in text.splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m[1].strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=page_name)
def test_relative_links_resolve(page):
    broken = []
    for m in LINK.finditer(page.read_text()):
        target = m["target"]
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file.read_text()):
            broken.append(target)
    assert not broken, f"{page_name(page)}: broken links {broken}"
