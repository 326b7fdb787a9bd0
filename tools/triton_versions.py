"""The Triton versions fusedloss supports, and the compile matrix that proves it without a GPU.

The Triton kernels are compiled for sm_90a (H100/H200) by every supported Triton: the oldest one, the one the
H200 images ship, and the newest (the one installed in this environment). The extra versions are installed
next to the checkout, one folder each (``.triton-versions/<version>``, git-ignored), and put first on
``PYTHONPATH`` for the compile step only; each wheel carries its own ptxas, so no GPU and no CUDA toolkit are
needed. ``tests/tooling/test_compile_triton_kernels.py::test_kernels_compile_for_sm90`` compiles every launch variant
with each of them.

    python tools/triton_versions.py install           # fetch the pinned versions (about 170 MB each)
    python tools/triton_versions.py table OUT.md      # compile every variant with each version, write the table

Why these versions: Triton 3.4 is the oldest with the launch hook the compile harness records launches with
(``triton.knobs.runtime.jit_cache_hook``); 3.6.0 is the version of the H200 images the device benchmark runs
on; pyproject.toml's ``triton`` range is exactly the range compiled here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OLDEST = "3.4.0"
DEVICE_IMAGE = "3.6.0"
PINNED = (OLDEST, DEVICE_IMAGE)
VERSIONS_DIR = ROOT / ".triton-versions"
# Spills are allowed nowhere but here: the oldest Triton's register allocator leaves the 128 x 128 lean forward
# (255 registers) 4 bytes of spill per thread (3.5.0: 40-44 bytes, measured once; from 3.6.0 on: none). The
# kernels run correctly with it; the H200 images (3.6.0) and the newest compile every variant without any.
KNOWN_SPILLS = {(OLDEST, "statistics_forward_kernel", 128, 128): 8}


def spill_allowed(version: str, kernel: str, config: str) -> int:
    """Bytes of spill (and stack) per thread a compiled variant may have (0 but for KNOWN_SPILLS)."""
    import re

    tile = re.search(r"block_m=(\d+), block_v=(\d+)", config)
    key = (version, kernel, *(int(x) for x in tile.groups())) if tile else None
    return KNOWN_SPILLS.get(key, 0)


def target_dir(version: str) -> Path:
    return VERSIONS_DIR / version


def installed(version: str) -> bool:
    return (target_dir(version) / "triton" / "__init__.py").is_file()


def install(version: str) -> Path:
    """pip-installs ``triton==version`` (no dependencies) into its own folder; a no-op when present."""
    target = target_dir(version)
    if not installed(version):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        f"triton=={version}"], check=True)
    return target


def compile_report(version: str | None, dtypes: tuple = (), arch: str = "sm_90a", defaults: bool = False) -> dict:
    """The compile harness's report (tests/tooling/test_compile_triton_kernels.py) with ``version`` first on the path
    (None: this environment's Triton), for ``arch`` (sm_90a, sm_100a, sm_120, gfx942, gfx950; ``defaults``: only the
    variants the planner picks by default there)."""
    sys.path.insert(0, str(ROOT / "tests" / "tooling"))
    from test_compile_triton_kernels import run_harness

    extra = () if version is None else (str(target_dir(version)),)
    return run_harness("compile", extra_path=extra, args=("--arch", arch, *(("--defaults",) if defaults else ()),
                                                          *dtypes))


def _table(reports: dict) -> str:
    versions = list(reports)
    rows: dict = {}
    for version, report in reports.items():
        for r in report["results"]:
            key = (r["dtype"], r["kernel"].replace("_kernel", ""), r["config"], " ".join(r["flags"] or ()))
            rows.setdefault(key, {})[version] = r
    head = ("| dtype | kernel | tile (m, v, k, warps, stages) | flags | "
            + " | ".join(f"{v}: regs / spill B / smem KiB" for v in versions) + " |")
    lines = [head, "|" + "---|" * (4 + len(versions))]
    for (dtype, kernel, config, flags), by_version in rows.items():
        tile = config.replace("TileConfig(", "").split(", slots")[0]
        tile = ", ".join(part.split("=")[1] for part in tile.split(", "))
        cells = []
        for v in versions:
            r = by_version.get(v)
            cells.append("-" if r is None else f"{r['registers']} / {r['spill_stores']} / {r['shared'] / 1024:.0f}")
        lines.append(f"| {dtype} | {kernel} | {tile} | {flags} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("install", "table"):
        print(__doc__)
        return 2
    for version in PINNED:
        install(version)
    if argv[0] == "install":
        print("triton versions ready:", ", ".join(str(target_dir(v)) for v in PINNED))
        return 0
    import triton

    reports = {v: compile_report(v) for v in PINNED}
    reports[triton.__version__] = compile_report(None)
    for report in reports.values():  # ptxas's own log names temporary files: the parsed figures are what count
        for r in report["results"]:
            r.pop("log", None)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    out = Path(argv[1])
    out.write_text("# Triton kernels compiled for sm_90a, every launch variant, per Triton version\n\n"
                   f"`python tools/triton_versions.py table` at commit {commit} (ptxas of each Triton wheel, no GPU). "
                   "Cells: registers per thread / spill stores in bytes / shared memory in KiB. Rows that differ "
                   "only in the row-alignment hint (D = 4096 and D = 1000) share a line.\n\n" + _table(reports))
    out.with_suffix(".json").write_text(json.dumps({"commit": commit, "reports": reports}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
