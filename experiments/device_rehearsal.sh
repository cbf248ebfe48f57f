#!/usr/bin/env bash
# First contact with the GPU device, rehearsed on CPU, so that a version difference fails here and
# not on the device's one short lease. .ci/run runs it after the test suite.
#
#   bash experiments/device_rehearsal.sh              # every part below, the whole test suite
#   bash experiments/device_rehearsal.sh --quick      # the tests against HF only (about 2 minutes)
#   bash experiments/device_rehearsal.sh -k crop      # other arguments go to the tests' pytest
#
# 1. venv: the device image's packages where they exist for CPU (experiments/device_requirements.txt:
#    transformers 5.17.0, triton 3.6.0, torch 2.13.0 CPU from this disk, and none of fastapi,
#    uvicorn, openai, pyzmq, msgspec, gguf, flash-attn). Built once into the cache
#    ($VMEMKV_REHEARSAL_VENV, else ~/.cache/vmemkv/device-rehearsal-<hash of the requirements>).
# 2. packages: the pinned versions are the ones importable, the device's missing ones are absent.
# 3. install: the project as gpu_check.sh installs it on the device (--no-deps --no-build-isolation).
# 4. gpu_check: `experiments/gpu_check.sh --dry-run` under the venv's Python.
# 5. tests: the test suite under that transformers and triton, with the server's packages absent
#    (their tests skip, saying so). With --quick only the engine and VmemkvCache against HF
#    `generate`, the Triton kernels under Triton's interpreter and the first-contact checks.
# 6. python312: the device runs Python 3.12: every source compiles under it and the C extension
#    builds against its headers and maps real pages (experiments/native_smoke.py). Skipped, with
#    the reason, where no 3.12 interpreter is found.
# Each part prints one line "rehearsal: PART ok|FAIL|skipped (N s)"; exit status 1 if any failed.

set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
REQUIREMENTS=experiments/device_requirements.txt
CACHE="${VMEMKV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vmemkv}"
KEY=$(sha256sum "$REQUIREMENTS" | cut -c1-12)
VENV="${VMEMKV_REHEARSAL_VENV:-$CACHE/device-rehearsal-$KEY}"
VPY="$VENV/bin/python"
BASE_PYTHON="${REHEARSAL_BASE_PYTHON:-python3}"
MISSING_ON_DEVICE=(fastapi uvicorn openai zmq msgspec gguf flash_attn)
QUICK_TESTS=(
  tests/test_engine_correctness.py        # the engine against HF generate (dense models)
  tests/test_sliding_window_models.py     # sliding-window and hybrid models against HF
  tests/test_chunked_attention_models.py  # Llama-4's chunked local attention against HF
  tests/test_hybrid_engine.py
  tests/test_window_release.py
  tests/test_host_tier_engine.py
  tests/test_unsupported_attention.py     # the attention kinds refused at load time
  tests/test_state_engine.py              # recurrent hybrids against HF (skip where mixers lack `cache`)
  tests/test_integration_transformers.py  # VmemkvCache in model.generate()
  tests/test_triton_decode.py             # the Triton kernels under triton 3.6's interpreter
  tests/test_first_contact.py             # imports without the optional packages
)
FAILED=0
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

part() {  # NAME CMD...: runs CMD, prints its result line
  local name="$1" t0=$SECONDS rc; shift
  echo "=== rehearsal: $name: $*"
  "$@"
  rc=$?
  if (( rc == 0 )); then echo "rehearsal: $name ok ($(( SECONDS - t0 )) s)"
  elif (( rc == 77 )); then echo "rehearsal: $name skipped ($(( SECONDS - t0 )) s)"
  else echo "rehearsal: $name FAIL (rc=$rc, $(( SECONDS - t0 )) s)"; FAILED=1; fi
  return "$rc"
}

make_venv() {
  [[ -f "$VENV/.complete" ]] && { echo "reusing $VENV"; return 0; }
  rm -rf "$VENV"
  "$BASE_PYTHON" -m venv "$VENV" &&
    "$VPY" -m pip install -q --disable-pip-version-check -r "$REQUIREMENTS" &&
    touch "$VENV/.complete"
}

check_packages() {
  "$VPY" - "$REQUIREMENTS" "${MISSING_ON_DEVICE[@]}" <<'EOF'
import importlib.metadata as md, importlib.util, re, sys
requirements, missing = sys.argv[1], sys.argv[2:]
wrong = []
for line in open(requirements):
    pin = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line.split("#")[0].strip())
    if pin:
        name, version = pin.groups()
        have = md.version(name)
        print(f"{name:18s} {have}")
        if have.split("+")[0] != version:
            wrong.append(f"{name} is {have}, the device has {version}")
wrong += [f"{name} is importable; the device does not have it" for name in missing
          if importlib.util.find_spec(name) is not None]
print("\n".join(wrong) or f"absent, as on the device: {', '.join(missing)}")
sys.exit(1 if wrong else 0)
EOF
}

install_project() {
  "$VPY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . &&
    "$VPY" -c 'import vmemkv._native, vmemkv; print("vmemkv from", vmemkv.__file__)'
}

run_gpu_check() {
  PYTHON="$VPY" OUT="$WORK/gpu_out" bash experiments/gpu_check.sh --dry-run
}

run_tests() {
  local selection=(tests) args=()
  for arg in "$@"; do
    if [[ "$arg" == --quick ]]; then selection=("${QUICK_TESTS[@]}"); else args+=("$arg"); fi
  done
  "$VPY" -m pytest -q -p no:cacheprovider "${selection[@]}" "${args[@]}"
}

find_python312() {
  local candidate
  for candidate in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

python312() {
  local py venv312="$CACHE/device-rehearsal-py312"
  if ! py=$(find_python312); then
    echo "no Python 3.12 interpreter here (tried python3.12 and pyenv's versions/3.12*)"
    return 77
  fi
  echo "Python 3.12: $py ($("$py" -c 'import sys; print(sys.version.split()[0])'))"
  # torch has no CPU wheel for 3.12 on this disk (PyPI's is a multi-GB CUDA build), so what runs
  # under 3.12 here is what needs no torch: the sources compile, the extension builds and maps.
  PYTHONPYCACHEPREFIX="$WORK/pycache312" "$py" -m compileall -q vmemkv experiments tests || return 1
  if [[ ! -f "$venv312/.complete" ]]; then
    rm -rf "$venv312"
    "$py" -m venv "$venv312" && "$venv312/bin/python" -m pip install -q --disable-pip-version-check setuptools &&
      touch "$venv312/.complete" || return 1
  fi
  "$venv312/bin/python" setup.py -q build_ext --build-lib "$WORK/lib312" --build-temp "$WORK/tmp312" \
    >"$WORK/build312.log" 2>&1 || { cat "$WORK/build312.log"; return 1; }
  "$venv312/bin/python" experiments/native_smoke.py "$WORK/lib312"
}

START=$SECONDS
echo "rehearsal: venv $VENV (from $BASE_PYTHON, $REQUIREMENTS)"
if part venv make_venv && part packages check_packages && part install install_project; then
  part gpu_check run_gpu_check
  part tests run_tests "$@"
else
  echo "rehearsal: STOPPED: without the device's packages and the project installed, the rest means nothing"
fi
part python312 python312
echo "rehearsal: done in $(( SECONDS - START )) s; $( (( FAILED )) && echo FAILED || echo passed)"
exit "$FAILED"
