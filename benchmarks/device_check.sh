#!/usr/bin/env bash
# The ONE prepared script for a lent GPU machine (H200): environment, peer wheels, CUDA build, GPU tests,
# the Triton/CUDA device checks, compute-sanitizer memcheck, then the issue-6 benchmark. Every stage is
# time-boxed with `timeout`, inside one overall budget, so a hang costs its box and never the lease.
#
# On the device (one `run` call; carry the peer wheels):
#     run(command="bash benchmarks/device_check.sh", carry=[".carry/wheels"], timeout_s=540)
# The machine stays warm ~30 s after a call and keeps the build: a second, benchmark-only call right after
#     run(command="SKIP=build,tests,checks,sanitize bash benchmarks/device_check.sh", carry=[".carry/wheels"])
# gives the benchmark nearly the whole budget (peers are reinstalled: ~10 s).
# Dry run on a CPU machine (every stage on tiny CPU shapes, $OUT a temp dir unless set):
#     DRY_RUN=1 bash benchmarks/device_check.sh
#
# Knobs (environment):
#     OUT                      where results go (device: set by the tool; else a temp dir)
#     DEVICE_CHECK_BUDGET_S    overall budget in seconds (default 500: leaves a rerun inside a 15-min lease)
#     SKIP                     comma-separated stages to skip: env,peers,build,tests,checks,sanitize,bench,compile
#     TESTS_K / TESTS_ARGS     the GPU tests' -k expression (default "triton or cuda or half or gpu") / all pytest args
#     BENCH_N                  token counts for the benchmark (default "4096 16384")
#     BENCH_IMPLS              implementations (default: reference, every fusedloss backend, auto, trl, liger, cce)
#     FUSEDLOSS_COMMIT         commit to record when the copy on the device has no .git
#
# What comes back (at most 8 files, <= 16 MiB each, <= 2 folders deep):
#     $OUT/device_check.log    every stage's full output
#     $OUT/bench.json|png|log  the benchmark (records of benchmarks/bench.py; merged main + compile runs)
#     $OUT/triton_check.json, $OUT/cuda_check.json   from device_check_triton.py / device_check_cuda.py --out
#     $OUT/extra.tar.gz        anything beyond 8 files, packed
# stdout ends with a stage summary and the benchmark table (the tool returns the last 12,000 characters).

set -u
DRY=${DRY_RUN:-0}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
if [[ -z "${OUT:-}" ]]; then OUT=$(mktemp -d /tmp/fl-device-check.XXXXXX); fi
mkdir -p "$OUT"
export OUT
LOG="$OUT/device_check.log"
: > "$LOG"
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || PY=python
TOTAL=${DEVICE_CHECK_BUDGET_S:-500}
RESERVE=25          # merge, packing, summary
BENCH_MIN=240       # seconds the benchmark stages keep whatever the earlier stages take
SKIP=",${SKIP:-},"
START=$(date +%s)
SUMMARY=()
SCRATCH=$(mktemp -d /tmp/fl-dc-scratch.XXXXXX)

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( TOTAL - $(elapsed) )); }
say() { echo "$*" | tee -a "$LOG"; }

# stage NAME WANT_S KEEP_S CMD... : run CMD time-boxed to min(WANT_S, time left - KEEP_S)
stage() {
  local name=$1 want=$2 keep=$3; shift 3
  if [[ "$SKIP" == *",$name,"* ]]; then SUMMARY+=("$(printf '%-9s skipped (SKIP)' "$name")"); return 0; fi
  local avail=$(( $(left) - keep ))
  local box=$(( want < avail ? want : avail ))
  if (( box < 15 )); then
    SUMMARY+=("$(printf '%-9s skipped: %ss left of the budget' "$name" "$(left)")")
    say "== $name: skipped, budget"; return 0
  fi
  say "== [$(elapsed)s] $name (box ${box}s): $*"
  local t0=$(date +%s)
  # stages are shell functions: run them in a child bash (timeout needs a program) that gets
  # this script's functions and variables
  timeout -k 10 "$box" bash -c "$(declare -f); $(declare -p DRY ROOT OUT LOG PY TOTAL RESERVE SKIP START \
    SCRATCH PEER_SITE PARTS BENCH_ARGS TESTS_K TESTS_ARGS 2>/dev/null); cd \"\$ROOT\"; \"\$@\"" stage "$@" >> "$LOG" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  local what="rc=$rc"
  (( rc == 124 || rc == 137 )) && what="TIMED OUT after ${box}s"
  say "== $name: $what (${dt}s)"
  SUMMARY+=("$(printf '%-9s %-22s %4ss' "$name" "$what" "$dt")")
  return 0
}

# ------------------------------------------------------------------------------------------ env
env_stage() {
  echo "date: $(date -u +%FT%TZ)  dry_run=$DRY  budget=${TOTAL}s"
  echo "commit: ${FUSEDLOSS_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  git status --short 2>/dev/null | head -20
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  command -v nvcc >/dev/null && nvcc --version | tail -2 || echo "nvcc: not on PATH ($(ls /usr/local/cuda/bin/nvcc 2>/dev/null || echo none))"
  command -v compute-sanitizer >/dev/null && compute-sanitizer --version | tail -1 || echo "compute-sanitizer: not found"
  "$PY" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
try:
    import triton; print("triton", triton.__version__)
except Exception as exc:
    print("triton: not importable:", exc)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("SMs", p.multi_processor_count, "mem GiB", round(p.total_memory / 2**30, 1), "cc", f"{p.major}.{p.minor}")
EOF
}

# ------------------------------------------------------------------------------------------ peers
PEER_SITE="$SCRATCH/peer-site"
peers_stage() {
  local wheels=(.carry/wheels/*.whl)
  if [[ ! -e "${wheels[0]}" ]]; then echo "no wheels in .carry/wheels (run benchmarks/fetch_peer_wheels.sh here and carry .carry/wheels)"; return 0; fi
  ls -la .carry/wheels
  local w
  for w in "${wheels[@]}"; do  # one at a time: a wheel for another Python (dry run) must not block the rest
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$PEER_SITE" "$w" \
      2>&1 | grep -v "Running pip as the 'root' user" || true
  done
  # where each peer resolves from (no import here: the benchmark records import failures per peer)
  PYTHONPATH="$PEER_SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" - <<'EOF'
import importlib.util
from importlib.metadata import version
for m, dist in (("trl", "trl"), ("datasets", "datasets"), ("liger_kernel", "liger-kernel"),
                ("cut_cross_entropy", "cut-cross-entropy"), ("transformers", "transformers"),
                ("accelerate", "accelerate")):
    spec = importlib.util.find_spec(m)
    try:
        v = version(dist)
    except Exception:
        v = "?"
    print(f"{m:<18} {v:<10} {spec.origin if spec else 'NOT FOUND'}")
EOF
}

# ------------------------------------------------------------------------------------------ build
build_stage() {
  if [[ "$DRY" == 1 ]]; then
    # never rewrite this checkout's build outputs in a dry run: build a scratch copy, extension skipped
    local copy="$SCRATCH/build-copy"
    mkdir -p "$copy" && tar --exclude=.git --exclude=.carry --exclude=build --exclude='*.so' -cf - . | tar -xf - -C "$copy"
    (cd "$copy" && FUSEDLOSS_CUDA=0 "$PY" setup.py -q build_ext --inplace 2>&1 | grep -v -i deprecat; \
      exit "${PIPESTATUS[0]}")
    return $?
  fi
  MAX_JOBS=${MAX_JOBS:-16} "$PY" setup.py build_ext --inplace \
    || MAX_JOBS=${MAX_JOBS:-16} "$PY" -m pip install --no-build-isolation --no-deps -e .
  local rc=$?
  cat fusedloss/_build_info.py 2>/dev/null || true
  "$PY" -c "import fusedloss; print('backend_status', fusedloss.backend_status())"
  return $rc
}

# ------------------------------------------------------------------------------------------ tests
# tests/conftest.py parametrises the tests over every *available* backend (triton and cuda join on a GPU)
# and marks the GPU-only cases `gpu` at run time, so `-m gpu` alone would select almost nothing at
# collection time: select the GPU backends' cases by name. Override with TESTS_ARGS.
tests_stage() {
  local extra=()
  "$PY" -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout=120)
  local sel=(-k "${TESTS_K:-triton or cuda or half or gpu}")
  [[ -n "${TESTS_ARGS:-}" ]] && read -r -a sel <<< "$TESTS_ARGS"
  # several workers: the Triton JIT compiles on the CPU cores while the GPU runs (not in a dry run)
  [[ "$DRY" != 1 ]] && "$PY" -c "import xdist" 2>/dev/null && extra+=(-n "${TESTS_WORKERS:-6}")
  # one line per test, so a run killed by its box still shows what passed and failed
  "$PY" -m pytest tests "${sel[@]}" -v --tb=short -rfE -p no:cacheprovider "${extra[@]}" 2>&1 \
    | grep -v -E "^(platform|cachedir|rootdir|plugins|configfile|collecting)"
  return "${PIPESTATUS[0]}"
}

# ------------------------------------------------------------------------------------------ checks
checks_stage() {
  local which=$1 script="benchmarks/device_check_$1.py"
  if [[ ! -f "$script" ]]; then echo "$script: not present"; return 0; fi
  # --out names a JSON file (device_check_cuda.py's interface); a script that takes a folder makes one
  local extra=()
  # dry run: the script's CPU mode, where it has one (device_check_triton.py: --cpu-smoke)
  [[ "$DRY" == 1 ]] && grep -q -- "--cpu-smoke" "$script" && extra+=(--cpu-smoke)
  "$PY" "$script" --out "$OUT/${which}_check.json" "${extra[@]}"
}

# ------------------------------------------------------------------------------------------ sanitizer
sanitize_stage() {
  if [[ "$DRY" == 1 ]]; then
    "$PY" benchmarks/sanitize_smoke.py --device cpu --backends torch --dtypes float32 --ops token_logprobs cross_entropy
    return $?
  fi
  if ! command -v compute-sanitizer >/dev/null; then echo "compute-sanitizer: not found"; return 0; fi
  CUDA_MODULE_LOADING=LAZY compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 \
    "$PY" benchmarks/sanitize_smoke.py --device cuda --dtypes bfloat16 float32 \
    --ops token_logprobs cross_entropy distillation_loss
}

# ------------------------------------------------------------------------------------------ bench
if [[ "$DRY" == 1 ]]; then
  BENCH_ARGS=(--device cpu --shapes tiny --dtype float32 --repeat 2)
  BENCH_IMPLS=${BENCH_IMPLS:-"reference fusedloss:torch fusedloss:triton fusedloss:cuda fusedloss:auto trl liger cce"}
else
  BENCH_ARGS=(--device cuda --shapes llm --dtype bfloat16 --N ${BENCH_N:-4096 16384})
  BENCH_IMPLS=${BENCH_IMPLS:-"reference fusedloss:cuda fusedloss:triton fusedloss:auto trl liger cce fusedloss:torch"}
fi
PARTS="$SCRATCH/bench"
bench_stage() {  # bench_stage NAME IMPLS...
  local name=$1; shift
  local budget=$(( $(left) - RESERVE - 30 ))
  [[ "$name" == main && "$SKIP" != *",compile,"* ]] && budget=$(( budget - 60 ))  # leave the compile run a slice
  (( budget < 30 )) && budget=30
  PYTHONPATH="$PEER_SITE${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" -m benchmarks.bench "${BENCH_ARGS[@]}" --impls "$@" --out "$PARTS" --tag "$name" --budget-s "$budget"
}

# ------------------------------------------------------------------------------------------ run
# (one function, called on the last line: bash has parsed all of it before it starts, so editing this
# file during a run cannot change the run)
run_all() {
  say "fusedloss device check: OUT=$OUT dry_run=$DRY budget=${TOTAL}s"
  stage env      30  0                      env_stage
  stage peers    60  $((BENCH_MIN + RESERVE)) peers_stage
  stage build    240 $((BENCH_MIN + RESERVE)) build_stage
  stage tests    120 $((BENCH_MIN + RESERVE)) tests_stage
  stage checks   60  $((BENCH_MIN + RESERVE)) checks_stage triton
  stage checks   150 $((BENCH_MIN + RESERVE)) checks_stage cuda
  stage sanitize 75  $((BENCH_MIN + RESERVE)) sanitize_stage
  stage bench    900 $RESERVE               bench_stage main $BENCH_IMPLS
  stage compile  900 $RESERVE               bench_stage compile reference+compile

  # merge the benchmark parts into $OUT/bench.{json,png,log}
  parts=("$PARTS"/main.json "$PARTS"/compile.json)
  have=()
  for f in "${parts[@]}"; do [[ -f "$f" ]] && have+=("$f"); done
  if (( ${#have[@]} )); then
    "$PY" -m benchmarks.bench --merge "${have[@]}" --out "$OUT" --tag bench > "$SCRATCH/merge.txt" 2>&1
    cat "$SCRATCH/merge.txt" >> "$LOG"
  fi
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv >> "$LOG" 2>&1

  # at most 8 files come back: pack the rest
  mapfile -t files < <(cd "$OUT" && find . -type f | sed 's|^\./||' | sort)
  if (( ${#files[@]} > 8 )); then
    keep=(device_check.log bench.json bench.png bench.log)
    extra=()
    for f in "${files[@]}"; do
      skip=0; for k in "${keep[@]}"; do [[ "$f" == "$k" ]] && skip=1; done
      (( skip )) || extra+=("$f")
    done
    (cd "$OUT" && tar -czf extra.tar.gz "${extra[@]}" && rm -f "${extra[@]}" && find . -type d -empty -delete)
  fi

  echo
  echo "================ device check summary (${TOTAL}s budget, $(elapsed)s used, dry_run=$DRY) ================"
  for s in "${SUMMARY[@]}"; do echo "  $s"; done
  echo "tests: $(grep -c -E " PASSED( |$)" "$LOG") passed, $(grep -c -E " FAILED( |$)" "$LOG") failed, $(grep -c -E " SKIPPED( |$)" "$LOG") skipped (per-test lines)"
  grep -E "^(FAILED|ERROR) " "$LOG" | cut -c1-160 | head -15
  grep -E "^=+ .*(passed|failed|error).* =+$" "$LOG" | tail -3
  grep -E "failure\(s\)|ERROR SUMMARY" "$LOG" | tail -3
  echo "---------------- benchmark ----------------"
  if [[ -f "$SCRATCH/merge.txt" ]]; then grep -v "^wrote\|^total" "$SCRATCH/merge.txt" | grep -vE "unavailable: (backend (triton|cuda)|.*has no)" | cut -c1-150; fi
  echo "files in $OUT:"; (cd "$OUT" && find . -type f -printf '  %p %s bytes\n')
  rm -rf "$SCRATCH"
}

run_all "$@"; exit $?
