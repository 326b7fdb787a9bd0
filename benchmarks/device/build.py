"""The extension and the peers on the device machine, which has no network: prebuilt where it can be, else built.

    python -m benchmarks.device.build --prebuild .carry/prebuilt --python python3.12
        # on any machine with nvcc: the extension for the GPU machine's Python (sm_90a), from a scratch copy of
        # the sources, into DIR with SOURCES (the sources' hash); it links no torch, only the Python ABI must match

The device run (``python -m benchmarks.device``) calls ``extension`` and ``install_peers`` in its ``build`` stage:
a prebuilt ``_C`` is used when it was built from these sources (``SOURCES``), for this Python (its ABI tag), for
sm_90a, and imports here (on a GPU: the backend is available, its runtime finds the device); else the extension is
built in place (``FUSEDLOSS_CUDA_ARCHS=90a``, ``MAX_JOBS`` 16). The peers' wheels (``.carry/wheels``, fetched by
``benchmarks/fetch_peer_wheels.sh``) are installed one at a time into a folder of the run's state, never into the
environment.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXCLUDE = (".git", ".carry", "build", "benchmarks/out")
PEERS = ("trl", "liger", "cce", "torch-lce")


def source_hash(root: Path = ROOT) -> str:
    """16 hex digits over csrc/ and setup.py (names and bytes): a prebuilt _C is used only when built from these."""
    h = hashlib.sha256()
    files = sorted([p for p in (root / "csrc").rglob("*") if p.is_file()] + [root / "setup.py"])
    for f in files:
        h.update(f"\0{f.relative_to(root).as_posix()}\0".encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def scratch_copy(root: Path = ROOT) -> Path:
    """The checkout without .git, .carry, build outputs and shared objects: a tree to build in without touching
    this one."""
    dest = Path(tempfile.mkdtemp(prefix="fl-device-build."))

    def ignore(folder, names):
        rel = Path(folder).relative_to(root).as_posix()
        return [n for n in names if n.endswith(".so") or (f"{rel}/{n}" if rel != "." else n) in EXCLUDE]

    shutil.copytree(root, dest / "tree", ignore=ignore)
    return dest / "tree"


def _write_build_info(tree: Path, python: str) -> None:
    code = ("import runpy, sys, pathlib; sys.argv = ['setup.py', '--name']; "
            "runpy.run_path('setup.py')['write_build_info'](pathlib.Path('fusedloss'))")
    subprocess.run([python, "-c", code], cwd=tree, capture_output=True)


def build_in_place(tree: Path, python: str = sys.executable, jobs: int | None = None) -> int:
    """``setup.py build_ext --inplace`` for sm_90a in ``tree``, then its _build_info.py; the build's exit status."""
    env = dict(os.environ, FUSEDLOSS_CUDA_ARCHS=os.environ.get("FUSEDLOSS_CUDA_ARCHS", "90a"), FUSEDLOSS_CUDA="1",
               MAX_JOBS=str(jobs or os.environ.get("MAX_JOBS", 16)), FUSEDLOSS_NVCC_THREADS="4")
    proc = subprocess.run([python, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree, env=env, text=True,
                          capture_output=True)
    print("\n".join(ln for ln in (proc.stdout + proc.stderr).splitlines() if "deprecat" not in ln.lower())[-4000:])
    _write_build_info(tree, python)
    return proc.returncode


def prebuild(folder: Path, python: str) -> int:
    """The extension for ``python`` (another interpreter's ABI) into ``folder``, beside earlier builds of the same
    sources for other Pythons."""
    tree = scratch_copy()
    try:
        rc = build_in_place(tree, python)
        if rc:
            return rc
        folder.mkdir(parents=True, exist_ok=True)
        if (folder / "SOURCES").is_file() and (folder / "SOURCES").read_text().strip() != source_hash():
            for old in folder.glob("_C*.so"):
                old.unlink()
        for f in [*(tree / "fusedloss").glob("_C*.so"), tree / "fusedloss" / "_build_info.py"]:
            shutil.copy2(f, folder)
        (folder / "SOURCES").write_text(source_hash() + "\n")
    finally:
        shutil.rmtree(tree.parent, ignore_errors=True)
    for f in sorted(folder.iterdir()):
        print(f"  {f.name} {f.stat().st_size} bytes")
    return 0


def prebuilt_ok(folder: Path) -> str:
    """'' when ``folder`` holds a _C for this Python's ABI built from these sources for sm_90a, else why not."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    if not (folder / f"_C{suffix}").is_file():
        return f"prebuilt: none for {suffix} in {folder}"
    if (folder / "SOURCES").is_file() and (folder / "SOURCES").read_text().strip() == source_hash():
        info = (folder / "_build_info.py").read_text() if (folder / "_build_info.py").is_file() else ""
        return "" if "sm_90a" in info else "prebuilt: not built for sm_90a"
    return "prebuilt: built from other sources"


def _imports(tree: Path, dry: bool) -> bool:
    code = ("from fusedloss.backends.cuda import backend as b; import sys; "
            "ok = b.extension_built() if sys.argv[1] == '1' else b.availability() == 'available'; "
            "assert ok, b.availability()")
    return subprocess.run([sys.executable, "-c", code, "1" if dry else "0"], cwd=tree).returncode == 0


def extension(tree: Path, prebuilt: Path, dry: bool) -> int:
    """The extension in ``tree``: the prebuilt one when it fits and imports, else built; 0 when it is there."""
    why = prebuilt_ok(prebuilt)
    print(why or f"prebuilt: _C matches this Python and these sources ({prebuilt})", flush=True)
    if not why:
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        for name in (f"_C{suffix}", "_build_info.py"):
            shutil.copy2(prebuilt / name, tree / "fusedloss" / name)
        if _imports(tree, dry):  # on a GPU its own CUDA runtime must find the device (the driver is new enough)
            print("using the prebuilt extension", flush=True)
            return 0
        print("the prebuilt extension does not import here: building", flush=True)
        for old in (tree / "fusedloss").glob("_C*.so"):
            old.unlink()
    rc = build_in_place(tree)
    info = tree / "fusedloss" / "_build_info.py"
    print(info.read_text() if info.is_file() else "no _build_info.py", flush=True)
    return rc


def install_peers(wheels: Path, site: Path) -> list[str]:
    """The peers' wheels into ``site`` (pip --no-index --no-deps --target), one at a time so that a wheel for
    another Python blocks none of the rest; then each peer's availability, one line each."""
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        return [f"no wheels in {wheels} (benchmarks/fetch_peer_wheels.sh fetches them): the peers are recorded "
                "unavailable"]
    for w in found:
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--no-cache-dir", "--upgrade", "--target", str(site), str(w)], capture_output=True,
                           text=True)
        if r.returncode:
            print(f"{w.name}: {(r.stdout + r.stderr).strip()[-300:]}")
    code = ("import sys; sys.path.append(sys.argv[1]); from benchmarks import peers\n"
            "for name in sys.argv[2:]: print(f'peer {name:<10} {peers.availability(name, \"cuda\") or \"installed\"}')")
    r = subprocess.run([sys.executable, "-c", code, str(site), *PEERS], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, FUSEDLOSS_PEER_SITE=str(site)))
    return (r.stdout + r.stderr).strip().splitlines()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prebuild", type=Path, required=True, help="the folder to put the extension in")
    ap.add_argument("--python", default="python3.12", help="the GPU machine's Python (default python3.12)")
    args = ap.parse_args(argv)
    return prebuild(args.prebuild, args.python)


if __name__ == "__main__":
    sys.exit(main())
