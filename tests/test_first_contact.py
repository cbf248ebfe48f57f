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
from vmemkv.memory.vmm import create_backend

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
    # collection errors, not test names that say "error"
    assert not any(line.startswith("ERROR") or " error" in line for line in result.stdout.splitlines()
                   if "::" not in line), result.stdout
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
    import vmemkv.memory.vmm.cuda
    from vmemkv.errors import CudaDriverError

    class BrokenBackend:
        def __init__(self, *args, **kwargs):
            raise CudaDriverError("cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY")

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(vmemkv.memory.vmm.cuda, "CudaBackend", BrokenBackend)
    assert bench_mapping.main(["--json", "--cuda-only"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert "CUDA_ERROR_OUT_OF_MEMORY" in result["cuda_error"]


# ---- gpu_check.sh: fits its budget, runs every GPU test, reports when cut short ----------------

GPU_CHECK = ROOT / "experiments" / "gpu_check.sh"
# The order of the issue that set it: what tells most about a first GPU run comes first.
STEP_ORDER = ["install", "environment", "vmm_cuda", "flash_gpu", "triton_gpu", "engine_gpu", "ab_quick"]


def gpu_check_steps() -> dict:
    subprocess.run(["bash", "-n", str(GPU_CHECK)], check=True)
    return json.loads(subprocess.run(["bash", str(GPU_CHECK), "--list"], capture_output=True,
                                     text=True, check=True).stdout)


def test_gpu_check_fits_four_minutes_most_informative_steps_first():
    listed = gpu_check_steps()
    steps = listed["steps"]
    worst = sum(step["limit_s"] + listed["kill_grace_s"] for step in steps)
    assert listed["limits_sum_s"] == worst <= listed["budget_s"] <= 240  # 5 minutes, 60 s spare
    names = [step["step"] for step in steps]
    assert names[:len(STEP_ORDER)] == STEP_ORDER
    assert {"bench_mapping", "bench_kernels"} <= set(names)
    assert all(0 < step["gpu_estimate_s"] <= step["limit_s"] for step in steps)


def test_every_gpu_test_is_run_by_a_gpu_check_step():
    selections = [arg for step in gpu_check_steps()["steps"] for arg in step["pytest_args"]
                  if not arg.startswith("-")]
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                   if "mark.gpu" in p.read_text())
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
                                "-p", "no:cacheprovider", *files], capture_output=True, text=True,
                               cwd=ROOT, timeout=300)
    gpu_tests = [line for line in collected.stdout.splitlines() if "::" in line]
    assert len(gpu_tests) > 40, collected.stdout + collected.stderr
    missed = [test for test in gpu_tests
              if not any(test == sel or test.startswith(sel + "::") or test.startswith(sel + "[")
                         for sel in selections)]
    assert not missed, f"GPU tests no gpu_check step runs: {missed}"


def test_gpu_check_stopped_from_outside_still_writes_its_summary(tmp_path):
    """TERM while a step runs (as the device's time limit sends it): the step is recorded as
    KILLED, the steps after it never start, and summary.json says so."""
    import signal
    import time

    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    check = subprocess.Popen(["bash", str(GPU_CHECK), "--dry-run"], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    summary = tmp_path / "summary.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and '"running"' not in (summary.read_text() if summary.exists() else ""):
        time.sleep(0.1)
    running = json.loads(summary.read_text())["steps"][-1]
    assert running["status"] == "running", running
    check.send_signal(signal.SIGTERM)
    output, _ = check.communicate(timeout=60)
    assert check.returncode == 1, output
    steps = json.loads(summary.read_text())["steps"]
    assert steps[-1]["step"] == running["step"] and steps[-1]["status"] == "KILLED", steps
    assert "KILLED after" in output
