#!/usr/bin/env bash
# The ONE prepared script for a lent GPU machine (H200, issue 9): environment, peer wheels, the CUDA build,
# the Triton and CUDA device checks, compute-sanitizer memcheck and racecheck, then the benchmark with the
# cost model beside every measurement. Every stage is time-boxed with `timeout` inside one overall budget
# (DEVICE_CHECK_BUDGET_S, default 500 s), so a hang costs its box, never the lease, and the call ends in
# under 9 minutes.
#
# Here, once, in the checkout the session was started in (the `run` tool sends that checkout):
#     bash benchmarks/fetch_peer_wheels.sh                  # the peers' wheels into .carry/wheels (git-ignored)
#     DRY_RUN=1 bash benchmarks/device_check.sh             # every stage on tiny CPU shapes
# On the device (one `run` call; carry the peer wheels; 540 s is the 9 minutes, the budget ends it sooner):
#     run(command="bash benchmarks/device_check.sh", carry=[".carry/wheels"], timeout_s=540)
# The machine stays warm ~30 s after a call and keeps the ignored build outputs (the extension, the Triton
# cache, benchmarks/out/): a second call right after finishes the benchmark where the first stopped:
#     run(command="RERUN=1 bash benchmarks/device_check.sh", carry=[".carry/wheels"], timeout_s=<what is left>)
# RERUN=1 skips build and checks (SKIP=build,checks,sanitize,racecheck), keeps the first call's benchmark
# records, runs only the cases they do not hold as ok (bench.py --skip-done) and merges both into $OUT.
#
# Knobs (environment):
#     OUT                      where results go (device: set by the tool; else a temp dir)
#     DEVICE_CHECK_BUDGET_S    overall budget in seconds (default 500; a rerun: what is left of the lease)
#     SKIP                     comma-separated stages to skip: env,peers,build,triton,cuda,sanitize,racecheck,
#                              cuda_timing,bench,compile
#     TESTS=1                  also run the GPU pytest subset (off by default: it does not fit the budget
#                              beside the checks, which cover the same paths); TESTS_K / TESTS_ARGS select
#     BENCH_N                  token counts, in the order they run (default "16384 4096": issue 9's targets
#                              are at N=16384, so those come first)
#     BENCH_IMPLS              implementations (default: reference, every fusedloss backend, auto, the peers)
#     BENCH_OPS                ops (default: all five)
#     TRITON_CHECK_ARGS        device_check_triton.py's arguments instead of "--skip-timing" (+ --cpu-smoke dry)
#     BENCH_PARTS              where the benchmark's per-call files are kept for a rerun
#                              (default benchmarks/out/device-parts, git-ignored)
#     FUSEDLOSS_COMMIT         commit to record when the copy on the device has no .git
#
# What comes back (at most 8 files, <= 16 MiB each, <= 2 folders deep):
#     $OUT/device_check.log    every stage's full output (the background Triton check's too)
#     $OUT/bench.json|png|log  the benchmark (records of benchmarks/bench.py, main + compile runs merged;
#                              on a rerun the first call's records too)
#     $OUT/triton_check.json, $OUT/cuda_check.json, $OUT/cuda_timing.json   the device checks' reports
#     $OUT/extra.tar.gz        anything beyond 8 files, packed
# stdout ends with a stage summary and the benchmark table (the tool returns the last 12,000 characters).
#
# Stages, in order (box = the most a stage may take; each box also shrinks so that the benchmark keeps
# BENCH_MIN seconds):
#     env 20        GPU, driver, clocks, nvcc, compute-sanitizer, python, torch, triton, commit
#     peers 40      .carry/wheels/*.whl installed with pip --no-deps --no-index --target (TRL, Liger, CCE and
#                   TRL's missing pure-Python dependencies); onto PYTHONPATH for the benchmark only
#     triton 240    benchmarks/device_check_triton.py --skip-timing, in the BACKGROUND from here on: it needs no
#                   extension, compiles on the CPU cores the build leaves idle, and its timings are the
#                   benchmark's (fusedloss:triton, forward and backward, model beside)
#     build 150     setup.py build_ext --inplace (nvcc 13, sm_80 + sm_90a)
#     cuda 150      benchmarks/device_check_cuda.py --only cases paths confident (its own --budget-s stops it
#                   15 s inside the box, so its JSON is complete)
#     sanitize 75   compute-sanitizer --tool memcheck over sanitize_smoke.py (triton and cuda, bf16 + fp32,
#                   token_logprobs / cross_entropy / distillation_loss on N=1, odd N, prime V)
#     racecheck 60  compute-sanitizer --tool racecheck over sanitize_smoke.py --tiles (the fold, JSD and dx
#                   kernels' shared-memory reductions, every variant)
#     (wait)        for the Triton check, before anything is timed
#     cuda_timing 45  device_check_cuda.py --only timings: the CUDA backend's forward / backward at N=16384 for
#                   workspaces of 256 MiB, 1 GiB, 4 GiB and the default, the model beside each
#     bench         bench.py --device cuda --group-by op (one process per (op, N)), bf16, D=4096, V=151936,
#                   every implementation, forward and backward timed separately, the cost model beside
#                   (--model-gpu from the device name); whatever is left minus the compile slice
#     compile 60    the reference under torch.compile, in the last slice
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
RERUN=${RERUN:-0}
TOTAL=${DEVICE_CHECK_BUDGET_S:-500}
RESERVE=25          # merge, packing, summary
BENCH_MIN=${BENCH_MIN:-120}   # seconds the benchmark keeps whatever the earlier stages take
SKIP_DEFAULT=""
[[ "$RERUN" == 1 ]] && SKIP_DEFAULT="build,triton,cuda,sanitize,racecheck,cuda_timing"
SKIP=",${SKIP:-$SKIP_DEFAULT},"
[[ "${TESTS:-0}" != 1 ]] && SKIP="${SKIP}tests,"
START=$(date +%s)
SUMMARY=()
SCRATCH=$(mktemp -d /tmp/fl-dc-scratch.XXXXXX)
# The benchmark's parts live in the checkout (git-ignored), so that a rerun on the still-warm machine finds them.
PARTS=${BENCH_PARTS:-"$ROOT/benchmarks/out/device-parts"}
[[ "$RERUN" != 1 ]] && rm -rf "$PARTS"
mkdir -p "$PARTS"

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( TOTAL - $(elapsed) )); }
say() { echo "$*" | tee -a "$LOG"; }

# box NAME WANT_S KEEP_S: the seconds stage NAME may take (0: skip it), min(WANT_S, time left - KEEP_S)
box() {
  local name=$1 want=$2 keep=$3
  if [[ "$SKIP" == *",$name,"* ]]; then echo 0; return; fi
  local avail=$(( $(left) - keep ))
  local b=$(( want < avail ? want : avail ))
  (( b < 15 )) && b=0
  echo "$b"
}

_run_boxed() {  # _run_boxed BOX CMD... : a child bash with this script's functions and variables
  timeout -k 10 "$1" bash -c "$(declare -f); $(declare -p DRY ROOT OUT LOG PY TOTAL RESERVE SKIP START \
    SCRATCH PEER_SITE PARTS BENCH_ARGS BENCH_IMPLS BENCH_OPS RERUN BOX TESTS_K TESTS_ARGS TRITON_CHECK_ARGS 2>/dev/null); cd \"\$ROOT\"; \"\$@\"" \
    stage "${@:2}"
}

_summarise() {  # _summarise NAME RC SECONDS BOX
  local what="rc=$2"
  (( $2 == 124 || $2 == 137 )) && what="TIMED OUT after ${4}s"
  say "== $1: $what (${3}s)"
  SUMMARY+=("$(printf '%-11s %-24s %4ss' "$1" "$what" "$3")")
}

# stage NAME WANT_S KEEP_S CMD... : run CMD in the foreground, time-boxed
stage() {
  local name=$1 want=$2 keep=$3; shift 3
  local b; b=$(box "$name" "$want" "$keep")
  if [[ "$SKIP" == *",$name,"* ]]; then SUMMARY+=("$(printf '%-11s skipped (SKIP)' "$name")"); return 0; fi
  if (( b == 0 )); then
    SUMMARY+=("$(printf '%-11s skipped: %ss left of the budget' "$name" "$(left)")")
    say "== $name: skipped, budget"; return 0
  fi
  say "== [$(elapsed)s] $name (box ${b}s): $*"
  local t0=$(date +%s)
  BOX=$b _run_boxed "$b" "$@" >> "$LOG" 2>&1
  _summarise "$name" $? $(( $(date +%s) - t0 )) "$b"
  return 0
}

# stage_bg NAME WANT_S KEEP_S CMD... : start CMD in the background (its output to its own log, appended to
# the main log by stage_wait); BG_PID / BG_T0 / BG_BOX remember it
BG_NAME=""; BG_PID=""; BG_T0=0; BG_BOX=0
stage_bg() {
  local name=$1 want=$2 keep=$3; shift 3
  local b; b=$(box "$name" "$want" "$keep")
  if [[ "$SKIP" == *",$name,"* ]]; then SUMMARY+=("$(printf '%-11s skipped (SKIP)' "$name")"); return 0; fi
  if (( b == 0 )); then SUMMARY+=("$(printf '%-11s skipped: %ss left of the budget' "$name" "$(left)")"); return 0; fi
  say "== [$(elapsed)s] $name (background, box ${b}s): $*"
  BG_NAME=$name; BG_T0=$(date +%s); BG_BOX=$b
  BOX=$b _run_boxed "$b" "$@" > "$SCRATCH/$name.log" 2>&1 &
  BG_PID=$!
}

stage_wait() {
  [[ -z "$BG_PID" ]] && return 0
  say "== [$(elapsed)s] waiting for $BG_NAME"
  wait "$BG_PID"
  local rc=$?
  { echo "---------------- $BG_NAME (background) ----------------"; cat "$SCRATCH/$BG_NAME.log"; } >> "$LOG"
  _summarise "$BG_NAME" "$rc" $(( $(date +%s) - BG_T0 )) "$BG_BOX"
  BG_PID=""
}

# ------------------------------------------------------------------------------------------ env
env_stage() {
  echo "date: $(date -u +%FT%TZ)  dry_run=$DRY  rerun=$RERUN  budget=${TOTAL}s"
  echo "commit: ${FUSEDLOSS_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  git status --short 2>/dev/null | head -20
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  command -v nvcc >/dev/null && nvcc --version | tail -2 || echo "nvcc: not on PATH ($(ls /usr/local/cuda/bin/nvcc 2>/dev/null || echo none))"
  command -v compute-sanitizer >/dev/null && compute-sanitizer --version | tail -1 || echo "compute-sanitizer: not found"
  nproc
  "$PY" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
try:
    import triton; print("triton", triton.__version__)
except Exception as exc:
    print("triton: not importable:", exc)
import torch.nn.functional as F
print("torch linear_cross_entropy:", hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions"))
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
  # where each peer resolves from, and whether it imports (the benchmark records import failures per peer)
  PYTHONPATH="$PEER_SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" - <<'EOF'
import importlib, importlib.util
from importlib.metadata import version
for m, dist in (("trl", "trl"), ("datasets", "datasets"), ("liger_kernel", "liger-kernel"),
                ("cut_cross_entropy", "cut-cross-entropy"), ("transformers", "transformers"),
                ("accelerate", "accelerate"), ("pyarrow", "pyarrow"), ("fsspec", "fsspec")):
    spec = importlib.util.find_spec(m)
    try:
        v = version(dist)
    except Exception:
        v = "?"
    print(f"{m:<18} {v:<10} {spec.origin if spec else 'NOT FOUND'}")
for m in ("trl.kernels.chunked_logprob", "trl.trainer.utils", "liger_kernel.ops.fused_linear_cross_entropy",
          "liger_kernel.chunked_loss.functional", "cut_cross_entropy"):
    try:
        importlib.import_module(m)
        print(f"import {m}: ok")
    except Exception as exc:
        print(f"import {m}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
EOF
}

# ------------------------------------------------------------------------------------------ build
build_stage() {
  if [[ "$DRY" == 1 ]]; then
    # never rewrite this checkout's build outputs in a dry run: build a scratch copy (the same nvcc build
    # when nvcc is here; this checkout's extension stays the one the later stages use)
    local copy="$SCRATCH/build-copy"
    mkdir -p "$copy" && tar --exclude=.git --exclude=.carry --exclude=build --exclude='*.so' \
      --exclude=benchmarks/out -cf - . | tar -xf - -C "$copy"
    (cd "$copy" && "$PY" setup.py -q build_ext --inplace 2>&1 | grep -v -i deprecat; exit "${PIPESTATUS[0]}")
    local rc=$?
    (cd "$copy" && ls fusedloss/*.so 2>/dev/null; cat fusedloss/_build_info.py 2>/dev/null)
    return $rc
  fi
  MAX_JOBS=${MAX_JOBS:-16} FUSEDLOSS_NVCC_THREADS=${FUSEDLOSS_NVCC_THREADS:-4} "$PY" setup.py build_ext --inplace \
    || MAX_JOBS=${MAX_JOBS:-16} "$PY" -m pip install --no-build-isolation --no-deps -e .
  local rc=$?
  cat fusedloss/_build_info.py 2>/dev/null || true
  "$PY" -c "import fusedloss; print('backend_status', fusedloss.backend_status())"
  return $rc
}

# ------------------------------------------------------------------------------------------ tests (TESTS=1)
# tests/conftest.py parametrises the tests over every *available* backend (triton and cuda join on a GPU)
# and marks the GPU-only cases `gpu` at run time, so `-m gpu` alone would select almost nothing at
# collection time: select the GPU backends' cases by name. Override with TESTS_ARGS.
tests_stage() {
  local extra=()
  "$PY" -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout=120)
  local sel=(-k "${TESTS_K:-triton or cuda or half or gpu}")
  [[ -n "${TESTS_ARGS:-}" ]] && read -r -a sel <<< "$TESTS_ARGS"
  [[ "$DRY" != 1 ]] && "$PY" -c "import xdist" 2>/dev/null && extra+=(-n "${TESTS_WORKERS:-6}")
  "$PY" -m pytest tests "${sel[@]}" -v --tb=short -rfE -p no:cacheprovider "${extra[@]}" 2>&1 \
    | grep -v -E "^(platform|cachedir|rootdir|plugins|configfile|collecting)"
  return "${PIPESTATUS[0]}"
}

# ------------------------------------------------------------------------------------------ checks
triton_stage() {
  local extra=(--skip-timing)
  [[ "$DRY" == 1 ]] && extra+=(--cpu-smoke)
  [[ -n "${TRITON_CHECK_ARGS:-}" ]] && read -r -a extra <<< "$TRITON_CHECK_ARGS"
  "$PY" benchmarks/device_check_triton.py --out "$OUT/triton_check.json" "${extra[@]}"
}

cuda_stage() {  # cuda_stage OUT_NAME SECTIONS... (BOX: the stage's box; the script stops itself 15 s inside)
  local name=$1; shift
  local extra=(--budget-s $(( ${BOX:-150} - 15 )))
  [[ "$DRY" == 1 ]] && extra+=(--cpu-smoke)
  "$PY" benchmarks/device_check_cuda.py --out "$OUT/$name.json" --only "$@" "${extra[@]}"
}

# ------------------------------------------------------------------------------------------ sanitizer
sanitize_stage() {
  if [[ "$DRY" == 1 ]]; then
    "$PY" benchmarks/sanitize_smoke.py --device cpu --backends torch --dtypes float32 --ops token_logprobs cross_entropy
    return $?
  fi
  if ! command -v compute-sanitizer >/dev/null; then echo "compute-sanitizer: not found"; return 3; fi
  CUDA_MODULE_LOADING=LAZY compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 \
    "$PY" benchmarks/sanitize_smoke.py --device cuda --dtypes bfloat16 float32 \
    --ops token_logprobs cross_entropy distillation_loss
}

racecheck_stage() {
  if [[ "$DRY" == 1 ]]; then
    "$PY" benchmarks/sanitize_smoke.py --tiles --device cpu
    return $?
  fi
  if ! command -v compute-sanitizer >/dev/null; then echo "compute-sanitizer: not found"; return 3; fi
  CUDA_MODULE_LOADING=LAZY compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 86 \
    --print-limit 20 "$PY" benchmarks/sanitize_smoke.py --tiles --device cuda
}

# ------------------------------------------------------------------------------------------ bench
if [[ "$DRY" == 1 ]]; then
  # tiny CPU shapes; the Triton kernels through the interpreter, so its records carry its plan's model too
  BENCH_ARGS=(--device cpu --shapes tiny --N ${BENCH_N:-64} --dtype float32 --repeat 2 --group-by op --model-gpu h200)
  BENCH_IMPLS=${BENCH_IMPLS:-"reference fusedloss:cuda fusedloss:triton fusedloss:auto trl liger cce torch-lce fusedloss:torch"}
else
  BENCH_ARGS=(--device cuda --shapes llm --dtype bfloat16 --N ${BENCH_N:-16384 4096} --group-by op)
  BENCH_IMPLS=${BENCH_IMPLS:-"reference fusedloss:cuda fusedloss:triton fusedloss:auto trl liger cce torch-lce fusedloss:torch"}
fi
bench_stage() {  # bench_stage NAME IMPLS...
  local name=$1; shift
  local budget=$(( $(left) - RESERVE - 15 ))
  [[ "$name" == main && "$SKIP" != *",compile,"* ]] && budget=$(( budget - 60 ))  # leave the compile run a slice
  (( budget < 20 )) && budget=20
  local done=()
  for f in "$PARTS"/*.json; do [[ -f "$f" ]] && done+=("$f"); done
  local tag="$name-$(date +%s)"
  [[ "$DRY" == 1 ]] && export TRITON_INTERPRET=1
  PYTHONPATH="$PEER_SITE${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" -m benchmarks.bench "${BENCH_ARGS[@]}" --impls "$@" --out "$PARTS" --tag "$tag" --budget-s "$budget" \
    ${BENCH_OPS:+--ops $BENCH_OPS} ${done[@]:+--skip-done "${done[@]}"}
}

# ------------------------------------------------------------------------------------------ run
# (one function, called on the last line: bash has parsed all of it before it starts, so editing this
# file during a run cannot change the run)
run_all() {
  say "fusedloss device check: OUT=$OUT dry_run=$DRY rerun=$RERUN budget=${TOTAL}s skip=$SKIP"
  local keep=$((BENCH_MIN + RESERVE))
  stage    env         20  0     env_stage
  stage    peers       40  $keep peers_stage
  stage_bg triton      240 $keep triton_stage
  stage    build       150 $keep build_stage
  stage    tests       120 $keep tests_stage
  stage    cuda        150 $keep cuda_stage cuda_check cases paths confident
  stage    sanitize    75  $keep sanitize_stage
  stage    racecheck   60  $keep racecheck_stage
  stage_wait
  stage    cuda_timing 45  $keep cuda_stage cuda_timing timings
  stage    bench       900 $RESERVE bench_stage main $BENCH_IMPLS
  stage    compile     900 $RESERVE bench_stage compile reference+compile

  # merge the benchmark parts (this call's and, on a rerun, the first call's) into $OUT/bench.{json,png,log}
  local have=()
  for f in "$PARTS"/*.json; do [[ -f "$f" ]] && have+=("$f"); done
  if (( ${#have[@]} )); then
    "$PY" -m benchmarks.bench --merge "${have[@]}" --out "$OUT" --tag bench > "$SCRATCH/merge.txt" 2>&1
    cat "$SCRATCH/merge.txt" >> "$LOG"
    cat "$PARTS"/*.log >> "$LOG" 2>/dev/null
  fi
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv >> "$LOG" 2>&1

  # at most 8 files come back: pack the rest
  local files extra keep_files f k skip_it
  mapfile -t files < <(cd "$OUT" && find . -type f | sed 's|^\./||' | sort)
  if (( ${#files[@]} > 8 )); then
    keep_files=(device_check.log bench.json bench.png bench.log)
    extra=()
    for f in "${files[@]}"; do
      skip_it=0; for k in "${keep_files[@]}"; do [[ "$f" == "$k" ]] && skip_it=1; done
      (( skip_it )) || extra+=("$f")
    done
    (cd "$OUT" && tar -czf extra.tar.gz "${extra[@]}" && rm -f "${extra[@]}" && find . -type d -empty -delete)
  fi

  echo
  echo "================ device check summary (${TOTAL}s budget, $(elapsed)s used, dry_run=$DRY, rerun=$RERUN) ================"
  for s in "${SUMMARY[@]}"; do echo "  $s"; done
  grep -E "^(ALL OK|SOME CHECKS FAILED)|^wrote .*ok=|^\[FAIL\]" "$LOG" | cut -c1-160 | head -12
  grep -E "failure\(s\)|ERROR SUMMARY|RACECHECK SUMMARY" "$LOG" | tail -4
  if [[ "${TESTS:-0}" == 1 ]]; then
    echo "tests: $(grep -c -E " PASSED( |$)" "$LOG") passed, $(grep -c -E " FAILED( |$)" "$LOG") failed"
    grep -E "^(FAILED|ERROR) " "$LOG" | cut -c1-160 | head -10
  fi
  echo "---------------- benchmark ----------------"
  if [[ -f "$SCRATCH/merge.txt" ]]; then grep -v "^wrote\|^total" "$SCRATCH/merge.txt" | cut -c1-240; fi
  echo "files in $OUT:"; (cd "$OUT" && find . -type f -printf '  %p %s bytes\n')
  rm -rf "$SCRATCH"
}

run_all "$@"; exit $?
