#!/usr/bin/env bash
# One-shot GPU check: install, environment, the GPU tests, a quick A/B and the GPU benchmarks, in
# one run within 4 minutes on one H200, so that a fix and a rerun fit the device's 15-minute lease
# (its start included) with a minute to spare in each run.
#
#   bash experiments/gpu_check.sh              # writes under $OUT (else ./gpu_out)
#   bash experiments/gpu_check.sh --dry-run    # or GPU_CHECK_DRY=1: every step on CPU
#   bash experiments/gpu_check.sh --list       # the steps, their limits and GPU estimates, as JSON
#
# The steps run most informative first, so that a run cut short loses the least: the CUDA VMM
# backend, FlashAttention over slots, the Triton kernels, the engine against HF generate, the
# quick A/B, then the benchmarks. Each runs under its own `timeout`; the limits plus each step's
# kill grace add up to at most BUDGET_S (checked before anything runs), and a step never gets more
# than what is left of BUDGET_S, so the whole run ends within it whatever happens. A failing step
# does not stop the others, except the install: without a build nothing else means anything.
# Each step prints one JSON line {"step", "status", "seconds", "limit_s", "gpu_estimate_s"};
# status is ok, "skipped: ..." (no CUDA here, or nothing to measure), "no tests", FAIL (rc=N),
# TIMEOUT, "NOT RUN (out of time)" or KILLED (the whole check was stopped from outside).
#
# Files under $OUT, at most 8 (that is all that comes back from the device):
#   gpu_check.log      every step's command and output, in order
#   summary.json       the step lines, rewritten before and after every step, so that a run cut
#                      short still says which step was running ("status": "running")
#   bench_mapping.json, bench_kernels.json   the benchmarks' JSON (stdout)
#   ab.json, ab.md     the quick A/B (vmem vs paged on the device's 2 MiB pages)
#
# Dry run: no install (pip only prepares the package metadata, and the C extension is compiled
# into a temporary directory, so the environment is left as it was), CUDA hidden
# (CUDA_VISIBLE_DEVICES=""), so the GPU steps run their skip paths, and the A/B runs on CPU with
# 2 MiB pages (1024 tokens per page, as tiny-llama gets on CUDA). The CPU does other work at
# another speed than the GPU, so the dry run's limits and budget are DRY_SCALE times the GPU's:
# its times say what the CPU side costs, not what the device will take.
#
# Exit status: 0 when every step is ok or skipped, 1 when a step failed, timed out or was not run,
# 2 when the install failed (nothing else was run).

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

BUDGET_S=240     # 5 minutes less a minute to spare: limits + kill graces must fit
KILL_GRACE_S=3   # after its limit a step gets TERM, then KILL this many seconds later
DRY_SCALE=4      # the dry run's limits and budget, times the GPU's (see above)
STEP_NAMES=(install environment vmm_cuda flash_gpu triton_gpu engine_gpu ab_quick bench_mapping bench_kernels)
# Limits in seconds, and beside each the GPU time expected from the work the step does (none of it
# measured yet: the first run's log has each test's time, from --durations, to rebalance them by).
# A pytest step's fixed cost there: starting Python, importing torch, transformers and triton, and
# collecting (5-7 s on the image's 16 cores), then creating a CUDA context (1-3 s).
declare -A LIMIT=(
  [install]=15          # 8 s: pip's editable install, the page mapper compiled (1 s here)
  [environment]=12      # 6 s: nvidia-smi, importing torch and vmemkv, one CUDA context
  [vmm_cuda]=20         # 10 s: 52 tests, 32 of them CPU-side against the real cuda-bindings (1 s
                        #   here); the other 20 create, map and copy a few 2 MiB pages, ms each
  [flash_gpu]=35        # 25 s: 18 cases of FlashAttention-2 (torch's own, no compiling) against
                        #   float64 SDPA and the Triton kernel (about 8 first compilations, 1-2 s
                        #   each), and 2 engine runs of tiny-llama
  [triton_gpu]=35       # 24 s: 8 cases, about 12 compilations of the decode and combine kernels
                        #   (4 of them over int8 / fp8 rows with scales, kv_cache_dtype: over slots
                        #   and block tables; the estimate from before the block-table pair)
  [engine_gpu]=50       # 45 s: 21 tests, ~22 engine runs against HF generate: test_window_release_gpu six of
                        #   ~600 decode steps (tiny models: 3-5 ms a step, launch-bound), the rest
                        #   ~45-160 steps each, plus the Triton kernel's window/soft-cap variants;
                        #   test_state_gpu: a state group's pages forked and swapped (ms), and
                        #   tiny-lfm2 / tiny-qwen3-next (mixers per sequence: ~40 steps) against HF
  [ab_quick]=25         # 15 s: 3 workloads x 2 variants, one repeat, tiny-llama on 2 MiB pages
  [bench_mapping]=8     # 4 s: map/unmap of a few hundred 2 MiB pages, 3 repeats
  [bench_kernels]=13    # 10 s: 12 shapes x 2 kernels by do_bench, buffers up to 8 GiB, 2 compilations
)
declare -A GPU_ESTIMATE=(
  [install]=8 [environment]=6 [vmm_cuda]=10 [flash_gpu]=25 [triton_gpu]=24 [engine_gpu]=45
  [ab_quick]=15 [bench_mapping]=4 [bench_kernels]=10
)
# Each pytest step's arguments. Every GPU test is selected by one of them (tests/test_first_contact.py
# checks); test_vmm_cuda.py runs whole: its CPU-side tests run against the real cuda-bindings.
HOST_TIER_GPU=tests/test_host_tier.py::test_on_cuda_demotion_and_promotion_are_ordered_with_the_compute_stream
declare -A TEST_ARGS=(
  [vmm_cuda]="tests/test_vmm_cuda.py $HOST_TIER_GPU"
  [flash_gpu]="-m gpu tests/test_flash_attention_gpu.py"
  [triton_gpu]="-m gpu tests/test_triton_decode.py"
  [engine_gpu]="-m gpu tests/test_gpu_engine.py tests/test_hybrid_gpu.py tests/test_window_release_gpu.py
              tests/test_state_gpu.py"
)
# The A/B's workloads: its two checks (prefix hits, preemption) and copy-on-write forks.
AB_WORKLOADS="${GPU_CHECK_AB_WORKLOADS:-shared-prefix,pressure,parallel-n4}"

total_limits=0
for name in "${STEP_NAMES[@]}"; do total_limits=$(( total_limits + LIMIT[$name] + KILL_GRACE_S )); done
if (( LIST )); then
  printf '{"budget_s": %d, "kill_grace_s": %d, "limits_sum_s": %d, "dry_scale": %d, "steps": [' \
    "$BUDGET_S" "$KILL_GRACE_S" "$total_limits" "$DRY_SCALE"
  sep=""
  for name in "${STEP_NAMES[@]}"; do
    args=""
    for arg in ${TEST_ARGS[$name]:-}; do args+="${args:+, }\"$arg\""; done
    printf '%s{"step": "%s", "limit_s": %d, "gpu_estimate_s": %d, "pytest_args": [%s]}' \
      "$sep" "$name" "${LIMIT[$name]}" "${GPU_ESTIMATE[$name]}" "$args"
    sep=", "
  done
  printf ']}\n'
  exit 0
fi
if (( total_limits > BUDGET_S )); then
  echo "gpu_check: the step limits and kill graces add up to ${total_limits}s, more than the ${BUDGET_S}s budget; fix LIMIT" >&2
  exit 2
fi
if (( DRY )); then
  BUDGET_S=$(( BUDGET_S * DRY_SCALE ))
  for name in "${STEP_NAMES[@]}"; do LIMIT[$name]=$(( LIMIT[$name] * DRY_SCALE )); done
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

START_S=0  # $SECONDS counts from the script's start: the budget includes the lines above
LINES=()
FAILED=0
CURRENT=""  # the step running now, as a JSON line, for a summary written mid-step

write_summary() {
  local IFS=,
  local steps=("${LINES[@]}")
  [[ -n "$CURRENT" ]] && steps+=("$CURRENT")
  printf '{"dry_run": %s, "cuda": %s, "budget_s": %d, "seconds": %d, "steps": [%s]}\n' \
    "$( (( DRY )) && echo true || echo false)" "$( (( HAVE_CUDA )) && echo true || echo false)" \
    "$BUDGET_S" "$(( SECONDS - START_S ))" "${steps[*]}" >"$SUMMARY"
}

step_line() {  # name status seconds limit
  printf '{"step": "%s", "status": "%s", "seconds": %d, "limit_s": %d, "gpu_estimate_s": %d}' \
    "$1" "$2" "$3" "$4" "${GPU_ESTIMATE[$1]}"
}

record() {  # name status seconds limit
  local line
  line=$(step_line "$@")
  CURRENT=""
  LINES+=("$line")
  echo "$line"
  echo "=== result: $line" >>"$LOG"
  case "$2" in ok|skipped*|"no tests") ;; *) FAILED=1 ;; esac
  write_summary
}

# Stopped from outside (the device's own time limit, ^C): the running step is recorded as KILLED
# and every step not reached as NOT RUN, then the summary is written once more.
on_signal() {
  local name
  [[ -n "${STEP_PID:-}" ]] && kill -TERM "$STEP_PID" 2>/dev/null
  if [[ -n "$CURRENT" ]]; then
    name=$(sed 's/^{"step": "\([^"]*\)".*/\1/' <<<"$CURRENT")
    record "$name" "KILLED" "$(( SECONDS - STEP_T0 ))" "${LIMIT[$name]}"
  fi
  echo "gpu_check: KILLED after $(( SECONDS - START_S ))s" | tee -a "$LOG"
  exit 1
}
trap on_signal TERM INT HUP

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
# A step gets its limit, or what is left of the budget if that is less; with under 5 s left it
# is not run at all.
run_step() {
  local name="$1" needs_cuda="$2" stdout_file="$3"; shift 3
  local limit=${LIMIT[$name]} left rc status offset skip
  STEP_T0=$SECONDS
  left=$(( BUDGET_S - (SECONDS - START_S) - KILL_GRACE_S ))
  (( left < limit )) && limit=$left
  if (( limit < 5 )); then
    record "$name" "NOT RUN (out of time)" 0 "${LIMIT[$name]}"
    return
  fi
  offset=$(wc -c <"$LOG")
  { echo; echo "=== $name (limit ${limit}s): $*"; } >>"$LOG"
  CURRENT=$(step_line "$name" running 0 "$limit")
  write_summary
  # In the background and waited for, so that a TERM to this script is handled at once (bash
  # runs traps only between commands, and `wait` returns on a signal).
  if [[ "$stdout_file" == "-" ]]; then
    timeout --kill-after="$KILL_GRACE_S" "$limit" "$@" >>"$LOG" 2>&1 &
  else
    timeout --kill-after="$KILL_GRACE_S" "$limit" "$@" >"$stdout_file" 2>>"$LOG" &
  fi
  STEP_PID=$!
  wait "$STEP_PID"
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
  record "$name" "$status" "$(( SECONDS - STEP_T0 ))" "$limit"
}

echo "gpu_check: repo $ROOT, output in $OUT_DIR, python $(command -v "$PY"), CUDA $HAVE_CUDA, dry run $DRY"

# --- install ----------------------------------------------------------------------------------
# Offline, with the image's own setuptools: no build isolation, no dependencies. An editable
# install needs setuptools >= 64 (and, below 70.1, the `wheel` package); when it fails, building
# the C extension in place is enough (the steps import vmemkv from the source tree). The page
# mapper only: the CPU kernels serve no step here, and the CPU decode attention alone takes ~45 s
# to compile on one core, more than this step's limit (setup.py: VMEMKV_NATIVE_CPU_KERNELS).
export VMEMKV_NATIVE_CPU_KERNELS=0
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
             'vmemkv', 'vmemkv._native', 'vmemkv.memory.vmm.cuda', 'fastapi', 'openai'):
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

# --- GPU tests, most informative first ---------------------------------------------------------
# Every GPU test is marked `@pytest.mark.gpu`; test_vmm_cuda.py runs whole (the backend's CPU-side
# tests against the real cuda-bindings). Each step is its own process, so that a CUDA error that
# poisons one context (an illegal address) fails that step alone. Verbose with --durations: the
# log says what each test took, and where a timeout stopped. No --continue-on-collection-errors:
# test modules whose packages are missing skip themselves, so a collection error is a failure.
PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider -v --durations=15)
for name in vmm_cuda flash_gpu triton_gpu engine_gpu; do
  # shellcheck disable=SC2086  # TEST_ARGS are space-separated words without spaces
  run_step "$name" 1 - "${PYTEST[@]}" ${TEST_ARGS[$name]}
done

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

# --- benchmarks -------------------------------------------------------------------------------
run_step bench_mapping 1 "$OUT_DIR/bench_mapping.json" \
  "$PY" experiments/bench_mapping.py --json --cuda-only --reps 3
run_step bench_kernels 1 "$OUT_DIR/bench_kernels.json" "$PY" experiments/bench_kernels.py --json

echo "gpu_check: done in $(( SECONDS - START_S ))s (budget ${BUDGET_S}s); $(ls -1 "$OUT_DIR" | wc -l) files in $OUT_DIR"
cat "$SUMMARY"
exit "$FAILED"
