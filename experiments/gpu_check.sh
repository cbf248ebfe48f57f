#!/usr/bin/env bash
# One-shot GPU check: install, environment, the GPU tests, the GPU benchmarks and a quick A/B,
# in one run within 5 minutes on one H200 (so that a fix and a rerun fit a short slot).
#
#   bash experiments/gpu_check.sh              # writes under $OUT (else ./gpu_out)
#   bash experiments/gpu_check.sh --dry-run    # or GPU_CHECK_DRY=1: every step on CPU, quickly
#   bash experiments/gpu_check.sh --list       # the steps and their time limits, as JSON
#
# Each step runs under `timeout`; the limits below add up to at most BUDGET_S (checked before
# anything runs), so the whole run fits 5 minutes whatever happens. A failing step does not stop
# the others, except the install: without a build nothing else means anything.
# Each step prints one JSON line {"step", "status", "seconds", "limit_s"}; status is ok,
# "skipped: ..." (no CUDA here, or nothing to measure), "no tests", FAIL (rc=N) or TIMEOUT.
#
# Files under $OUT, at most 8 (that is all that comes back from the device):
#   gpu_check.log      every step's command and output, in order
#   summary.json       the step lines, rewritten after every step (complete even if killed)
#   bench_mapping.json, bench_kernels.json   the benchmarks' JSON (stdout)
#   ab.json, ab.md     the quick A/B (vmem vs paged on the device's 2 MiB pages)
#
# Dry run: no install (pip only prepares the package metadata, and the C extension is compiled
# into a temporary directory, so the environment is left as it was), CUDA hidden
# (CUDA_VISIBLE_DEVICES=""), so the GPU steps run their skip paths, and the A/B runs on CPU with
# 2 MiB pages (1024 tokens per page, as tiny-llama gets on CUDA).
#
# Exit status: 0 when every step is ok or skipped, 1 when a step failed or timed out, 2 when the
# install failed (nothing else was run).

set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
PY="${PYTHON:-python3}"
DRY="${GPU_CHECK_DRY:-0}"
LIST=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --list) LIST=1 ;;
    -h|--help) sed -n '2,/^$/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument $arg (use --dry-run, --list or --help)" >&2; exit 2 ;;
  esac
done

BUDGET_S=280  # 5 minutes less a margin for timeouts' kill grace and the summary
# Step limits in seconds, in run order. Their sum must stay within BUDGET_S.
STEP_NAMES=(install environment test_vmm_cuda gpu_marked_tests bench_mapping bench_kernels ab_quick)
# gpu_marked_tests holds the engine runs on the GPU (test_window_release_gpu: six runs of about
# 600 decode steps; test_hybrid_gpu: nine runs of about 45 steps plus the Triton kernel's first
# compilations; test_gpu_engine, the kernel tests): expected 65-95 s, none of it measured yet, so
# it runs verbose with --durations (the log then says what each test took, and where a timeout
# stopped) and takes seconds from steps whose CPU-side share is small (test_vmm_cuda's 32 CPU
# tests take 1 s here).
declare -A LIMIT=(
  [install]=40 [environment]=15 [test_vmm_cuda]=30 [gpu_marked_tests]=95
  [bench_mapping]=20 [bench_kernels]=30 [ab_quick]=45
)
# The A/B's workloads: its two checks (prefix hits, preemption) and copy-on-write forks.
AB_WORKLOADS="${GPU_CHECK_AB_WORKLOADS:-shared-prefix,pressure,parallel-n4}"

total_limits=0
for name in "${STEP_NAMES[@]}"; do total_limits=$(( total_limits + LIMIT[$name] )); done
if (( LIST )); then
  printf '{"budget_s": %d, "limits_sum_s": %d, "steps": {' "$BUDGET_S" "$total_limits"
  sep=""
  for name in "${STEP_NAMES[@]}"; do printf '%s"%s": %d' "$sep" "$name" "${LIMIT[$name]}"; sep=", "; done
  printf '}}\n'
  exit 0
fi
if (( total_limits > BUDGET_S )); then
  echo "gpu_check: the step limits add up to ${total_limits}s, more than the ${BUDGET_S}s budget; fix LIMIT" >&2
  exit 2
fi

OUT_DIR="${OUT:-$ROOT/gpu_out}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
SUMMARY="$OUT_DIR/summary.json"
: >"$LOG"
# Tests import vmemkv from the source tree even if the editable install did not happen.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
if (( DRY )); then
  export CUDA_VISIBLE_DEVICES=""  # the GPU steps take their "no CUDA" paths, even on a GPU box
fi
HAVE_CUDA=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)

START_S=$SECONDS
LINES=()
FAILED=0

write_summary() {
  local IFS=,
  printf '{"dry_run": %s, "cuda": %s, "budget_s": %d, "seconds": %d, "steps": [%s]}\n' \
    "$( (( DRY )) && echo true || echo false)" "$( (( HAVE_CUDA )) && echo true || echo false)" \
    "$BUDGET_S" "$(( SECONDS - START_S ))" "${LINES[*]}" >"$SUMMARY"
}

record() {  # name status seconds limit
  local line
  line=$(printf '{"step": "%s", "status": "%s", "seconds": %d, "limit_s": %d}' "$1" "$2" "$3" "$4")
  LINES+=("$line")
  echo "$line"
  echo "=== result: $line" >>"$LOG"
  case "$2" in ok|skipped*|"no tests") ;; *) FAILED=1 ;; esac
  write_summary
}

# json_skip FILE: the "skipped" reason of a JSON object on the file's last line, if any.
json_skip() {
  "$PY" - "$1" <<'EOF' 2>/dev/null
import json, sys
try:
    lines = open(sys.argv[1]).read().strip().splitlines()
    reason = json.loads(lines[-1]).get("skipped") if lines else None
except Exception:
    reason = None
if reason:
    print(str(reason).replace('"', "'").replace("\\", "/")[:150])
EOF
}

# run_step NAME NEEDS_CUDA STDOUT_FILE CMD...  (STDOUT_FILE "-": stdout into the log too)
# Exit status 3 from a command means "skipped, nothing to do here" (bench_mapping --cuda-only).
run_step() {
  local name="$1" needs_cuda="$2" stdout_file="$3"; shift 3
  local limit=${LIMIT[$name]} t0=$SECONDS rc status offset skip
  offset=$(wc -c <"$LOG")
  { echo; echo "=== $name (limit ${limit}s): $*"; } >>"$LOG"
  if [[ "$stdout_file" == "-" ]]; then
    timeout --kill-after=5 "$limit" "$@" >>"$LOG" 2>&1
  else
    timeout --kill-after=5 "$limit" "$@" >"$stdout_file" 2>>"$LOG"
  fi
  rc=$?
  case "$rc" in
    0) status="ok" ;;
    3) status="skipped" ;;
    5) [[ "$*" == *pytest* ]] && status="no tests" || status="FAIL (rc=5)" ;;
    124|137) status="TIMEOUT (${limit}s)" ;;
    *) status="FAIL (rc=$rc)" ;;
  esac
  if [[ "$status" == ok || "$status" == skipped ]] && [[ "$stdout_file" != "-" ]]; then
    skip=$(json_skip "$stdout_file")
    [[ -n "$skip" ]] && status="skipped: $skip"
  fi
  if [[ "$status" == ok || "$status" == skipped ]] && [[ "$needs_cuda" == 1 ]] && (( ! HAVE_CUDA )); then
    status="skipped: no CUDA"  # it ran (imports, collection, skip paths) but measured nothing
  fi
  if [[ "$status" != ok && "$status" != skipped* && "$status" != "no tests" ]]; then
    echo "--- $name: last lines of its output (all of it in $LOG):"
    tail -c +"$(( offset + 1 ))" "$LOG" | tail -n 25
  fi
  record "$name" "$status" "$(( SECONDS - t0 ))" "$limit"
}

echo "gpu_check: repo $ROOT, output in $OUT_DIR, python $(command -v "$PY"), CUDA $HAVE_CUDA, dry run $DRY"

# --- install ----------------------------------------------------------------------------------
# Offline, with the image's own setuptools: no build isolation, no dependencies. An editable
# install needs setuptools >= 64 (and, below 70.1, the `wheel` package); when it fails, building
# the C extension in place is enough (the steps import vmemkv from the source tree).
if (( DRY )); then
  BUILD_TMP=$(mktemp -d)
  trap 'rm -rf "$BUILD_TMP"' EXIT
  run_step install 0 - bash -c "
    '$PY' -m pip install --dry-run --no-deps --no-build-isolation -e . ||
      echo 'gpu_check: an editable install would fail here; the real run builds in place instead'
    '$PY' setup.py -q build_ext --build-lib '$BUILD_TMP/lib' --build-temp '$BUILD_TMP/tmp' &&
    ls '$BUILD_TMP'/lib/vmemkv/_native*"
else
  run_step install 0 - bash -c "
    '$PY' -m pip install --no-deps --no-build-isolation -e . && exit 0
    echo 'gpu_check: the editable install failed; building the C extension in place instead'
    '$PY' setup.py build_ext --inplace"
fi
if [[ "${LINES[-1]}" != *'"status": "ok"'* ]]; then
  echo "gpu_check: STOPPED: the install step failed (neither the editable install nor building the"
  echo "  C extension in place worked), so nothing else was run; its output is in $LOG."
  echo "  Try \`$PY setup.py build_ext --inplace\` by hand (it needs a C compiler and the Python headers)."
  exit 2
fi

# --- environment ------------------------------------------------------------------------------
run_step environment 0 - bash -c "
  if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo 'nvidia-smi: not found'; fi
  '$PY' - <<'EOF'
import importlib, platform
print('python', platform.python_version())
for name in ('torch', 'triton', 'transformers', 'numpy', 'setuptools', 'cuda.bindings', 'flash_attn',
             'vmemkv', 'vmemkv._native', 'vmemkv.vmm.cuda', 'fastapi', 'openai'):
    try:
        module = importlib.import_module(name)
        print(f'{name:16s}', getattr(module, '__version__', '(no __version__)'))
    except Exception as exc:
        print(f'{name:16s} not importable: {type(exc).__name__}: {exc}')
import torch
print('torch cuda', torch.version.cuda, 'available', torch.cuda.is_available())
if torch.cuda.is_available():
    print('device', torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
    free, total = torch.cuda.mem_get_info(0)
    print(f'memory free {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB')
    from cuda.bindings import driver
    print('driver API version', driver.cuDriverGetVersion()[1])
import vmemkv  # the one import that must work
EOF"

# --- GPU tests --------------------------------------------------------------------------------
# Every GPU test is marked `@pytest.mark.gpu`; test_vmm_cuda.py also runs whole (the backend's
# CPU-side tests against the real cuda-bindings). No --continue-on-collection-errors: test modules
# whose packages are missing skip themselves, so a collection error is a real failure.
PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider)
run_step test_vmm_cuda 1 - "${PYTEST[@]}" tests/test_vmm_cuda.py
run_step gpu_marked_tests 1 - "${PYTEST[@]}" -v --durations=20 -m gpu --ignore=tests/test_vmm_cuda.py tests

# --- benchmarks -------------------------------------------------------------------------------
run_step bench_mapping 1 "$OUT_DIR/bench_mapping.json" \
  "$PY" experiments/bench_mapping.py --json --cuda-only --reps 3
run_step bench_kernels 1 "$OUT_DIR/bench_kernels.json" "$PY" experiments/bench_kernels.py --json

# --- the quick A/B ----------------------------------------------------------------------------
# vmem against paged only: on 2 MiB CUDA pages the per-layer layout holds 8x the tokens of a
# token-major page, so the same workloads cannot test it (see `vmemkv ab --help`).
AB=("$PY" -m vmemkv.ab.cli --quick --workloads "$AB_WORKLOADS" --variants vmem,paged
    --no-progress --no-plots --out "$OUT_DIR")
if (( HAVE_CUDA )); then
  run_step ab_quick 0 - "${AB[@]}" --device cuda
else  # the same command on CPU with the device's page (2 MiB: 1024 tokens of tiny-llama, fp32)
  run_step ab_quick 0 - "${AB[@]}" --device cpu --tokens-per-page 1024
fi

echo "gpu_check: done in $(( SECONDS - START_S ))s (budget ${BUDGET_S}s); $(ls -1 "$OUT_DIR" | wc -l) files in $OUT_DIR"
cat "$SUMMARY"
exit "$FAILED"
