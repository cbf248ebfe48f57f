"""The modules' paths before the concept folders stay importable for one release: the same module
object as at the new path, with a DeprecationWarning naming both."""

import importlib
import sys

import pytest

import vmemkv  # noqa: F401  (installs the finder)
from vmemkv._moved import MOVED, MOVED_PACKAGES, new_name

OLD_PATHS = sorted(MOVED) + ["vmemkv.vmm", "vmemkv.vmm.cpu", "vmemkv.vmm.base"]


@pytest.mark.parametrize("old", OLD_PATHS)
def test_an_old_path_is_the_module_at_its_new_path(old):
    try:
        importlib.import_module(new_name(old))
    except ModuleNotFoundError as e:  # the server's modules without the server packages installed
        pytest.skip(f"{new_name(old)} needs {e.name}, which is not installed here")
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} is now {new_name(old)}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new_name(old))
    assert module.__spec__.name == new_name(old)  # its own spec, not the old name's


def test_names_import_from_an_old_path():
    sys.modules.pop("vmemkv.manager", None)
    with pytest.warns(DeprecationWarning):
        from vmemkv.manager import KVCacheManager as old  # noqa: PLC0415
    assert old is vmemkv.KVCacheManager


def test_no_new_path_is_an_old_one_and_every_target_exists():
    for old, new in {**MOVED, **MOVED_PACKAGES}.items():
        assert new_name(new) is None
        assert importlib.util.find_spec(new) is not None, new


def test_unmoved_modules_are_not_redirected():
    assert new_name("vmemkv.errors") is None
    assert new_name("vmemkv.engine") is None
    assert new_name("vmemkv.vmmx") is None


def test_the_model_zoo_names_import_from_the_old_module_path():
    from vmemkv.engine.models import zoo
    with pytest.warns(DeprecationWarning, match="vmemkv.engine.models.load_model is now"):
        from vmemkv.engine.models import load_model  # noqa: PLC0415
    assert load_model is zoo.load_model
    with pytest.raises(ImportError):
        from vmemkv.engine.models import no_such_name  # noqa: F401, PLC0415
