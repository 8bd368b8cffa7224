#!/usr/bin/env bash
# The prepared GPU run: one command on a GPU machine with torch and triton preinstalled (an H200 with torch 2.11
# and triton 3.6 so far) and no package registry needed: specdec is installed in place with
# `pip install --no-deps --no-build-isolation -e .` (offline; without the C++ CPU ops, which no step uses).
#
#   bash bench/gpu.sh [RESULTS_DIR]        (or SPECDEC_GPU_RESULTS=DIR; default $OUT/gpu-<date> where $OUT is set,
#                                           as the device tool sets it, else bench/results/gpu-<date>)
#
# Steps, each in its own process with its own timeout and log (a failure or a hang costs only its step):
#   env             GPU, driver, versions, the imports
#   tests-cuda      tests/backends/test_cuda.py: the compiled Triton kernels on CUDA vs the reference
#   loop            the shipped model pair and the target's MTP module on CUDA (steps replayed as CUDA graphs, and one
#                   eager run): speculative vs autoregressive, fp32 (greedy outputs must be
#                   identical) and bf16
#   copy            the copy-bandwidth ceiling (device-to-device copy_, 256 MiB .. 16 GiB)
#   e2e             python -m bench.e2e --device cuda on the shipped pair: the rows the speedup floors judge
#                   (bench/results/e2e-floors.md: draft model, MTP, prompt lookup; fixed and adaptive; greedy,
#                   sampled, a batch) with steps replayed as CUDA graphs, and some eagerly, with the time outside
#                   the target's forward per step (e2e-cuda.md / .json)
#   grid-<op>       python -m bench --device cuda --ops <op>, one process per op, targets first; grid-mla: MLA
#                   tree attention at DeepSeek-V3's shapes (python -m bench.op_mla, its table in the summary)
#   sweep           python -m bench.sweep: the Triton tunables at the target shapes (what the heuristics
#                   should choose), one variant per row, ranked
#   tests-backends  the backend test files (kv_cache, layouts, accept, accept_lossless, tree_attention, then the
#                   accept variants' and packed attention's) on CUDA, one pytest run each
#                   (SPECDEC_TEST_DEVICE=cuda, TRITON_INTERPRET=0), last, with what the budget has left
#   sanitize        not in the default steps: compute-sanitizer over the backend tests on CUDA, memcheck (every
#                   out-of-bounds or misaligned access of every kernel) of SPECDEC_SANITIZE_TESTS, then racecheck
#                   (shared-memory hazards: the kernels' block-wide reductions) of SPECDEC_RACECHECK_TESTS; a
#                   sanitizer's launch costs 10-100x, so these are the small cases (SPECDEC_SANITIZE_K filters).
#                   compute-sanitizer works on Firecracker machines and refuses gVisor's ("Device not supported"):
#                   the step's log says which. Its own call, after the first:
#                     SPECDEC_GPU_STEPS="env sanitize" SPECDEC_GPU_BUDGET=300 bash bench/gpu.sh DIR
#   summary         merged results + PASS/FAIL against the targets, then the sweep's ranking
# RESULTS_DIR ends up with summary.md, bench-<date>-<device>.json/.md (merged results), sweep.json/.md and
# steps.tar.gz (every log and per-step result); SPECDEC_GPU_PACK=0 keeps the steps/ folder unpacked instead.
#
# Environment knobs: PYTHON (default python3), SPECDEC_GPU_BUDGET (total seconds, default 540: one command of the
# device tool runs 600 s at most, and the steps' own timeouts add up to more; 0: none, every step only has its own),
# SPECDEC_GPU_TESTS (backend test files), SPECDEC_GPU_TESTS_TIMEOUT (seconds for them, default 150, run
# last with what is left: every kernel variant they use compiles first), SPECDEC_GIT_COMMIT (recorded when
# the tree has no .git), SPECDEC_GPU_STEPS (the steps to run, default all: env tests loop copy grid e2e sweep;
# "tests" = tests-cuda and tests-backends, "grid" = every grid-<op>; the summary always runs).
# A second, short run after tuning the heuristics from the sweep (the targets only, about 2 minutes):
#   SPECDEC_GPU_STEPS="env copy grid" SPECDEC_GPU_BENCH_ARGS=--quick bash bench/gpu.sh DIR
# A dry run of the script's mechanics without a GPU: SPECDEC_GPU_DEVICE=cpu SPECDEC_GPU_BENCH_ARGS=--quick.
set -u
set -o pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STAMP=$(date -u +%Y%m%d-%H%M%S)
RESULTS=${1:-${SPECDEC_GPU_RESULTS:-${OUT:-$REPO/bench/results}/gpu-$STAMP}}
mkdir -p "$RESULTS" && RESULTS=$(cd "$RESULTS" && pwd)
STEPS=$RESULTS/steps
mkdir -p "$STEPS/parts"
PY=${PYTHON:-python3}
DEVICE=${SPECDEC_GPU_DEVICE:-cuda}
read -r -a BENCH_ARGS <<<"${SPECDEC_GPU_BENCH_ARGS:-}"
BUDGET=${SPECDEC_GPU_BUDGET:-540}  # 0: no total budget
SUMMARY_RESERVE=20
STATUS=()

# an editable install (setup.py maps kernels/ to specdec.kernels); the C++ CPU ops are skipped: compiling them
# costs minutes and every step runs on the GPU
cd "$REPO" || exit 1
if ! SPECDEC_NO_CPP=1 "$PY" -m pip install -q --no-deps --no-build-isolation -e .; then
  # a GPU run is short and may be the only one: run from the checkout rather than lose it (the package as the
  # install lays it out: specdec.kernels is kernels/)
  echo "gpu.sh: the install failed; running from the checkout (PYTHONPATH, specdec/kernels -> kernels/)"
  [ -e specdec/kernels ] || ln -s ../kernels specdec/kernels || exit 1
  export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
fi
export SPECDEC_NO_CPP=1            # tests/install/test_install.py: the C++ ops were left out on purpose
export TRITON_INTERPRET=0          # compiled kernels (tests/conftest.py only sets it when unset)
unset SPECDEC_BACKEND              # the default backend for CUDA tensors: triton

# step NAME TIMEOUT_S CMD... : run CMD with a timeout (cut to what the total budget leaves), log to
# steps/NAME.log, record the outcome; never stops the script.
WANTED=" ${SPECDEC_GPU_STEPS:-env tests loop copy grid e2e sweep} summary "

step() {
  local name=$1 limit=$2
  shift 2
  case "$WANTED" in
    *" $name "*|*" ${name%%-*} "*) ;;
    *) STATUS+=("$(printf '%-16s skipped (not in SPECDEC_GPU_STEPS)' "$name")"); return 0 ;;
  esac
  local left=$((BUDGET > 0 ? BUDGET - SUMMARY_RESERVE - SECONDS : limit))
  if [ "$left" -lt 15 ]; then
    STATUS+=("$(printf '%-16s skipped (total budget spent)' "$name")")
    echo "== $name: skipped, total budget spent"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local log=$STEPS/$name.log t0=$SECONDS rc
  echo "== $name (timeout ${limit}s) $(date -u +%H:%M:%S)"
  timeout -k 10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  local what="rc=$rc"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && what="TIMEOUT after ${limit}s"
  STATUS+=("$(printf '%-16s %-24s %4ss' "$name" "$what" $((SECONDS - t0)))")
  echo "   $what in $((SECONDS - t0))s"
  return 0
}

# the FAILED/ERROR lines and each pytest run's last line ("N passed, M failed ..."), after the "### file" line
# that names it where the step runs one file at a time, from a step's log
test_outcome() {
  local log=$STEPS/$1.log
  [ -f "$log" ] || return 0
  grep -E '^(FAILED|ERROR) ' "$log" | head -20 | cut -c1-200
  grep -E '^### |[0-9]+ (passed|failed|error|skipped)|ERROR SUMMARY' "$log"
}

env_probe() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv || nvidia-smi
  "$PY" - <<'EOF'
import sys, torch, triton
print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)
print('gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')
import specdec, specdec.ops
print('specdec from', specdec.__file__, 'HAS_CPP', specdec.ops.HAS_CPP)
for name in ('tree_attention', 'accept', 'kv_cache'):
    try:
        __import__('specdec.kernels.' + name)
        print('kernel', name, 'imports')
    except Exception as exc:
        print('kernel', name, 'missing:', type(exc).__name__, exc)
EOF
}
export -f env_probe
export PY
step env 40 bash -c env_probe

PYTEST_ARGS=(-q -rfE --tb=short -p no:cacheprovider)
$PY -c "import pytest_timeout" 2>/dev/null && PYTEST_ARGS+=(--timeout=60)
# the CUDA-graph and loop tests first, the kernels' after them: a timeout then cuts kernel tests, which tests-backends
# covers again, not the only tests of the captured steps
cuda_tests() {
  local rc=0
  "$PY" -m pytest $PYTEST_FLAGS tests/backends/test_cuda.py -k "graph or loop" || rc=1
  "$PY" -m pytest $PYTEST_FLAGS tests/backends/test_cuda.py -k "not (graph or loop)" || rc=1
  return $rc
}
export -f cuda_tests
export PYTEST_FLAGS="${PYTEST_ARGS[*]}"
step tests-cuda 130 env SPECDEC_TEST_DEVICE=cuda bash -c cuda_tests
loop_on_device() {
  local dtype drafter
  for drafter in model mtp; do
    for dtype in fp32 bf16; do
      echo "### $dtype, --drafter $drafter"
      "$PY" -m specdec generate --device "$DEVICE" --dtype "$dtype" --drafter "$drafter" --no-progress \
        --max-new-tokens 96 --compare-ar \
        --prompt "$(printf 'import unittest\n\n\nclass TestStack(unittest.TestCase):\n')" --prompt "def parse(" || return 1
    done
  done
  echo "### fp32, --drafter model, --no-cuda-graphs (eager steps; the runs above replay CUDA graphs)"
  "$PY" -m specdec generate --device "$DEVICE" --drafter model --no-progress --max-new-tokens 96 --compare-ar \
    --no-cuda-graphs --prompt "$(printf 'import unittest\n\n\nclass TestStack(unittest.TestCase):\n')" \
    --prompt "def parse(" || return 1
}
export -f loop_on_device
export DEVICE
step loop 150 bash -c loop_on_device
step copy 40 "$PY" -m bench --device "$DEVICE" --ceiling-only --out "$STEPS/parts" --name 0-copy

# grid OP N TIMEOUT_S: one process per op (a crashed CUDA context or a hang loses one op, not the grid);
# no new case starts after 3/4 of the step's time, so the step ends by itself with its results saved
grid() {
  local op=$1 n=$2 limit=$3 left=$((BUDGET > 0 ? BUDGET - SUMMARY_RESERVE - SECONDS : $3))
  [ "$limit" -gt "$left" ] && limit=$left
  step "grid-$op" "$limit" "$PY" -m bench --device "$DEVICE" --ops "$op" --out "$STEPS/parts" --name "$n-$op" \
    --time-budget $((limit * 3 / 4 - 5)) ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"}
}
grid attention 1 120
grid accept 2 50
grid rollback 3 40
grid append 4 25
# MLA tree attention at DeepSeek-V3's shapes (Hq 128, T <= 16, L up to 32K, float8 latent caches) against the copy
# ceiling and SDPA (bench/op_mla.py; the most important case first, its table rewritten after each case, as every
# kernel variant compiles on first use); the CPU dry run times its tiny shapes
MLA_ARGS=(--budget 0.3)
[ "$DEVICE" = cpu ] && MLA_ARGS+=(--quick)
step grid-mla 120 "$PY" -m bench.op_mla --device "$DEVICE" "${MLA_ARGS[@]}" --out "$STEPS/mla"
# the end-to-end table: 2 prompts x 64 tokens, best of 2 passes (each row's decoder captures its graphs in its
# warm-up); the rows the speedup floors judge (draft model chain:4 and 8, MTP chain:6, prompt lookup chain:8, and
# each one's adaptive row), each also sampled, batched and eager where bench.e2e runs it so; no row
# starts after 3/4 of the step's time, so the table is written whatever the budget left
E2E_ROWS='^ours (spec chain:(4|8)|spec auto .*|mtp chain:6|mtp auto .*|prompt lookup (chain:8|auto .*))( \[.*\])?$'
E2E_ARGS=(--prompts 2 --max-new-tokens 64 --repeats 2)
[ "$DEVICE" = cpu ] && E2E_ARGS=(--prompts 2 --max-new-tokens 12 --repeats 1)  # dry run: the CPU is slower
E2E_LIMIT=120
[ "$BUDGET" -gt 0 ] && [ $((BUDGET - SUMMARY_RESERVE - SECONDS)) -lt $E2E_LIMIT ] && E2E_LIMIT=$((BUDGET - SUMMARY_RESERVE - SECONDS))
step e2e "$E2E_LIMIT" "$PY" -m bench.e2e --device "$DEVICE" --no-transformers "${E2E_ARGS[@]}" --methods "$E2E_ROWS" \
  --time-budget $((E2E_LIMIT * 3 / 4 - 5)) --out "$STEPS/e2e"
SWEEP=("$PY" -m bench.sweep --device "$DEVICE")
[ "$DEVICE" = cpu ] && SWEEP=(env TRITON_INTERPRET=1 "${SWEEP[@]}" --toy)  # dry run: the interpreter, toy shapes
step sweep 80 "${SWEEP[@]}" --out "$STEPS" --name sweep --time-budget 55

# the broad backend test files last: they compile every kernel variant they use (minutes), so they get
# what the focused tests and the grid left of the budget; one pytest run per file, so that a budget cut loses the
# file it stops in, not the results of those before it. The file with the most kernel specializations to compile
# (tree_attention) after the first four, the accept variants' files (probabilities, packed rows, block and traversal
# verification, packed attention) after it: a cut costs the least covered first
export BACKEND_TESTS="${SPECDEC_GPU_TESTS:-tests/ops/test_kv_cache.py tests/ops/test_layouts.py tests/ops/accept/test_against_reference.py \
tests/ops/accept/test_lossless.py tests/ops/test_tree_attention.py tests/ops/accept/test_probabilities.py tests/ops/accept/test_packed_rows.py \
tests/ops/accept/test_block.py tests/ops/accept/test_traversal.py tests/ops/test_packed_attention.py}"
backend_tests() {
  local rc=0 file
  for file in $BACKEND_TESTS; do
    echo "### $file"
    "$PY" -m pytest $PYTEST_FLAGS "$file" || rc=1
  done
  return $rc
}
export -f backend_tests
step tests-backends "${SPECDEC_GPU_TESTS_TIMEOUT:-150}" env SPECDEC_TEST_DEVICE=cuda bash -c backend_tests

# sanitize: memcheck, then racecheck, each test file in its own sanitized pytest (a sanitizer error fails the file:
# --error-exitcode); every Triton kernel launched by those tests runs under the tool
export SANITIZE_TESTS="${SPECDEC_SANITIZE_TESTS:-tests/ops/test_kv_cache.py tests/ops/test_tree_attention.py \
tests/ops/test_packed_attention.py tests/ops/accept/test_against_reference.py tests/ops/accept/test_packed_rows.py tests/ops/test_layouts.py}"
export RACECHECK_TESTS="${SPECDEC_RACECHECK_TESTS:-tests/ops/test_tree_attention.py tests/ops/accept/test_against_reference.py}"
export SANITIZE_K="${SPECDEC_SANITIZE_K:-not hopper and not compiles}"
sanitize_tests() {
  local rc=0 file tool
  command -v compute-sanitizer >/dev/null || { echo "compute-sanitizer: not on the PATH"; return 1; }
  for tool in memcheck racecheck; do
    local files=$SANITIZE_TESTS
    [ "$tool" = racecheck ] && files=$RACECHECK_TESTS
    for file in $files; do
      echo "### $tool $file"
      compute-sanitizer --tool "$tool" --error-exitcode 86 --target-processes all --print-limit 20 \
        "$PY" -m pytest $PYTEST_FLAGS -k "$SANITIZE_K" "$file" || rc=1
    done
  done
  return $rc
}
export -f sanitize_tests
step sanitize "${SPECDEC_SANITIZE_TIMEOUT:-280}" env SPECDEC_TEST_DEVICE=cuda bash -c sanitize_tests


# summary: merged results and the table (also on stdout)
SUMMARY_RESERVE=0
step summary 20 "$PY" -m bench.report "$STEPS"/parts/*.json --out "$RESULTS" --name "bench-$STAMP-$DEVICE"
{
  echo "# specdec GPU run $STAMP"
  echo
  grep -E '^(python|gpu|specdec from|kernel) ' "$STEPS/env.log" 2>/dev/null
  echo
  echo "## steps (total ${SECONDS}s)"
  printf '%s\n' "${STATUS[@]}"
  for t in tests-cuda tests-backends sanitize; do
    [ -f "$STEPS/$t.log" ] && { echo; echo "## $t"; test_outcome "$t"; }
  done
  if [ -f "$STEPS/loop.log" ]; then
    echo
    echo "## loop (shipped pair, $DEVICE)"
    grep -E '^(### |speculative |acceptance |autoregressive: )' "$STEPS/loop.log"
  fi
  for table in "$STEPS"/mla/mla-*.md; do
    [ -f "$table" ] || continue
    echo
    echo "## MLA tree attention ($(basename "$table"))"
    grep -E '^\|' "$table"
  done
  for table in "$STEPS"/e2e/e2e*.md; do
    [ -f "$table" ] || continue
    echo
    echo "## end to end ($(basename "$table"))"
    grep -E '^\|' "$table"
  done
  echo
  echo "## benchmark"
  grep -v '^wrote ' "$STEPS/summary.log" 2>/dev/null
  if [ -f "$STEPS/sweep.log" ]; then
    echo
    echo "## tuning sweep (fastest first)"
    sed -n '/ (by \(graph\|eager\) time/,/^results: /p' "$STEPS/sweep.log" | grep -v '^results: '
  fi
} >"$RESULTS/summary.md"
cp "$STEPS"/sweep.json "$STEPS"/sweep.md "$STEPS"/e2e/e2e* "$STEPS"/mla/mla-* "$RESULTS"/ 2>/dev/null
# the tail of every failed step's log, so a failure can be read from stdout alone
for line in "${STATUS[@]}"; do
  case "$line" in *"rc=0"*|*skipped*) ;; *)
    name=${line%% *}
    echo "---- tail of steps/$name.log ($line)" >>"$RESULTS/summary.md"
    tail -15 "$STEPS/$name.log" 2>/dev/null | cut -c1-240 >>"$RESULTS/summary.md" ;;
  esac
done
cat "$RESULTS/summary.md"

if [ "${SPECDEC_GPU_PACK:-1}" = 1 ]; then
  tar -czf "$RESULTS/steps.tar.gz" -C "$RESULTS" steps && rm -rf "$STEPS"
fi
echo "results in $RESULTS: $(ls "$RESULTS" | tr '\n' ' ')"
