"""The adapters in ``integrations/`` use vmemkv's public API only: what ``vmemkv`` and
``vmemkv.engine`` export plus the documented modules ``integrations/README.md`` lists, and no
private attribute of an object that is not their own."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import vmemkv

INTEGRATIONS = Path(__file__).resolve().parent.parent / "integrations"
# the modules integrations/README.md lists: keep the two in step
ALLOWED = {"vmemkv", "vmemkv.engine", "vmemkv.engine.models.hf_support"}
MODULES = sorted(INTEGRATIONS.rglob("*.py"))


def _is_vmemkv(name: str) -> bool:
    return name == "vmemkv" or name.startswith("vmemkv.")


def _imports(tree: ast.AST):
    """(line, module) of every vmemkv module imported, absolute or relative."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def _private_uses(tree: ast.AST):
    """(line, expression) of every ``x._name`` where ``x`` is not ``self`` or ``cls`` (dunders
    aside): the adapter may use its own private parts, never another object's."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not (node.attr.startswith("__") and node.attr.endswith("__"))
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            yield node.lineno, ast.unparse(node)


def test_there_are_adapters_to_check():
    assert INTEGRATIONS / "vmemkv_transformers" / "cache.py" in MODULES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(INTEGRATIONS)))
def test_an_adapter_imports_only_the_public_api(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = [f"{path.name}:{line}: {name}" for line, name in _imports(tree)
           if _is_vmemkv(name) and name not in ALLOWED]
    assert not bad, f"imports of vmemkv outside {sorted(ALLOWED)}: {bad}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(INTEGRATIONS)))
def test_an_adapter_reads_no_other_objects_private_attributes(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = [f"{path.name}:{line}: {expr}" for line, expr in _private_uses(tree)]
    assert not bad, f"private attributes of other objects: {bad}"


def test_the_allowed_modules_exist_and_the_readme_names_them():
    readme = (INTEGRATIONS / "README.md").read_text()
    for name in ALLOWED:
        assert importlib.util.find_spec(name) is not None, name
        assert f"`{name}`" in readme, f"integrations/README.md does not list {name}"


def test_the_names_imported_from_vmemkv_are_its_exports():
    """``from vmemkv import X``: X is one of the names ``vmemkv/__init__.py`` imports."""
    exported = set(dir(vmemkv))
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "vmemkv":
                for alias in node.names:
                    assert alias.name in exported and not alias.name.startswith("_"), (path.name, alias.name)


def test_the_adapter_imports_from_its_own_package():
    import vmemkv_transformers
    from vmemkv_transformers.cache import VmemkvCache

    assert vmemkv_transformers.VmemkvCache is VmemkvCache
    assert {"VmemkvCache", "cache_kwarg", "layer_windows", "manager_for"} <= set(vmemkv_transformers.__all__)
    assert Path(vmemkv_transformers.__file__).parent.name == "vmemkv_transformers"


