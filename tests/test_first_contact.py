"""First contact with a GPU machine: what must hold there, checked here.

The device image has no fastapi/uvicorn/openai/flash-attn, may fail to build the C extension, and
has no network; its benchmarks must fail loudly when the CUDA backend is broken but skip cleanly
where there is no CUDA; ``experiments/gpu_check.sh`` must fit 5 minutes. (Page sizes: see
tests/test_ab.py, whose workloads are sized from the engine's real tokens per page.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("fastapi", "uvicorn", "openai", "flash_attn", "vmemkv._native")


def _run_python(code: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """Runs ``code`` with every OPTIONAL module made unimportable (a ``None`` in sys.modules),
    as on a machine that lacks them."""
    blocker = tmp_path / "block_optional.py"
    blocker.write_text("import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in OPTIONAL))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    return subprocess.run([sys.executable, "-c", f"import block_optional\n{code}", *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


IMPORT_CHECK = """
import torch
import vmemkv
from vmemkv import CacheConfig, KVCacheManager, NativeExtensionError, VmemkvError
from vmemkv.vmm import create_backend

config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, num_blocks=4, max_num_seqs=2,
                     max_model_len=64, dtype=torch.float16)
assert config.make_layout().tokens_per_page >= 1
for make in (lambda: KVCacheManager(config), lambda: create_backend("cpu", 1 << 16, 4)):
    try:
        make()
    except NativeExtensionError as e:
        assert isinstance(e, VmemkvError) and isinstance(e, ImportError)
        assert "vmemkv._native" in str(e) and "build_ext --inplace" in str(e), e
    else:
        raise AssertionError("the CPU backend was built without its extension")
print("ok")
"""

# One child process (one torch import) serves both tests below: it first runs IMPORT_CHECK in a
# fresh interpreter, recording its stdout and traceback in a file, then collects the test modules
# that need optional packages with pytest, whose stdout and exit status are the process's own.
CHILD = """
import contextlib, io, json, sys, traceback
out, error = io.StringIO(), ""
try:
    with contextlib.redirect_stdout(out):
        exec(compile(IMPORT_CHECK, "<import check>", "exec"), {"__name__": "__import_check__"})
except BaseException:
    error = traceback.format_exc()
with open(RESULT, "w") as file:
    json.dump({"stdout": out.getvalue(), "error": error}, file)
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


def _optional_test_files() -> list[str]:
    """The modules that mention the server's packages or the extension."""
    wanted = ("fastapi", "uvicorn", "openai", "vmemkv._native")
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if p.name != Path(__file__).name and any(name in p.read_text() for name in wanted))


@pytest.fixture(scope="module")
def first_contact_child(tmp_path_factory):
    """``(import check's {"stdout", "error"}, the collection's CompletedProcess)``."""
    tmp_path = tmp_path_factory.mktemp("first_contact")
    record = tmp_path / "import_check.json"
    code = f"IMPORT_CHECK = {IMPORT_CHECK!r}\nRESULT = {str(record)!r}\n{CHILD}"
    result = _run_python(code, tmp_path, "--collect-only", "-q", "-rs", "-p", "no:cacheprovider",
                         *_optional_test_files())
    assert record.exists(), result.stdout + result.stderr  # the child died before recording
    return json.loads(record.read_text()), result


def test_vmemkv_imports_without_the_native_extension_and_the_cpu_backend_says_why(first_contact_child):
    import_check, _ = first_contact_child
    assert import_check["error"] == "", import_check["error"]
    assert import_check["stdout"].strip() == "ok"


def test_test_modules_needing_optional_packages_skip_instead_of_erroring(first_contact_child):
    # The modules that mention the server's packages or the extension, collected as the GPU
    # check collects them (the whole suite's collection is gpu_check.sh's gpu_marked_tests step).
    files = _optional_test_files()
    assert "tests/test_server.py" in files and "tests/test_vmm_cpu.py" in files
    _, result = first_contact_child
    assert result.returncode in (0, 5), result.stdout + result.stderr  # 5: nothing left to run
    assert "error" not in result.stdout.lower(), result.stdout
    assert "SKIPPED" in result.stdout


# ---- bench_mapping: a broken CUDA backend fails, no CUDA skips --------------------------------

@pytest.fixture
def bench_mapping(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))  # it imports machine.py beside it
    spec = importlib.util.spec_from_file_location("bench_mapping", ROOT / "experiments" / "bench_mapping.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_mapping_skips_without_cuda_with_its_own_exit_status(bench_mapping, monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert bench_mapping.main(["--json", "--cuda-only"]) == bench_mapping.EXIT_SKIPPED == 3
    assert "no CUDA" in json.loads(capsys.readouterr().out)["skipped"]


def test_bench_mapping_fails_when_the_cuda_backend_is_broken(bench_mapping, monkeypatch, capsys):
    import vmemkv.vmm.cuda
    from vmemkv.errors import CudaDriverError

    class BrokenBackend:
        def __init__(self, *args, **kwargs):
            raise CudaDriverError("cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY")

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(vmemkv.vmm.cuda, "CudaBackend", BrokenBackend)
    assert bench_mapping.main(["--json", "--cuda-only"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert "CUDA_ERROR_OUT_OF_MEMORY" in result["cuda_error"]


# ---- gpu_check.sh: fits its budget -----------------------------------------------------------

def test_gpu_check_step_limits_fit_five_minutes():
    script = ROOT / "experiments" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    listed = json.loads(subprocess.run(["bash", str(script), "--list"], capture_output=True,
                                       text=True, check=True).stdout)
    assert listed["limits_sum_s"] == sum(listed["steps"].values()) <= listed["budget_s"] <= 280
    assert {"install", "ab_quick", "bench_mapping"} <= set(listed["steps"])
