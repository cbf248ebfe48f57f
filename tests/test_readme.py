"""The Python blocks marked ``<!-- runnable -->`` in the README and in ``docs/*.md`` run as written on
CPU; those marked ``<!-- runnable: smollm2-135m-instruct -->`` too, once the real model can be
obtained. The relative links between those pages point at files (and headings) that exist.

A runnable block that prints shows what it prints in a ```` ```text ```` block right after it (at
most one blank line between), and the test compares the block's stdout with it, line by line::

    <!-- runnable -->
    ```python
    print("hello")
    ```

    ```text
    hello
    ```

Trailing spaces and trailing blank lines are ignored. ``...`` in a shown line matches any text on
that line (as doctest's ELLIPSIS, but never across lines); keep it for what really varies between
runs (timings, addresses, sizes that depend on the machine). A runnable block that prints nothing
has no output block; one that prints with none fails, so a page cannot drift from its code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
# The benchmarks' history pages link back into the docs and to the result files beside them.
LINKED_PAGES = [*PAGES, *sorted((ROOT / "experiments" / "results" / "history").glob("*.md"))]
BLOCK = re.compile(r"<!-- runnable(?P<needs>: [\w.-]+)? -->\n```python\n(?P<code>.*?)```\n"
                   r"(?:\n?```text\n(?P<shown>.*?)```)?", re.S)
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
ELLIPSIS = "..."


def page_name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def runnable_blocks(pages: list[Path] = PAGES) -> list:
    """One ``pytest.param(code, needs, page, shown)`` per runnable block; ``shown`` is the text of
    its output block, or None when it has none."""
    params = []
    for page in pages:
        for i, m in enumerate(BLOCK.finditer(page.read_text())):
            code, needs = m["code"], (m["needs"] or "")[2:]
            params.append(pytest.param(code, needs, page_name(page), m["shown"],
                                       id=f"{page_name(page)}-block{i}-line{code.splitlines()[0][:30]}"))
    return params


def output_lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def output_matches(shown: str, printed: str) -> bool:
    """Whether ``printed`` is what ``shown`` shows: the same lines, ``...`` matching any text on its line."""
    shown_lines, printed_lines = output_lines(shown), output_lines(printed)
    return len(shown_lines) == len(printed_lines) and all(
        re.fullmatch(".*".join(map(re.escape, want.split(ELLIPSIS))), got)
        for want, got in zip(shown_lines, printed_lines))


def test_output_matching():
    assert output_matches("a\nb\n", "a  \nb\n\n")
    assert output_matches("took ... s\n", "took 0.25 s\n")
    assert output_matches(" Paris.\n\nThe answer is:\n", " Paris.\n\nThe answer is:\n")
    assert not output_matches("Red, Blue\n", "red, blue\n")
    assert not output_matches("Paris\n", " Paris\n")
    assert not output_matches("a\n", "a\nb\n")
    assert not output_matches("a ... c\n", "a b\nc\n")
    assert not output_matches("", "a\n")


def test_the_library_snippet_is_marked_runnable():
    for page in (README, ROOT / "docs" / "library.md"):
        assert any("KVCacheManager(" in param.values[0] for param in runnable_blocks([page])), page_name(page)


def test_the_library_page_runs_a_whole_custom_engine():
    """docs/library.md's custom-engine example (run by ``test_readme_block_runs``) uses the public
    attention call and checks its greedy tokens against Hugging Face ``generate``, with a prefix
    hit, a fork and a swap on the way."""
    engines = [param.values for param in runnable_blocks([ROOT / "docs" / "library.md"])
               if "slot_attention(" in param.values[0]]
    assert len(engines) == 1
    code, _, _, shown = engines[0]
    for call in (".generate(", ".fork(", '.preempt(reqs["d"], "swap")', ".swap_in(", "from vmemkv import"):
        assert call in code
    assert "greedy tokens equal HF generate's: True" in shown and "prefix hit: 32 tokens" in shown


@pytest.mark.parametrize("code,needs,page,shown", runnable_blocks())
def test_a_block_that_prints_shows_its_output(code, needs, page, shown):
    """Checked without running, so it holds where the real model is unavailable too."""
    if "print(" in code:
        assert shown is not None, f"{page}: this block prints; show its output in a ```text block after it"


@pytest.mark.parametrize("code,needs,page,shown", runnable_blocks())
def test_readme_block_runs(code, needs, page, shown, request, capsys):
    if needs:
        assert needs == "smollm2-135m-instruct", f"unknown requirement {needs!r}"
        request.getfixturevalue("real_model_dir")  # skips with the reason when unavailable
        capsys.readouterr()  # what fetching the model printed is not the block's
    exec(compile(code, f"{page} block ({code.splitlines()[0]})", "exec"), {"__name__": "__readme__"})
    printed = capsys.readouterr().out
    if shown is None:
        assert not printed, (f"{page}: the block printed output but the page shows none; add after it:\n"
                             f"```text\n{printed}```")
    else:
        assert output_matches(shown, printed), (f"{page}: the block printed\n{printed}\nbut the page "
                                                f"shows\n{shown}")


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


@pytest.mark.parametrize("page", LINKED_PAGES, ids=page_name)
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
