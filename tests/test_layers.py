"""The package's shape: the layers import downward only (the cache never imports attention, the
engine or the A/B harness; memory never imports the cache), at most eight modules sit directly
in ``vmemkv/``. Read from the source with ``ast``. (Modules are split by concept, not by a
line count: there is no cap on a module's length.)"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "vmemkv"
# layer -> the vmemkv packages it may not import (higher layers)
FORBIDDEN = {
    "memory": ("vmemkv.cache", "vmemkv.attention", "vmemkv.engine", "vmemkv.ab", "vmemkv_transformers"),
    "cache": ("vmemkv.attention", "vmemkv.engine", "vmemkv.ab", "vmemkv_transformers"),
    "attention": ("vmemkv.engine", "vmemkv.ab", "vmemkv_transformers"),
    "engine": ("vmemkv.ab", "vmemkv_transformers"),
}
MAX_TOP_LEVEL_MODULES = 8


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import (the package imports by absolute paths)")
    return names


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_no_layer_above_it(layer):
    offending = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for name in imported_modules(path):
            if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN[layer]):
                offending.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    assert not offending, "\n".join(offending)


def test_few_modules_sit_directly_in_the_package():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, modules



DEVICE_NAMES = ("cuda", "cpu")


def device_names(path: Path) -> list[str]:
    """Where ``path`` names a device in code (comments and docstrings aside): a string constant
    or an attribute or variable name holding ``cuda`` or ``cpu``."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, ast.Name):
            text = node.id
        else:
            continue
        if any(name in text for name in DEVICE_NAMES):  # "CPU": vLLM events' name of the host tier
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {text!r}")
    return found


def test_the_cache_names_no_device():
    """What a device needs (filler or hole pages, streams for host copies) is its backend's to
    say (``vmemkv/memory/vmm/``): the cache asks, and works the same on every device."""
    found = [hit for path in sorted((PACKAGE / "cache").rglob("*.py")) for hit in device_names(path)]
    assert not found, "\n".join(found)
