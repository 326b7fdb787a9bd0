#!/usr/bin/env bash
# One time-boxed run on a CUDA machine (written for an H200): a smoke test, the build, the benchmark of
# fusedloss's CUDA and Triton backends against the materialised reference and the peers, a per-kernel profile
# and the product rates the cost model assumes, bf16 correctness, the CUDA workspace sweep, the compute
# sanitizers and the CUTLASS 3 prototype beside cuBLAS, all inside DEVICE_CHECK_BUDGET_S (default 540 s). A
# second call with RERUN=1 on the same machine finishes what the first one left (the benchmark cases not yet
# measured, the check stages not yet done).
#
#     bash benchmarks/device_check.sh                          # on a machine with a CUDA GPU
#     RERUN=1 DEVICE_CHECK_BUDGET_S=300 bash benchmarks/device_check.sh
#     PLAN=1 bash benchmarks/device_check.sh                   # each stage's time box and their sum; runs nothing
#     DRY_RUN=1 bash benchmarks/device_check.sh                # every stage on tiny CPU shapes (no GPU)
#
# Prepared beforehand, on any machine with network access (both git-ignored, under .carry/):
#     bash benchmarks/fetch_peer_wheels.sh                     # the peers' wheels (TRL, Liger, Cut Cross-Entropy)
#     PREBUILD=1 PREBUILD_PYTHON=python3.12 bash benchmarks/device_check.sh
#                                                              # the extension for sm_90a and that Python, and
#                                                              # the CUTLASS prototype's shared object (no Python
#                                                              # ABI in it; PREBUILD_PROTOTYPE=0 leaves it out)
# The GPU machine needs no network: the wheels are installed from .carry/wheels; the prebuilt extension in
# .carry/prebuilt is used when it was built from these sources for the machine's Python (ABI tag) and imports
# there, else the extension is built (sm_90a only); the prebuilt prototype when its PROTO_SOURCES hash is these
# sources', else it is built only where nvcc, the nvidia-cutlass wheel and the time left allow it.
#
# Stages (PLAN=1 prints the same table with its sum). A stage's box is when it must end on a fixed schedule:
# time a stage leaves unused passes to the next one; a stage past its box is stopped and its results so far
# are kept.
#     smoke        20 s  GPU, driver, clocks/power/performance state, runtime (gVisor refuses compute-sanitizer,
#                        Firecracker allows it), Python/torch/Triton versions, one tiny forward+backward per
#                        backend; stops the run when no GPU is visible          -> smoke.json
#     build        60 s  the extension (prebuilt, or built for sm_90a with MAX_JOBS=16) while the peer wheels
#                        install; then one tiny call of the CUDA backend         -> log
#     core        185 s  bench.py: reference, fusedloss:cuda, fusedloss:triton; cross_entropy, token_logprobs
#                        (+entropy), grpo_loss, distillation_loss; N=16384 (V=151936) then N=4096 (V=128256);
#                        D=4096, bf16; timed calls alternated between implementations in rounds after a GEMM
#                        warm-up, the SM clock at every timed call               -> bench.json (record by record)
#     peers        75 s  TRL, Liger, Cut Cross-Entropy, torch's F.linear_cross_entropy (where this torch has
#                        it) at N=4096, V=128256 (the shape they publish), then N=16384, V=151936 -> bench.json
#     profile      45 s  the three product rates (bf16 output; fp32 output [8192x151936x4096]; beta=1 fp32
#                        accumulation [151936x4096x2304]), then per (backend, op) at N=16384 one forward+backward
#                        under torch.profiler, each kernel's count and time  -> products.json, bench.json
#     correctness  60 s  every op at N=1024, V=151936, D=1024 for both backends against float64 and against the
#                        naive bf16 path; the CUDA check's bf16/fp32 cases, paths and confident rows; the Triton
#                        check in bf16                                           -> checks.json
#     workspace    30 s  the CUDA backend's forward and backward at N=16384 with 1 GiB, 2 GiB and the default
#                        workspace (a row is skipped when its own expected time no longer fits) -> checks.json
#     sanitize     30 s  compute-sanitizer memcheck and racecheck on small cases, where the runtime allows it
#                                                                                -> checks.json
#     prototype    25 s  the CUTLASS 3 prototype (csrc/prototypes/, prebuilt or built if the time left allows):
#                        its softmax partials at D=4096, N in {4096, 16384}, V in {128256, 151936} against
#                        torch (fp32 logits, float64 on sampled rows), timed beside cuBLAS's product of the
#                        same shape (bf16 and fp32 output); last, so that a fault of an unproven kernel can
#                        cost no other stage                                    -> checks.json
#     (reserve)    10 s  the table and plot of every benchmark record          -> bench.json, bench.png
# What comes back in $OUT (8 files at most): device_check.log (every stage's output), dmon.txt (`nvidia-smi dmon
# -s pucm -d 1` for the whole run: power, clocks, memory), smoke.json, bench.json, bench.png, products.json,
# checks.json (the prototype's report under "cutlass_prototype"). stdout ends with the stage summary and the
# benchmark table.
#
# Knobs: OUT (results folder; default a new temp dir), DEVICE_CHECK_BUDGET_S, SKIP (stages to skip, comma-
# separated), BENCH_OPS (the ops of the benchmark stages), BENCH_IMPLS / BENCH_PEER_IMPLS (the core and peers
# stages' implementations), CHECK_OPS (the correctness stage's ops), TRITON_CHECK_ARGS (device_check_triton.py's
# arguments), PEER_WHEELS (default .carry/wheels), PREBUILT (default .carry/prebuilt), FUSEDLOSS_COMMIT
# (commit to record where the checkout has no .git), PYTHON, DRY_BOX_SCALE, PREBUILD_PROTOTYPE (with PREBUILD=1).
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
DRY=${DRY_RUN:-0}
RERUN=${RERUN:-0}
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || PY=python
LIMIT=540
# A dry run does the same work on tiny shapes on a CPU, where the Triton interpreter and the first nvcc build
# are slower than a GPU's stages: its boxes are DRY_BOX_SCALE (default 3) times the GPU's.
SCALE=1
[[ "$DRY" == 1 ]] && SCALE=${DRY_BOX_SCALE:-3}
TOTAL=${DEVICE_CHECK_BUDGET_S:-$((LIMIT * SCALE))}
RESERVE=$((10 * SCALE))
# name:box seconds, in the order they run
# (core and peers gave 10 s and 15 s to prototype: they are bench.py runs under a budget, which record the cases
# they could not start as skipped for RERUN=1; the fixed-work stages keep their boxes)
STAGES=(smoke:20 build:60 core:185 peers:75 profile:45 correctness:60 workspace:30 sanitize:30 prototype:25)
declare -A WRITES=([smoke]="smoke.json" [build]="log" [core]="bench.json" [peers]="bench.json"
                   [profile]="products.json, bench.json" [correctness]="checks.json" [workspace]="checks.json"
                   [sanitize]="checks.json" [prototype]="checks.json")
OPS=${BENCH_OPS:-"cross_entropy token_logprobs grpo_loss distillation_loss"}
PEER_WHEELS=${PEER_WHEELS:-"$ROOT/.carry/wheels"}
PREBUILT=${PREBUILT:-"$ROOT/.carry/prebuilt"}
# kept in the checkout (git-ignored) so that a second call on the same machine finds them
STATE=${DEVICE_CHECK_STATE:-"$ROOT/benchmarks/out/device-state"}
PARTS="$STATE/parts"
PEER_SITE="$STATE/peer-site"

source_hash() {  # the extension's sources: a prebuilt _C is used only when built from these
  (cd "$ROOT" && find csrc setup.py -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)
}

# ------------------------------------------------------------------------------------------ PLAN=1
if [[ "${PLAN:-0}" == 1 ]]; then
  sum=0
  printf '%-12s %6s %8s  %s\n' stage box "ends at" writes
  for s in "${STAGES[@]}"; do
    name=${s%%:*}; b=$(( ${s##*:} * SCALE )); sum=$((sum + b))
    printf '%-12s %5ss %7ss  %s\n' "$name" "$b" "$sum" "${WRITES[$name]}"
  done
  sum=$((sum + RESERVE))
  printf '%-12s %5ss %7ss  %s\n' reserve "$RESERVE" "$sum" "bench.json, bench.png (table and plot of every record)"
  printf 'sum %s s (limit %s s%s): %s\n' "$sum" "$((LIMIT * SCALE))" "$( ((SCALE > 1)) && echo ", dry run")" \
    "$( ((sum <= LIMIT * SCALE)) && echo ok || echo OVER)"
  ((sum <= LIMIT * SCALE)); exit $?
fi

# ------------------------------------------------------------------------------------------ PREBUILD=1
if [[ "${PREBUILD:-0}" == 1 ]]; then
  # The extension for another Python (the GPU machine's), built here from a scratch copy of the sources:
  # it links no torch, so only the Python ABI and the sources must match there.
  PB=${PREBUILD_PYTHON:-python3.12}
  copy=$(mktemp -d /tmp/fl-prebuild.XXXXXX)
  tar --exclude=.git --exclude=.carry --exclude=build --exclude='*.so' --exclude=benchmarks/out -cf - . \
    | tar -xf - -C "$copy"
  (cd "$copy" && FUSEDLOSS_CUDA_ARCHS=${FUSEDLOSS_CUDA_ARCHS:-90a} FUSEDLOSS_CUDA=1 "$PB" setup.py -q build_ext --inplace \
    && "$PB" -c "import runpy, sys, pathlib; sys.argv = ['setup.py', '--name']; \
runpy.run_path('setup.py')['write_build_info'](pathlib.Path('fusedloss'))" >/dev/null) || exit 1
  mkdir -p "$PREBUILT"
  # one folder for several Pythons' builds of the same sources
  [[ "$(cat "$PREBUILT/SOURCES" 2>/dev/null)" != "$(source_hash)" ]] && rm -f "$PREBUILT"/_C*.so
  cp "$copy"/fusedloss/_C*.so "$copy"/fusedloss/_build_info.py "$PREBUILT"/
  source_hash > "$PREBUILT/SOURCES"
  rm -rf "$copy"
  rc=0
  if [[ "${PREBUILD_PROTOTYPE:-1}" == 1 ]]; then
    # the CUTLASS prototype: plain C entry points, no Python ABI, so this Python (it needs the nvidia-cutlass
    # wheel) builds it for every machine; PROTO_SOURCES beside it is the hash the prototype stage compares
    "$PY" tools/cutlass_prototype.py --prebuild "$PREBUILT"
    rc=$?
    (( rc == 2 )) && echo "prototype: not prebuilt (above: what is missing); the stage builds it or says why not" && rc=0
  fi
  ls -la "$PREBUILT"; cat "$PREBUILT/SOURCES"
  exit $rc
fi

# ------------------------------------------------------------------------------------------ set-up
if [[ -z "${OUT:-}" ]]; then OUT=$(mktemp -d /tmp/fl-device-check.XXXXXX); fi
mkdir -p "$OUT"
LOG="$OUT/device_check.log"
: > "$LOG"
[[ "$RERUN" != 1 ]] && rm -rf "$STATE"
mkdir -p "$STATE" "$PARTS"
SKIP=",${SKIP:-},"
START=$(date +%s)
SUMMARY=()
DMON_PID=""
if [[ "$DRY" == 1 ]]; then
  DEV=(--device cpu --dtype float32 --model-gpu h200)
  N_BIG=64; V_BIG=257; N_SMALL=32; V_SMALL=263; D=32; N_CHECK=24; V_CHECK=509; D_CHECK=16
  export TRITON_INTERPRET=1  # the Triton kernels through the interpreter: results checked, never timed
else
  DEV=(--device cuda --dtype bfloat16)
  N_BIG=16384; V_BIG=151936; N_SMALL=4096; V_SMALL=128256; D=4096; N_CHECK=1024; V_CHECK=151936; D_CHECK=1024
fi
IMPLS_CORE=${BENCH_IMPLS:-"reference fusedloss:cuda fusedloss:triton"}
IMPLS_PEERS=${BENCH_PEER_IMPLS:-"trl liger cce torch-lce"}
# the profile of the Triton interpreter says nothing: a dry run profiles the torch backend's CPU ops instead
IMPLS_PROFILE="fusedloss:cuda fusedloss:triton"
[[ "$DRY" == 1 ]] && IMPLS_PROFILE="fusedloss:torch"
CHECK_OPS=${CHECK_OPS:-"token_logprobs cross_entropy grpo_loss dpo_loss distillation_loss"}

elapsed() { echo $(( $(date +%s) - START )); }
say() { echo "$*" | tee -a "$LOG"; }
done_mark() { [[ -f "$STATE/$1.done" ]]; }

# The schedule: the stages that will run, their boxes scaled to fit the budget, each ending at a fixed time.
declare -A END_AT
plan_schedule() {
  local s name b run_sum=0 t=0
  for s in "${STAGES[@]}"; do
    name=${s%%:*}; b=${s##*:}
    if [[ "$SKIP" == *",$name,"* ]] || { [[ "$RERUN" == 1 ]] && done_mark "$name"; }; then continue; fi
    run_sum=$((run_sum + b))
  done
  (( run_sum == 0 )) && run_sum=1
  for s in "${STAGES[@]}"; do
    name=${s%%:*}; b=${s##*:}
    if [[ "$SKIP" == *",$name,"* ]] || { [[ "$RERUN" == 1 ]] && done_mark "$name"; }; then END_AT[$name]=$t; continue; fi
    t=$(( t + b * (TOTAL - RESERVE) / run_sum ))
    END_AT[$name]=$t
  done
}

_run_boxed() {  # _run_boxed BOX FUNC ARGS...: FUNC in a child bash with this script's functions and variables
  timeout -k 5 "$1" bash -c "$(declare -f); $(declare -p DRY RERUN ROOT OUT LOG PY STATE PARTS PEER_SITE PEER_WHEELS \
    PREBUILT DEV N_BIG V_BIG N_SMALL V_SMALL D N_CHECK V_CHECK D_CHECK OPS IMPLS_CORE IMPLS_PEERS IMPLS_PROFILE \
    CHECK_OPS TRITON_CHECK_ARGS BOX TRITON_INTERPRET 2>/dev/null); cd \"\$ROOT\"; \"\$@\"" stage "${@:2}"
}

# stage NAME FUNC ARGS...: FUNC inside the stage's box; its output to the log; rc and seconds to the summary
stage() {
  local name=$1; shift
  if [[ "$SKIP" == *",$name,"* ]]; then SUMMARY+=("$(printf '%-12s skipped (SKIP)' "$name")"); return 0; fi
  if [[ "$RERUN" == 1 ]] && done_mark "$name"; then
    SUMMARY+=("$(printf '%-12s done in the first call' "$name")"); return 0
  fi
  local b=$(( ${END_AT[$name]} - $(elapsed) ))
  if (( b < 5 )); then
    SUMMARY+=("$(printf '%-12s skipped: its box is spent (%ss in)' "$name" "$(elapsed)")")
    say "== $name: skipped, its box is spent"; return 0
  fi
  say "== [$(elapsed)s] $name (box ${b}s)"
  local t0 rc what
  t0=$(date +%s)
  BOX=$b _run_boxed "$b" "$@" >> "$LOG" 2>&1
  rc=$?
  what="rc=$rc"
  (( rc == 124 || rc == 137 )) && what="STOPPED at its box (${b}s)"
  (( rc == 0 )) && touch "$STATE/$name.done"
  say "== $name: $what ($(( $(date +%s) - t0 ))s)"
  SUMMARY+=("$(printf '%-12s %-28s %4ss' "$name" "$what" "$(( $(date +%s) - t0 ))")")
  return "$rc"
}

# ------------------------------------------------------------------------------------------ 1. smoke
smoke_stage() {
  echo "date: $(date -u +%FT%TZ) dry_run=$DRY rerun=$RERUN commit: ${FUSEDLOSS_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  local kernel runtime can
  kernel=$(uname -r)
  if [[ "$kernel" == 4.4.0* ]] || dmesg 2>/dev/null | grep -qi gvisor; then runtime=gvisor
  elif [[ "$kernel" == *-fc* ]] || dmesg 2>/dev/null | grep -qi firecracker; then runtime=firecracker
  else runtime=unknown; fi
  can=0
  if [[ "$runtime" != gvisor ]] && { command -v compute-sanitizer >/dev/null || [[ -x /usr/local/cuda/bin/compute-sanitizer ]]; }; then
    can=1
  fi
  [[ "$DRY" == 1 ]] && can=0
  echo "kernel $kernel: runtime $runtime, compute-sanitizer can run: $can"
  echo "$runtime $can" > "$STATE/runtime"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi -q -d CLOCK,POWER,PERFORMANCE
  else
    echo "nvidia-smi: not found"
  fi
  command -v nvcc >/dev/null && nvcc --version | tail -2
  RUNTIME=$runtime SANITIZER=$can "$PY" benchmarks/device_check_smoke.py --out "$OUT/smoke.json" \
    $([[ "$DRY" == 1 ]] && echo --cpu)
}

# ------------------------------------------------------------------------------------------ 2. build ‖ peers
peers_install() {
  local wheels=("$PEER_WHEELS"/*.whl) w
  if [[ ! -e "${wheels[0]}" ]]; then
    echo "no wheels in $PEER_WHEELS (benchmarks/fetch_peer_wheels.sh fetches them): the peers are recorded unavailable"
    return 0
  fi
  for w in "${wheels[@]}"; do  # one at a time: a wheel for another Python must not block the rest
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$PEER_SITE" "$w" \
      2>&1 | grep -v "Running pip as the 'root' user" || true
  done
  FUSEDLOSS_PEER_SITE=$PEER_SITE "$PY" -c "
import sys; sys.path.append('$PEER_SITE')
from benchmarks import peers
for name in ('trl', 'liger', 'cce', 'torch-lce'):
    print(f'peer {name:<10} {peers.availability(name, \"cuda\") or \"installed\"}')"
}

# prebuilt_ok DIR: a prebuilt _C for this Python's ABI, built from these sources
ext_suffix() { "$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))"; }
prebuilt_ok() {
  local dir=$1 suffix
  suffix=$(ext_suffix)
  if [[ ! -f "$dir/_C$suffix" ]]; then echo "prebuilt: none for $suffix in $dir ($(ls "$dir" 2>/dev/null | tr '\n' ' '))"; return 1; fi
  if [[ "$(cat "$dir/SOURCES" 2>/dev/null)" != "$(source_hash)" ]]; then echo "prebuilt: built from other sources"; return 1; fi
  if ! grep -q "sm_90a" "$dir/_build_info.py" 2>/dev/null; then echo "prebuilt: not built for sm_90a"; return 1; fi
  echo "prebuilt: _C$suffix matches this Python and these sources; $(grep -E "^(NVCC_VERSION|CUDA_ARCHS)" "$dir/_build_info.py" | tr '\n' ' ')"
}

build_extension() {  # build_extension TREE: the extension in TREE (the checkout, or a scratch copy when dry)
  local tree=$1
  if prebuilt_ok "$PREBUILT"; then
    cp "$PREBUILT/_C$(ext_suffix)" "$PREBUILT"/_build_info.py "$tree/fusedloss/"
    # it must import, and on a GPU its own CUDA runtime must find the device (the driver is new enough)
    if (cd "$tree" && "$PY" -c "from fusedloss.backends.cuda import backend as b; import sys; \
ok = b.extension_built() if sys.argv[1] == '1' else b.availability() == 'available'; assert ok, b.availability()" "$DRY"); then
      echo "using the prebuilt extension"; return 0
    fi
    echo "the prebuilt extension does not import here: building"
    rm -f "$tree"/fusedloss/_C*.so
  fi
  (cd "$tree" && FUSEDLOSS_CUDA_ARCHS=90a FUSEDLOSS_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} FUSEDLOSS_NVCC_THREADS=4 \
    "$PY" setup.py -q build_ext --inplace 2>&1 | grep -v -i deprecat
   rc=${PIPESTATUS[0]}
   "$PY" -c "import runpy, sys, pathlib; sys.argv = ['setup.py', '--name']; \
runpy.run_path('setup.py')['write_build_info'](pathlib.Path('fusedloss'))" > /dev/null
   exit "$rc")
}

build_stage() {
  peers_install > "$STATE/peers.log" 2>&1 &
  local peers_pid=$! rc tree="$ROOT"
  if [[ "$DRY" == 1 ]]; then  # never rewrite this checkout's extension in a dry run: a scratch copy
    tree=$(mktemp -d /tmp/fl-dc-build.XXXXXX)
    tar --exclude=.git --exclude=.carry --exclude=build --exclude='*.so' --exclude=benchmarks/out -cf - . \
      | tar -xf - -C "$tree"
  fi
  build_extension "$tree"
  rc=$?
  cat "$tree/fusedloss/_build_info.py" 2>/dev/null
  [[ "$DRY" == 1 ]] && rm -rf "$tree"
  wait "$peers_pid"
  cat "$STATE/peers.log"
  # one tiny call of the CUDA backend (on a CPU: its host twins through the check script's dry run)
  if [[ "$DRY" == 1 ]]; then
    "$PY" -c "import fusedloss; print('backend_status', fusedloss.backend_status())"
  else
    "$PY" benchmarks/device_check_smoke.py --backends cuda --add --out "$OUT/smoke.json" || rc=1
  fi
  return $rc
}

# ------------------------------------------------------------------------------------------ 3-5. benchmark
ALL_PARTS=()
parts() { ALL_PARTS=(); local f; for f in "$PARTS"/*.json; do [[ -f "$f" ]] && ALL_PARTS+=("$f"); done; }

# bench TAG BUDGET_S ARGS...: one bench.py run, its records into the parts and, as they come, into
# $OUT/bench.json; fails when a case was left unmeasured by the budget (a rerun then runs the stage again)
bench() {
  local tag=$1 budget=$2 rc; shift 2
  parts
  (( budget < 10 )) && budget=10
  FUSEDLOSS_PEER_SITE=${BENCH_PEER_SITE:-} "$PY" -m benchmarks.bench "${DEV[@]}" --D "$D" --group-by n \
    --out "$PARTS" --tag "$tag" --budget-s "$budget" --live-json "$OUT/bench.json" --no-plot \
    ${ALL_PARTS[@]:+--skip-done "${ALL_PARTS[@]}"} "$@"
  rc=$?
  "$PY" -c "import json, sys; r = json.load(open(sys.argv[1])); left = [x for x in r if x['status'] == 'skipped']; \
print(f'{sys.argv[2]}: {len(left)} case(s) left for a rerun') if left else None; sys.exit(3 if left else 0)" \
    "$PARTS/$tag.json" "$tag" 2>/dev/null || { (( rc == 0 )) && rc=3; }
  return "$rc"
}

core_stage() {  # N=16384 first (three quarters of the box), then N=4096
  local t0 big
  t0=$(date +%s)
  big=$(( BOX * 70 / 100 - 15 ))
  bench core-big "$big" --N "$N_BIG" --V "$V_BIG" --impls $IMPLS_CORE --ops $OPS --repeat 5
  local rc=$?
  bench core-small $(( BOX - ($(date +%s) - t0) - 15 )) --N "$N_SMALL" --V "$V_SMALL" --impls $IMPLS_CORE --ops $OPS \
    --repeat 5 || rc=$?
  return $rc
}

peers_stage() {  # the peers' published shape first
  local t0
  t0=$(date +%s)
  BENCH_PEER_SITE=$PEER_SITE bench peers-small $(( BOX * 55 / 100 - 15 )) --N "$N_SMALL" --V "$V_SMALL" \
    --impls $IMPLS_PEERS --ops $OPS --repeat 5
  local rc=$?
  BENCH_PEER_SITE=$PEER_SITE bench peers-big $(( BOX - ($(date +%s) - t0) - 15 )) --N "$N_BIG" --V "$V_BIG" \
    --impls $IMPLS_PEERS --ops $OPS --repeat 3 || rc=$?
  return $rc
}

profile_stage() {
  "$PY" -m benchmarks.bench --product-rates "${DEV[@]::2}" --out "$STATE" --tag products
  local rc=$?
  cp "$STATE/products.json" "$OUT/products.json" 2>/dev/null
  bench profile $(( BOX - 25 )) --profile --N "$N_BIG" --V "$V_BIG" --impls $IMPLS_PROFILE --ops $OPS \
    --gemm-warmup-s 0.5 || rc=1
  return $rc
}

# ------------------------------------------------------------------------------------------ 6-8. checks
collect_checks() {  # every check's report, as far as it got, in $OUT/checks.json
  "$PY" - "$STATE" "$OUT/checks.json" <<'EOF'
import json, sys
from pathlib import Path
state, out = Path(sys.argv[1]), Path(sys.argv[2])
def load(name):
    p = state / name
    try:
        return json.loads(p.read_text()) if p.is_file() else None
    except ValueError as exc:
        return {"unreadable": str(exc)}
report = {"runtime": (state / "runtime").read_text().split() if (state / "runtime").is_file() else None}
ops = load("ops_check.json")
if isinstance(ops, list):
    refs = {(r["op"], r["N"]): r for r in ops if r["impl"] == "reference" and r.get("status") == "ok"}
    verdicts = []
    for r in ops:
        if r["impl"] == "reference" or r.get("status") != "ok":
            if r["impl"] != "reference":  # unavailable here: said so, neither ok nor failed
                verdicts.append({"op": r["op"], "impl": r["impl"], "status": r.get("status"), "reason": r.get("reason"),
                                 "ok": None if r.get("status") == "unavailable" else False})
            continue
        ref = refs.get((r["op"], r["N"]))
        naive = ref.get("max_rel_err") if ref else None
        # bf16: no worse than the naive bf16 path plus 2e-3; fp32: within max(1e-5, 4x the naive error)
        limit = None if naive is None else (naive + 2e-3 if r["dtype"] != "float32" else max(1e-5, 4 * naive))
        ok = limit is not None and r.get("max_rel_err") is not None and r["max_rel_err"] <= limit
        verdicts.append({"op": r["op"], "impl": r["impl"], "N": r["N"], "V": r["V"], "D": r["D"], "dtype": r["dtype"],
                         "err_vs_float64": r.get("max_rel_err"), "naive_err_vs_float64": naive, "limit": limit,
                         "errors": r.get("errors"), "ok": bool(ok)})
    report["ops_vs_float64_and_naive"] = verdicts
for key, name in (("cuda_check", "cuda_check.json"), ("triton_check", "triton_check.json"),
                  ("workspace_sweep", "workspace.json"), ("sanitizers", "sanitize.json"),
                  ("cutlass_prototype", "prototype.json")):
    report[key] = load(name)
out.write_text(json.dumps(report, indent=1, default=str))
verdicts = report.get("ops_vs_float64_and_naive") or []
bad = [v for v in verdicts if v["ok"] is False]
absent = sorted({f"{v['impl']} ({v['reason']})" for v in verdicts if v["ok"] is None})
line = f"checks.json: ops against float64 and the naive path: {sum(v['ok'] is True for v in verdicts)} ok, {len(bad)} not ok"
line += "".join(f"; unavailable: {a}" for a in absent)
for key in ("cuda_check", "triton_check", "workspace_sweep"):
    if isinstance(report.get(key), dict):
        line += f"; {key} ok={report[key].get('ok')}"
if isinstance(report.get("sanitizers"), dict):
    s = report["sanitizers"]
    line += "; sanitizers: " + (s.get("skipped") or ", ".join(f"{k} {s[k]['verdict']}" for k in ("memcheck", "racecheck")
                                                             if isinstance(s.get(k), dict)))
p = report.get("cutlass_prototype")
if isinstance(p, dict):
    line += f"; cutlass_prototype {p.get('status')}" + (f" ({p['reason'][:90]})" if p.get("reason") else "")
    timed = [x for x in p.get("shapes", []) if x.get("timing", {}).get("prototype", {}).get("status") == "ok"]
    if timed:  # the largest shape timed: its ratio to the bound and to cuBLAS's bf16 product
        x = timed[-1]
        line += (f" N={x['N']} V={x['V']}: check {'ok' if x['check']['ok'] else 'FAILED'}, "
                 f"{x['timing']['prototype']['over_bound']}x bound, {x.get('prototype_over_cublas_bf16_out')}x cuBLAS bf16")
print(line + "".join(f"\n  NOT OK {v['op']} {v['impl']}: {v.get('err_vs_float64')} > {v.get('limit')} "
                     f"{v.get('reason') or ''}" for v in bad))
EOF
}

correctness_stage() {
  local t0 rc=0 left
  t0=$(date +%s)
  left() { echo $(( BOX - ($(date +%s) - t0) - 3 )); }
  # every op, both backends, against float64 and against the naive path (the reference in the same dtype)
  timeout -k 5 $(( BOX * 45 / 100 )) "$PY" -m benchmarks.bench "${DEV[@]::4}" --model-gpu none --N "$N_CHECK" \
    --V "$V_CHECK" --D "$D_CHECK" --impls reference fusedloss:cuda fusedloss:triton fusedloss:torch --repeat 1 \
    --group-by n --ops $CHECK_OPS --out "$STATE" --tag ops_check --no-plot --gemm-warmup-s 0 || rc=1
  collect_checks
  local cuda_args=(--quick --only cases paths confident) triton_args=(--skip-timing --dtypes bfloat16 --cases llama3_vocab,teacher)
  [[ "$DRY" == 1 ]] && cuda_args+=(--cpu-smoke) && triton_args=(--skip-timing --cpu-smoke --dtypes float32 --cases prime_131)
  [[ -n "${TRITON_CHECK_ARGS:-}" ]] && read -r -a triton_args <<< "$TRITON_CHECK_ARGS"
  timeout -k 5 $(( $(left) * 55 / 100 )) "$PY" benchmarks/device_check_cuda.py --out "$STATE/cuda_check.json" \
    --budget-s $(( $(left) * 55 / 100 - 5 )) "${cuda_args[@]}" || rc=1
  collect_checks
  timeout -k 5 "$(left)" "$PY" benchmarks/device_check_triton.py --out "$STATE/triton_check.json" "${triton_args[@]}" || rc=1
  collect_checks
  return $rc
}

workspace_stage() {
  "$PY" benchmarks/device_check_cuda.py --out "$STATE/workspace.json" --only timings --budget-s $(( BOX - 5 )) \
    $([[ "$DRY" == 1 ]] && echo --cpu-smoke)
  local rc=$?
  collect_checks
  return $rc
}

sanitize_stage() {
  local runtime can
  read -r runtime can < "$STATE/runtime" 2>/dev/null || { runtime=unknown; can=0; }
  local half=$(( BOX / 2 - 2 )) mem_rc race_rc
  if [[ "$DRY" == 1 ]]; then  # no device to sanitise: the two scripts on the CPU (host twins)
    timeout "$half" "$PY" benchmarks/sanitize_smoke.py --device cpu --backends torch --dtypes float32 \
      --ops cross_entropy > "$STATE/memcheck.txt" 2>&1; mem_rc=$?
    timeout "$half" "$PY" benchmarks/sanitize_smoke.py --tiles --device cpu > "$STATE/racecheck.txt" 2>&1; race_rc=$?
  elif [[ "$can" != 1 ]]; then
    printf '{"runtime": "%s", "skipped": "compute-sanitizer cannot use the GPU on this runtime"}\n' "$runtime" \
      > "$STATE/sanitize.json"
    collect_checks; return 0
  else
    local cs
    cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    FUSEDLOSS_DETERMINISTIC=1 timeout -k 3 "$half" "$cs" --tool memcheck --error-exitcode 86 --print-limit 20 \
      "$PY" benchmarks/sanitize_smoke.py --device cuda --backends cuda triton --dtypes bfloat16 \
      --ops cross_entropy token_logprobs > "$STATE/memcheck.txt" 2>&1; mem_rc=$?
    timeout -k 3 "$half" "$cs" --tool racecheck --racecheck-report all --error-exitcode 86 --print-limit 20 \
      "$PY" benchmarks/sanitize_smoke.py --tiles --device cuda > "$STATE/racecheck.txt" 2>&1; race_rc=$?
  fi
  cat "$STATE/memcheck.txt" "$STATE/racecheck.txt"
  "$PY" - "$STATE" "$runtime" "$mem_rc" "$race_rc" <<'EOF'
import json, sys
from pathlib import Path
state, runtime, mem_rc, race_rc = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def summary(name, rc):
    text = (state / f"{name}.txt").read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if "SUMMARY" in ln or "failure(s)" in ln or ln.startswith("FAIL")]
    what = {0: "clean", 86: "errors found", 124: "stopped at its box"}.get(rc, f"rc={rc}")
    return {"rc": rc, "verdict": what, "summary": lines[-6:], "tail": text[-1500:]}
json.dump({"runtime": runtime, "memcheck": summary("memcheck", mem_rc), "racecheck": summary("racecheck", race_rc)},
          open(state / "sanitize.json", "w"), indent=1)
EOF
  collect_checks
  (( mem_rc == 0 && race_rc == 0 ))
}

# ------------------------------------------------------------------------------------------ 9. prototype
prototype_stage() {  # docs/design.md, "The CUTLASS 3 prototype (compile-only)"
  local args=(--prebuilt "$PREBUILT" --out "$STATE/prototype.json" --budget-s $(( BOX - 3 )))
  [[ "$DRY" == 1 ]] && args+=(--dry-run)
  "$PY" benchmarks/cutlass_prototype_device.py "${args[@]}"
  local rc=$?
  collect_checks
  return $rc
}

# ------------------------------------------------------------------------------------------ run
# (one function, called on the last line: bash has parsed all of it before it starts)
run_all() {
  plan_schedule
  say "fusedloss device check: OUT=$OUT dry_run=$DRY rerun=$RERUN budget=${TOTAL}s skip=$SKIP"
  if command -v nvidia-smi >/dev/null && [[ "$DRY" != 1 ]]; then
    nvidia-smi dmon -s pucm -d 1 -o T > "$OUT/dmon.txt" 2>&1 &
    DMON_PID=$!
  else
    echo "nvidia-smi dmon: no GPU here (dry run)" > "$OUT/dmon.txt"
  fi
  trap '[[ -n "$DMON_PID" ]] && kill "$DMON_PID" 2>/dev/null' EXIT

  stage smoke smoke_stage
  if [[ $? == 2 ]]; then
    say "SMOKE FAILED: no usable GPU or torch (see $LOG); nothing else is run"
  else
    stage build build_stage
    stage core core_stage
    stage peers peers_stage
    stage profile profile_stage
    stage correctness correctness_stage
    stage workspace workspace_stage
    stage sanitize sanitize_stage
    stage prototype prototype_stage
  fi

  # the table and the plot of every benchmark record (this call's and, on a rerun, the first's)
  parts
  local merged="$STATE/merged"
  mkdir -p "$merged"
  if (( ${#ALL_PARTS[@]} )); then
    "$PY" -m benchmarks.bench --merge "${ALL_PARTS[@]}" --out "$merged" --tag bench > "$merged/table.txt" 2>&1
    cp "$merged/bench.json" "$OUT/bench.json" 2>/dev/null
    cp "$merged/bench.png" "$OUT/bench.png" 2>/dev/null
    cat "$merged/table.txt" >> "$LOG"
  fi
  collect_checks > "$STATE/checks_summary.txt" 2>&1
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used \
    --format=csv >> "$LOG" 2>&1
  [[ -n "$DMON_PID" ]] && kill "$DMON_PID" 2>/dev/null && DMON_PID=""

  echo
  echo "================ device check summary (${TOTAL}s budget, $(elapsed)s used, dry_run=$DRY, rerun=$RERUN) ================"
  for s in "${SUMMARY[@]}"; do echo "  $s"; done
  grep -E "^SMOKE|^wrote .*ok=|^(ALL OK|SOME CHECKS FAILED)|ERROR SUMMARY|RACECHECK SUMMARY|left for a rerun|^cutlass_prototype_device:" "$LOG" \
    | cut -c1-200 | tail -10
  cut -c1-300 "$STATE/checks_summary.txt" | head -12
  echo "---------------- benchmark ----------------"
  [[ -f "$merged/table.txt" ]] && grep -v "^wrote\|^total" "$merged/table.txt" | cut -c1-260
  echo "files in $OUT:"; (cd "$OUT" && find . -type f -printf '  %p %s bytes\n' | sort)
}

run_all "$@"; exit $?
