#!/usr/bin/env bash
# One-shot GPU check: install, environment, every GPU test, GPU benchmarks; within 8 minutes.
#
#   bash experiments/gpu_check.sh            # logs under $OUT when set, else ./gpu_out
#
# Every step runs under `timeout` and a shared deadline; a failing step does not stop the
# others; a summary table (step, status, seconds) comes last and is saved as summary.tsv.
# Exit status: 0 when every step passed (or had nothing to run), 1 otherwise.
#
# To add GPU tests: mark them `@pytest.mark.gpu` anywhere under tests/ (picked up by the
# "gpu-marked tests" step), or add a whole file to GPU_TEST_FILES. To add a benchmark, add a
# line to BENCHMARKS ("name|script|args").

set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
OUT_DIR="${OUT:-$ROOT/gpu_out}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
TOTAL_BUDGET_S="${GPU_CHECK_BUDGET_S:-465}"  # 8 minutes less a margin for the summary
# Tests import vmemkv even if the editable install fails.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

# Whole files that hold GPU tests (run completely, CPU tests included).
GPU_TEST_FILES=(tests/test_vmm_cuda.py)
# Benchmarks: name|script|arguments. Stdout goes to $OUT_DIR/<name>.json, stderr to the log.
BENCHMARKS=(
  "bench_mapping|experiments/bench_mapping.py|--json"
  "bench_kernels|experiments/bench_kernels.py|--json"
  "ab_quick|-m vmemkv.ab.cli|--quick --device cuda --no-progress --json"
)

START_S=$SECONDS
STEPS=()
STATUSES=()
DURATIONS=()
FAILED=0

record() {  # name status seconds
  STEPS+=("$1"); STATUSES+=("$2"); DURATIONS+=("$3")
  case "$2" in ok|"no tests"|missing) ;; *) FAILED=1 ;; esac
  printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$OUT_DIR/summary.tsv"
}

# run_step NAME LIMIT_S STDOUT_FILE CMD...   (STDOUT_FILE "-" means: into the log)
run_step() {
  local name="$1" limit="$2" stdout_file="$3"; shift 3
  local log="$OUT_DIR/$name.log"
  local left=$(( TOTAL_BUDGET_S - (SECONDS - START_S) ))
  echo
  echo "=== $name: $* (limit ${limit}s, ${left}s left)"
  if (( left < 15 )); then
    echo "--- $name: not run, the 8-minute budget is spent"
    record "$name" "no time" 0
    return
  fi
  (( limit > left - 5 )) && limit=$(( left - 5 ))
  local t0=$SECONDS rc
  if [[ "$stdout_file" == "-" ]]; then
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  else
    timeout --kill-after=10 "$limit" "$@" >"$stdout_file" 2>"$log"
  fi
  rc=$?
  local took=$(( SECONDS - t0 )) status
  case "$rc" in
    0) status="ok" ;;
    124|137) status="TIMEOUT (${limit}s)" ;;
    *) status="FAIL (rc=$rc)" ;;
  esac
  if [[ "$status" != ok && "$*" == *pytest* && "$rc" == 5 ]]; then
    status="no tests"  # pytest: nothing collected or everything deselected
  fi
  tail -n 40 "$log"
  if [[ "$stdout_file" != "-" ]]; then
    echo "--- stdout saved to $stdout_file ($(wc -c <"$stdout_file") bytes)"
  fi
  echo "--- $name: $status in ${took}s"
  record "$name" "$status" "$took"
}

: >"$OUT_DIR/summary.tsv"
echo "gpu_check: repo $ROOT, logs in $OUT_DIR, python $(command -v "$PY")"

run_step install 120 - "$PY" -m pip install --no-deps --no-build-isolation -e .

run_step environment 40 - bash -c "
  nvidia-smi
  '$PY' - <<'EOF'
import importlib, platform
print('python', platform.python_version())
for name in ('torch', 'triton', 'transformers', 'numpy', 'cuda.bindings', 'flash_attn', 'vmemkv'):
    try:
        module = importlib.import_module(name)
        print(f'{name:14s}', getattr(module, '__version__', '(no __version__)'))
    except Exception as exc:
        print(f'{name:14s} not importable: {type(exc).__name__}: {exc}')
import torch
print('torch cuda', torch.version.cuda, 'available', torch.cuda.is_available())
if torch.cuda.is_available():
    print('device', torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
    free, total = torch.cuda.mem_get_info(0)
    print(f'memory free {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB')
try:
    from cuda.bindings import driver
    err, version = driver.cuDriverGetVersion()
    print('driver API version', version)
except Exception as exc:
    print('cuda-python driver:', type(exc).__name__, exc)
EOF"

for file in "${GPU_TEST_FILES[@]}"; do
  name="$(basename "$file" .py)"
  if [[ -f "$file" ]]; then
    run_step "$name" 180 - "$PY" -m pytest -q -rs -p no:cacheprovider \
      --junitxml="$OUT_DIR/$name.xml" "$file"
  else
    echo "=== $name: $file is missing"; record "$name" missing 0
  fi
done

IGNORES=()
for file in "${GPU_TEST_FILES[@]}"; do IGNORES+=("--ignore=$file"); done
# --continue-on-collection-errors: the device lacks the server's packages (fastapi, uvicorn,
# openai), so tests/test_server.py cannot even be collected there; the GPU tests still run.
run_step gpu_marked_tests 150 - "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu \
  --continue-on-collection-errors \
  --junitxml="$OUT_DIR/gpu_marked_tests.xml" "${IGNORES[@]}" tests

for entry in "${BENCHMARKS[@]}"; do
  IFS='|' read -r name script args <<<"$entry"
  if [[ "$script" == "-m "* || -f "$script" ]]; then  # a file, or "-m module"
    # shellcheck disable=SC2086  # script and args are words on purpose
    run_step "$name" 150 "$OUT_DIR/$name.json" "$PY" $script $args
  else
    echo "=== $name: $script is missing (not written yet?)"; record "$name" missing 0
  fi
done

echo
echo "=== summary (total $(( SECONDS - START_S ))s; logs in $OUT_DIR)"
printf '%-24s %-22s %8s\n' step status seconds
for i in "${!STEPS[@]}"; do
  printf '%-24s %-22s %8s\n' "${STEPS[$i]}" "${STATUSES[$i]}" "${DURATIONS[$i]}"
done
exit "$FAILED"
