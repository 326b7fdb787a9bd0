"""The device run: one time-boxed check of every backend on a CUDA machine (written for an H200), in ``--budget``
seconds (default 540): correctness against float64, the sanitizers, and the timings.

    python -m benchmarks.device --out results-h200                       # on a machine with a CUDA GPU
    python -m benchmarks.device --out results-h200-2 --rerun --budget 300   # what the first call left
    python -m benchmarks.device --plan                                   # each stage's box and their sum; runs nothing
    python -m benchmarks.device --dry-run --out /tmp/dry                 # every stage on tiny CPU shapes (no GPU)

Prepared beforehand, on any machine with network access (both git-ignored, under .carry/):
    bash benchmarks/fetch_peer_wheels.sh                                 # the peers' wheels (TRL, Liger, CCE)
    python -m benchmarks.device.build --prebuild .carry/prebuilt --python python3.12
                                                                         # the extension for sm_90a and that Python
The GPU machine needs no network: the wheels are installed from .carry/wheels, the prebuilt extension is used when
it was built from these sources for the machine's Python and imports there, else the extension is built.

Stages (``--plan`` prints them with their sum). A stage's box is when it must end on a fixed schedule: time a stage
leaves unused passes to the next one; a stage past its box is stopped and keeps what it wrote (every check rewrites
its JSON after each record):
    smoke        20 s  GPU, driver, clocks/power/performance state, runtime (gVisor refuses compute-sanitizer,
                       Firecracker allows it), versions, one tiny forward+backward per backend against float64; stops
                       the run when no GPU is visible                                       -> smoke.json
    build        60 s  the extension (prebuilt, or built for sm_90a) while the peer wheels install; then one tiny call
                       of the CUDA backend                                                  -> log, smoke.json
    core        185 s  bench.py: reference, fusedloss:cuda, fusedloss:triton; cross_entropy, token_logprobs (+entropy),
                       grpo_loss, distillation_loss; N=16384 (V=151936) then N=4096 (V=128256); D=4096, bf16; timed
                       calls alternated between implementations after a GEMM warm-up      -> bench.json (per record)
    peers        75 s  TRL, Liger, Cut Cross-Entropy, torch's F.linear_cross_entropy at N=4096, V=128256, then
                       N=16384, V=151936                                                    -> bench.json
    profile      45 s  the three product rates the cost model assumes, then per (backend, op) at N=16384 one
                       forward+backward under torch.profiler, each kernel's count and time -> products.json, bench.json
    cases        30 s  check_cases: every op of benchmarks/cases.py at N=1024, V=151936, D=1024 for every backend
                       (torch, triton, cuda, cuda+epilogue where the kernels are built) against cases.reference64 and
                       beside the naive bf16 path                                           -> checks.json
    backends     30 s  check_cuda's cases, paths and confident rows; check_triton in bf16  -> checks.json
    workspace    30 s  the CUDA backend's forward and backward at N=16384 with 1 GiB, 2 GiB and the default
                       workspace, the cost model beside each                                -> checks.json
    sanitize     30 s  compute-sanitizer memcheck and racecheck on small cases, where it exists and the runtime
                       allows it                                                            -> checks.json
    epilogue     25 s  check_epilogue: the sm_90a epilogue path on both ops against float64 and today's path, its
                       forward beside cuBLAS's product; last, so that a fault of its kernels costs no other stage
                                                                                            -> checks.json
    (reserve)    10 s  the table and plot of every benchmark record                         -> bench.json, bench.png
What comes back in --out (8 files at most): device_check.log (every stage's output), dmon.txt (``nvidia-smi dmon``
for the whole run), smoke.json, bench.json, bench.png, products.json, checks.json. stdout ends with the stage
summary and the benchmark table. The state a --rerun needs (the benchmark's parts, the checks' reports, the stages
done) stays in benchmarks/out/device-state (git-ignored; --state).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.device import build

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 540
RESERVE = 10
# name: box seconds, in the order they run
STAGES = {"smoke": 20, "build": 60, "core": 185, "peers": 75, "profile": 45, "cases": 30, "backends": 30,
          "workspace": 30, "sanitize": 30, "epilogue": 25}
WRITES = {"smoke": "smoke.json", "build": "log, smoke.json", "core": "bench.json", "peers": "bench.json",
          "profile": "products.json, bench.json", "cases": "checks.json", "backends": "checks.json",
          "workspace": "checks.json", "sanitize": "checks.json", "epilogue": "checks.json"}
# A dry run does the same work on tiny shapes on a CPU, where the Triton interpreter and nvcc's first build are slower
# than a GPU's stages: its boxes are DRY_BOX_SCALE times the GPU's.
DRY_BOX_SCALE = 3
SHAPES = {False: dict(N_BIG=16384, V_BIG=151936, N_SMALL=4096, V_SMALL=128256, D=4096),
          True: dict(N_BIG=64, V_BIG=257, N_SMALL=32, V_SMALL=263, D=32)}
OPS = ["cross_entropy", "token_logprobs", "grpo_loss", "distillation_loss"]
CHECK_OPS = ["token_logprobs", "cross_entropy", "grpo_loss", "dpo_loss", "distillation_loss"]
STOPPED = 124


def plan(scale: int = 1) -> tuple[list[tuple[str, int, int]], int]:
    """(stage, box, ends at) for every stage and the reserve, and their sum."""
    rows, t = [], 0
    for name, box in [*STAGES.items(), ("reserve", RESERVE)]:
        t += box * scale
        rows.append((name, box * scale, t))
    return rows, t


def sanitizer() -> str | None:
    return shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)


def detect_runtime() -> str:
    """gvisor (compute-sanitizer cannot use the GPU there), firecracker (it can) or unknown."""
    kernel = platform.release()
    try:
        dmesg = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout.lower()
    except (OSError, subprocess.TimeoutExpired):
        dmesg = ""
    if kernel.startswith("4.4.0") or "gvisor" in dmesg:
        return "gvisor"
    if "-fc" in kernel or "firecracker" in dmesg:
        return "firecracker"
    return "unknown"


class Run:
    """One call: the schedule, the log, the stages' summary and the state a rerun reads."""

    def __init__(self, args):
        self.args, self.dry, self.rerun = args, args.dry_run, args.rerun
        self.scale = DRY_BOX_SCALE if self.dry else 1
        self.total = args.budget if args.budget is not None else LIMIT * self.scale
        self.reserve = RESERVE * self.scale
        self.out, self.state = Path(args.out), Path(args.state)
        self.parts = self.state / "parts"
        self.out.mkdir(parents=True, exist_ok=True)
        if not self.rerun:
            shutil.rmtree(self.state, ignore_errors=True)
        self.parts.mkdir(parents=True, exist_ok=True)
        self.log = self.out / "device_check.log"
        self.log.write_text("")
        self.start = time.monotonic()
        self.summary: list[str] = []
        self.skip = set(filter(None, args.skip.split(",")))
        self.shape = SHAPES[self.dry]
        self.dev = ["--device", "cpu", "--dtype", "float32", "--model-gpu", "h200"] if self.dry else [
            "--device", "cuda", "--dtype", "bfloat16"]
        self.env = dict(os.environ)
        self.env.pop("TRITON_INTERPRET", None)
        if self.dry:
            self.env["TRITON_INTERPRET"] = "1"  # the Triton kernels through the interpreter: checked, never timed
        self.end_at = self._schedule()

    # -- the schedule -------------------------------------------------------------------------------------------
    def done(self, name: str) -> bool:
        return (self.state / f"{name}.done").is_file()

    def skipped(self, name: str) -> bool:
        return name in self.skip or (self.rerun and self.done(name))

    def _schedule(self) -> dict:
        """Each stage's end, its box scaled so that the stages that will run fill the budget less the reserve."""
        run_sum = sum(b for n, b in STAGES.items() if not self.skipped(n)) or 1
        end, t = {}, 0.0
        for name, box in STAGES.items():
            if not self.skipped(name):
                t += box * (self.total - self.reserve) / run_sum
            end[name] = t
        return end

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def say(self, line: str) -> None:
        print(line, flush=True)
        with open(self.log, "a") as f:
            f.write(line + "\n")

    def sh(self, cmd: list, timeout: float, env: dict | None = None, stdout=None) -> int:
        """``cmd`` with its output to the log (or ``stdout``), stopped (its process group) after ``timeout``
        seconds: its exit status, STOPPED when it was stopped."""
        with open(self.log, "a") as log:
            out = stdout or log
            proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env={**self.env, **(env or {})}, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                return proc.wait(timeout=max(1.0, timeout))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                return STOPPED

    def py(self, *args, timeout: float, env: dict | None = None, stdout=None) -> int:
        return self.sh([sys.executable, *args], timeout, env, stdout)

    def left(self, name: str) -> float:
        return self.end_at[name] - self.elapsed()

    def stage(self, name: str, fn) -> int:
        if name in self.skip:
            self.summary.append(f"{name:<12} skipped (--skip)")
            return 0
        if self.rerun and self.done(name):
            self.summary.append(f"{name:<12} done in the first call")
            return 0
        box = self.left(name)
        if box < 5:
            self.summary.append(f"{name:<12} skipped: its box is spent ({self.elapsed():.0f}s in)")
            self.say(f"== {name}: skipped, its box is spent")
            return 0
        self.say(f"== [{self.elapsed():.0f}s] {name} (box {box:.0f}s)")
        t0 = time.monotonic()
        try:
            rc = fn(name)
        except Exception as exc:  # a stage's own failure is its result, never the run's end
            self.say(f"{name}: {type(exc).__name__}: {exc}")
            rc = 1
        what = f"STOPPED at its box ({box:.0f}s)" if rc == STOPPED else f"rc={rc}"
        if rc == 0:
            (self.state / f"{name}.done").touch()
        seconds = time.monotonic() - t0
        self.say(f"== {name}: {what} ({seconds:.0f}s)")
        self.summary.append(f"{name:<12} {what:<28} {seconds:4.0f}s")
        return rc

    # -- 1. smoke, 2. build -------------------------------------------------------------------------------------
    def smoke(self, name) -> int:
        commit = os.environ.get("FUSEDLOSS_COMMIT") or subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or "unknown"
        runtime = detect_runtime()
        can = int(runtime != "gvisor" and sanitizer() is not None and not self.dry)
        self.say(f"date: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} dry_run={int(self.dry)} "
                 f"rerun={int(self.rerun)} commit: {commit}")
        self.say(f"kernel {platform.release()}: runtime {runtime}, compute-sanitizer can run: {can}")
        (self.state / "runtime").write_text(f"{runtime} {can}\n")
        if shutil.which("nvidia-smi"):
            self.sh(["nvidia-smi", "-q", "-d", "CLOCK,POWER,PERFORMANCE"], 10)
        if shutil.which("nvcc"):
            self.sh(["nvcc", "--version"], 10)
        return self.py("-m", "benchmarks.device.smoke", "--out", self.out / "smoke.json",
                       *(["--cpu"] if self.dry else []), timeout=self.left(name),
                       env={"RUNTIME": runtime, "SANITIZER": str(can)})

    def build(self, name) -> int:
        lines: list[str] = []
        peers = threading.Thread(target=lambda: lines.extend(
            build.install_peers(Path(self.args.wheels), self.state / "peer-site")), daemon=True)
        peers.start()
        # never rewrite this checkout's extension in a dry run: a scratch copy
        tree = build.scratch_copy() if self.dry else ROOT
        try:
            code = ("import sys; from pathlib import Path; from benchmarks.device import build; "
                    "sys.exit(build.extension(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == '1'))")
            rc = self.py("-c", code, tree, self.args.prebuilt, int(self.dry), timeout=self.left(name) - 5)
        finally:
            if self.dry:
                shutil.rmtree(tree.parent, ignore_errors=True)
        peers.join(timeout=max(1.0, self.left(name)))
        for line in lines:
            self.say(line)
        if rc == 0 and not self.dry:  # one tiny call of the CUDA backend
            rc = self.py("-m", "benchmarks.device.smoke", "--backends", "cuda", "--add", "--out",
                         self.out / "smoke.json", timeout=self.left(name))
        return rc

    # -- 3-5. the benchmark -------------------------------------------------------------------------------------
    def bench(self, tag: str, budget: float, *args, peers: bool = False) -> int:
        """One bench.py run, its records into the parts and, as they come, into bench.json; 3 when a case was left
        unmeasured by the budget (a rerun then runs the stage again)."""
        done = sorted(str(p) for p in self.parts.glob("*.json"))
        env = {"FUSEDLOSS_PEER_SITE": str(self.state / "peer-site") if peers else ""}
        rc = self.py("-m", "benchmarks.bench", *self.dev, "--D", self.shape["D"], "--group-by", "n", "--out",
                     self.parts, "--tag", tag, "--budget-s", max(10, int(budget)), "--live-json",
                     self.out / "bench.json", "--no-plot", *(["--skip-done", *done] if done else []), *args,
                     timeout=budget + 30, env=env)
        try:
            left = [r for r in json.loads((self.parts / f"{tag}.json").read_text()) if r["status"] == "skipped"]
        except (OSError, ValueError):
            left = []
        if left:
            self.say(f"{tag}: {len(left)} case(s) left for a rerun")
            rc = rc or 3
        return rc

    def core(self, name) -> int:
        s, t0, box = self.shape, time.monotonic(), self.left(name)
        rc = self.bench("core-big", box * 0.70 - 15, "--N", s["N_BIG"], "--V", s["V_BIG"], "--impls",
                        *self.args.impls, "--ops", *self.args.bench_ops, "--repeat", 5)
        rc2 = self.bench("core-small", box - (time.monotonic() - t0) - 15, "--N", s["N_SMALL"], "--V", s["V_SMALL"],
                         "--impls", *self.args.impls, "--ops", *self.args.bench_ops, "--repeat", 5)
        return rc or rc2

    def peers(self, name) -> int:  # the peers' published shape first
        s, t0, box = self.shape, time.monotonic(), self.left(name)
        rc = self.bench("peers-small", box * 0.55 - 15, "--N", s["N_SMALL"], "--V", s["V_SMALL"], "--impls",
                        *self.args.peer_impls, "--ops", *self.args.bench_ops, "--repeat", 5, peers=True)
        rc2 = self.bench("peers-big", box - (time.monotonic() - t0) - 15, "--N", s["N_BIG"], "--V", s["V_BIG"],
                         "--impls", *self.args.peer_impls, "--ops", *self.args.bench_ops, "--repeat", 3, peers=True)
        return rc or rc2

    def profile(self, name) -> int:
        rc = self.py("-m", "benchmarks.bench", "--product-rates", *self.dev[:2], "--out", self.state, "--tag",
                     "products", timeout=self.left(name) / 2)
        if (self.state / "products.json").is_file():
            shutil.copy(self.state / "products.json", self.out / "products.json")
        # the profile of the Triton interpreter says nothing: a dry run profiles the torch backend's CPU ops
        impls = ["fusedloss:torch"] if self.dry else ["fusedloss:cuda", "fusedloss:triton"]
        rc2 = self.bench("profile", self.left(name) - 25, "--profile", "--N", self.shape["N_BIG"], "--V",
                         self.shape["V_BIG"], "--impls", *impls, "--ops", *self.args.bench_ops, "--gemm-warmup-s", 0.5)
        return rc or (1 if rc2 else 0)

    # -- 6-10. the checks ---------------------------------------------------------------------------------------
    def cases(self, name) -> int:
        rc = self.py("-m", "benchmarks.device.check_cases", "--out", self.state / "cases.json", "--budget-s",
                     max(5, self.left(name) - 10), "--ops", *self.args.check_ops,
                     *(["--dry-run"] if self.dry else []), timeout=self.left(name))
        self.collect()
        return rc

    def backends(self, name) -> int:
        cuda_args = ["--quick", "--only", "cases", "paths", "confident"] + (["--cpu-smoke"] if self.dry else [])
        triton_args = (["--skip-timing", "--cpu-smoke", "--dtypes", "float32", "--cases", "prime_131"] if self.dry
                       else ["--skip-timing", "--dtypes", "bfloat16", "--cases", "llama3_vocab,teacher"])
        if self.args.triton_args is not None:
            triton_args = self.args.triton_args.split()
        share = self.left(name) * 0.55
        rc = self.py("-m", "benchmarks.device.check_cuda", "--out", self.state / "cuda_check.json", "--budget-s",
                     max(5, share - 5), *cuda_args, timeout=share)
        self.collect()
        rc2 = self.py("-m", "benchmarks.device.check_triton", "--out", self.state / "triton_check.json",
                      *triton_args, timeout=self.left(name))
        self.collect()
        return STOPPED if STOPPED in (rc, rc2) else (1 if rc or rc2 else 0)

    def workspace(self, name) -> int:
        rc = self.py("-m", "benchmarks.device.check_cuda", "--out", self.state / "workspace.json", "--only",
                     "timings", "--budget-s", max(5, self.left(name) - 5), *(["--cpu-smoke"] if self.dry else []),
                     timeout=self.left(name))
        self.collect()
        return rc

    def sanitize(self, name) -> int:
        try:
            runtime, can = (self.state / "runtime").read_text().split()
        except (OSError, ValueError):
            runtime, can = "unknown", "0"
        half = self.left(name) / 2 - 2
        mem_txt, race_txt = self.state / "memcheck.txt", self.state / "racecheck.txt"
        smoke = ["-m", "benchmarks.device.sanitize_smoke"]
        if self.dry:  # no device to sanitise: the two smokes on the CPU (host twins)
            with open(mem_txt, "w") as f:
                mem_rc = self.py(*smoke, "--device", "cpu", "--backends", "torch", "--dtypes", "float32", "--ops",
                                 "cross_entropy", timeout=half, stdout=f)
            with open(race_txt, "w") as f:
                race_rc = self.py(*smoke, "--tiles", "--device", "cpu", timeout=half, stdout=f)
        elif can != "1":
            why = ("compute-sanitizer was not found (PATH, /usr/local/cuda/bin)" if sanitizer() is None
                   else "compute-sanitizer cannot use the GPU on this runtime")
            (self.state / "sanitize.json").write_text(json.dumps({"runtime": runtime, "skipped": why}) + "\n")
            self.collect()
            return 0
        else:
            cs = sanitizer()
            with open(mem_txt, "w") as f:
                mem_rc = self.sh([cs, "--tool", "memcheck", "--error-exitcode", "86", "--print-limit", "20",
                                  sys.executable, *smoke, "--device", "cuda", "--backends", "cuda", "triton",
                                  "--dtypes", "bfloat16", "--ops", "cross_entropy", "token_logprobs"], half,
                                 env={"FUSEDLOSS_DETERMINISTIC": "1"}, stdout=f)
            with open(race_txt, "w") as f:
                race_rc = self.sh([cs, "--tool", "racecheck", "--racecheck-report", "all", "--error-exitcode", "86",
                                   "--print-limit", "20", sys.executable, *smoke, "--tiles", "--device", "cuda"],
                                  half, stdout=f)

        def summary(path: Path, rc: int) -> dict:
            text = path.read_text(errors="replace")
            lines = [ln for ln in text.splitlines() if "SUMMARY" in ln or "failure(s)" in ln or ln.startswith("FAIL")]
            what = {0: "clean", 86: "errors found", STOPPED: "stopped at its box"}.get(rc, f"rc={rc}")
            return {"rc": rc, "verdict": what, "summary": lines[-6:], "tail": text[-1500:]}

        with open(self.log, "a") as log:
            log.write(mem_txt.read_text(errors="replace") + race_txt.read_text(errors="replace"))
        (self.state / "sanitize.json").write_text(json.dumps(
            {"runtime": runtime, "memcheck": summary(mem_txt, mem_rc), "racecheck": summary(race_txt, race_rc)},
            indent=1))
        self.collect()
        return 0 if mem_rc == race_rc == 0 else (STOPPED if STOPPED in (mem_rc, race_rc) else 1)

    def epilogue(self, name) -> int:
        # the extension is the build stage's (prebuilt or built in place)
        rc = self.py("-m", "benchmarks.device.check_epilogue", "--out", self.state / "epilogue.json", "--budget-s",
                     max(1, self.left(name) - 5), *(["--dry-run"] if self.dry else []), timeout=self.left(name))
        self.collect()
        # 2: no sm_90 GPU, 3: the extension lacks the kernels (an opt-in build): said in checks.json, not a failure
        return 0 if rc in (2, 3) else rc

    # -- checks.json --------------------------------------------------------------------------------------------
    def collect(self) -> str:
        """Every check's report, as far as it got, in checks.json; one summary line back."""
        def load(name):
            p = self.state / name
            try:
                return json.loads(p.read_text()) if p.is_file() else None
            except ValueError as exc:
                return {"unreadable": str(exc)}

        runtime = self.state / "runtime"
        report = {"runtime": runtime.read_text().split() if runtime.is_file() else None}
        cases = load("cases.json")
        if isinstance(cases, dict) and "records" in cases:
            report["ops_vs_float64_and_naive"] = [r for r in cases["records"] if r["impl"] != "reference"]
            report["cases_complete"] = cases.get("complete")
        for key, name in (("cuda_check", "cuda_check.json"), ("triton_check", "triton_check.json"),
                          ("workspace_sweep", "workspace.json"), ("sanitizers", "sanitize.json"),
                          ("epilogue", "epilogue.json")):
            report[key] = load(name)
        (self.out / "checks.json").write_text(json.dumps(report, indent=1, default=str))
        verdicts = report.get("ops_vs_float64_and_naive") or []
        bad = [v for v in verdicts if v.get("ok") is False]
        absent = sorted({f"{v['impl']} ({v.get('reason')})" for v in verdicts if v.get("ok") is None})
        line = (f"checks.json: ops against float64 and the naive path: {sum(v.get('ok') is True for v in verdicts)} "
                f"ok, {len(bad)} not ok" + "".join(f"; unavailable: {a}" for a in absent))
        for key in ("cuda_check", "triton_check", "workspace_sweep"):
            if isinstance(report.get(key), dict):
                line += f"; {key} ok={report[key].get('ok')}"
        s = report.get("sanitizers")
        if isinstance(s, dict):
            line += "; sanitizers: " + (s.get("skipped") or ", ".join(
                f"{k} {s[k]['verdict']}" for k in ("memcheck", "racecheck") if isinstance(s.get(k), dict)))
        e = report.get("epilogue")
        if isinstance(e, dict):
            line += f"; epilogue {e.get('status')}" + (f" ({e['reason'][:90]})" if e.get("reason") else "")
        return line + "".join(f"\n  NOT OK {v['op']} {v['impl']}: {v.get('err_vs_float64')} > {v.get('limit')} "
                              f"{v.get('error') or v.get('reason') or ''}" for v in bad)

    # -- the run ------------------------------------------------------------------------------------------------
    def merge(self) -> str:
        """The table and the plot of every benchmark record (this call's and, on a rerun, the first's)."""
        parts = sorted(self.parts.glob("*.json"))
        if not parts:
            return ""
        merged = self.state / "merged"
        merged.mkdir(parents=True, exist_ok=True)
        with open(merged / "table.txt", "w") as f:
            self.py("-m", "benchmarks.bench", "--merge", *parts, "--out", merged, "--tag", "bench",
                    timeout=max(5.0, self.total - self.elapsed() - 3), stdout=f)
        for name in ("bench.json", "bench.png"):
            if (merged / name).is_file():
                shutil.copy(merged / name, self.out / name)
        table = (merged / "table.txt").read_text()
        with open(self.log, "a") as log:
            log.write(table)
        return table

    def __call__(self) -> int:
        self.say(f"fusedloss device check: out={self.out} dry_run={int(self.dry)} rerun={int(self.rerun)} "
                 f"budget={self.total:.0f}s skip={','.join(sorted(self.skip))}")
        dmon = None
        if shutil.which("nvidia-smi") and not self.dry:
            dmon = subprocess.Popen(["nvidia-smi", "dmon", "-s", "pucm", "-d", "1", "-o", "T"],
                                    stdout=open(self.out / "dmon.txt", "w"), stderr=subprocess.STDOUT)
        else:
            (self.out / "dmon.txt").write_text("nvidia-smi dmon: no GPU here (dry run)\n")
        try:
            if self.stage("smoke", self.smoke) == 2:
                self.say(f"SMOKE FAILED: no usable GPU or torch (see {self.log}); nothing else is run")
            else:
                for name in list(STAGES)[1:]:
                    self.stage(name, getattr(self, name))
            table = self.merge()
            checks = self.collect()
            if shutil.which("nvidia-smi"):
                self.sh(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used",
                         "--format=csv"], 3)
        finally:
            if dmon is not None:
                dmon.terminate()
        print()
        print(f"================ device check summary ({self.total:.0f}s budget, {self.elapsed():.0f}s used, "
              f"dry_run={int(self.dry)}, rerun={int(self.rerun)}) ================")
        for line in self.summary:
            print(f"  {line}")
        marks = ("SMOKE", "wrote ", "ALL OK", "SOME CHECKS FAILED", "ERROR SUMMARY", "RACECHECK SUMMARY", "cases:",
                 "check_epilogue:")
        hits = [ln[:200] for ln in self.log.read_text(errors="replace").splitlines()
                if ln.startswith(marks) or "left for a rerun" in ln or "ERROR SUMMARY" in ln]
        print("\n".join(hits[-10:]))
        print("\n".join(ln[:300] for ln in checks.splitlines()[:12]))
        print("---------------- benchmark ----------------")
        print("\n".join(ln[:260] for ln in table.splitlines() if not ln.startswith(("wrote", "total"))))
        print(f"files in {self.out}:")
        for p in sorted(self.out.rglob("*")):
            if p.is_file():
                print(f"  ./{p.relative_to(self.out)} {p.stat().st_size} bytes")
        return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.device", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="the folder of what comes back (default: a new temporary one)")
    ap.add_argument("--budget", type=float, default=None, help=f"seconds for the whole run (default {LIMIT}; "
                                                               f"dry run {DRY_BOX_SCALE}x)")
    ap.add_argument("--dry-run", action="store_true", help="every stage on tiny CPU shapes (no GPU)")
    ap.add_argument("--rerun", action="store_true", help="finish what an earlier call on this machine left")
    ap.add_argument("--plan", action="store_true", help="print each stage's box and their sum; run nothing")
    ap.add_argument("--skip", default="", help="stages to skip, comma-separated")
    ap.add_argument("--state", default=str(ROOT / "benchmarks" / "out" / "device-state"),
                    help="kept between a call and its --rerun (default benchmarks/out/device-state)")
    ap.add_argument("--wheels", default=str(ROOT / ".carry" / "wheels"), help="the peers' wheels")
    ap.add_argument("--prebuilt", default=str(ROOT / ".carry" / "prebuilt"), help="a prebuilt extension")
    ap.add_argument("--bench-ops", nargs="+", default=OPS, help="the ops of the benchmark stages")
    ap.add_argument("--impls", nargs="+", default=["reference", "fusedloss:cuda", "fusedloss:triton"],
                    help="the core stage's implementations")
    ap.add_argument("--peer-impls", nargs="+", default=["trl", "liger", "cce", "torch-lce"],
                    help="the peers stage's implementations")
    ap.add_argument("--check-ops", nargs="+", default=CHECK_OPS, help="the cases stage's ops")
    ap.add_argument("--triton-args", default=None, help="check_triton's arguments, in place of the stage's")
    args = ap.parse_args(argv)
    if args.plan:
        scale = DRY_BOX_SCALE if args.dry_run else 1
        rows, total = plan(scale)
        print(f"{'stage':<12} {'box':>6} {'ends at':>8}  writes")
        for name, box, end in rows:
            print(f"{name:<12} {box:>5}s {end:>7}s  "
                  f"{WRITES.get(name, 'bench.json, bench.png (table and plot of every record)')}")
        ok = total <= LIMIT * scale
        print(f"sum {total} s (limit {LIMIT * scale} s{', dry run' if scale > 1 else ''}): {'ok' if ok else 'OVER'}")
        return 0 if ok else 1
    if args.out is None:
        import tempfile

        args.out = tempfile.mkdtemp(prefix="fl-device-check.")
    return Run(args)()


if __name__ == "__main__":
    sys.exit(main())
