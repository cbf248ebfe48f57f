"""``vmemkv --help`` and ``vmemkv ab --help`` answer without loading torch or transformers (a
newcomer waited 8-10 s for them), and ``import vmemkv`` loads neither until a name needs it."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers")


def loaded_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True).stdout.split()
    return {name for name in HEAVY if name in out}


@pytest.mark.parametrize("argv", [["--help"], ["ab", "--help"]])
def test_help_loads_neither_torch_nor_transformers(argv):
    code = ("import contextlib, io\nfrom vmemkv.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            f"    main({argv!r})")
    assert loaded_after(code) == set()


def test_import_vmemkv_is_light_until_a_name_is_used():
    assert loaded_after("import vmemkv, vmemkv.engine, vmemkv.ab") == set()
    assert loaded_after("from vmemkv import KVCacheManager") == {"torch"}


def test_the_lazy_names_are_the_modules_own():
    import vmemkv
    from vmemkv.cache.manager import KVCacheManager
    from vmemkv.engine import LLM
    from vmemkv.engine.core.llm import LLM as llm_class

    assert vmemkv.KVCacheManager is KVCacheManager and LLM is llm_class
    assert {"KVCacheManager", "CacheConfig", "KVRequest"} <= set(dir(vmemkv))
    with pytest.raises(AttributeError):
        vmemkv.engine.NoSuchThing
