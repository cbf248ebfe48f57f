"""``vmemkv --help`` and every ``vmemkv COMMAND --help`` answer without loading torch or
transformers (a newcomer waited 3-10 s for them), showing EngineConfig's own defaults, and
``import vmemkv`` loads neither until a name needs it."""

import argparse
import contextlib
import io
import subprocess
import sys

import pytest

COMMANDS = ("generate", "serve", "ab")

HEAVY = ("torch", "transformers")


def loaded_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True).stdout.split()
    return {name for name in HEAVY if name in out}


@pytest.mark.parametrize("argv", [["--help"], *([command, "--help"] for command in COMMANDS)])
def test_help_loads_neither_torch_nor_transformers(argv):
    code = ("import contextlib, io\nfrom vmemkv.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            f"    main({argv!r})")
    assert loaded_after(code) == set()


def test_every_command_is_checked():
    from vmemkv.cli import build_parser

    commands = next(action.choices for action in build_parser()._actions
                    if isinstance(action, argparse._SubParsersAction))
    assert set(commands) == set(COMMANDS)


def help_text(command: str) -> str:
    from vmemkv.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([command, "--help"])
    return out.getvalue()


def test_help_shows_engine_configs_own_defaults(monkeypatch):
    """The help reads the engine options' defaults from a table in vmemkv.cli (EngineConfig's
    module loads torch); rendered from EngineConfig itself, the help is the same."""
    from vmemkv.cli import ENGINE_DEFAULTS, HelpFormatter
    from vmemkv.engine.core.config import EngineConfig

    own = {name: field.default for name, field in EngineConfig.__dataclass_fields__.items()}
    assert ENGINE_DEFAULTS == {name: own.get(name, "not an EngineConfig field") for name in ENGINE_DEFAULTS}
    shown = {command: help_text(command) for command in COMMANDS}
    assert "(default: 64)" in shown["serve"]  # --max-num-seqs
    monkeypatch.setattr(HelpFormatter, "engine_defaults", own)
    assert {command: help_text(command) for command in COMMANDS} == shown


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
