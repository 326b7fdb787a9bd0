#!/usr/bin/env bash
# A private CUDA 12.4 toolkit (nvcc, cicc, ptxas, headers, the static CUDA runtime) for building release wheels
# whose extension runs on NVIDIA drivers >= 525.60.13, extracted from Debian's non-free packages into one
# directory. Nothing is installed system-wide: apt works on a private sources list, package lists and cache
# under the prefix, and the packages are unpacked with `dpkg-deb -x`, not installed.
#
#     bash tools/fetch_cuda12.sh                 # into ~/.cache/fusedloss/cuda-12.4, prints the CUDA_HOME
#     PREFIX=/scratch/cuda-12.4 bash tools/fetch_cuda12.sh
#     CUDA_HOME="$(bash tools/fetch_cuda12.sh | tail -1)" bash tools/build_wheels.sh
#
# Why Debian: the package index's nvidia-cuda-nvcc-cu12 wheels (12.0 to 12.9) ship ptxas and libnvvm but no
# nvcc, cicc, cudafe++ or fatbinary, and nvidia-cuda-runtime-cu12 has no libcudart_static.a. Debian trixie's
# non-free nvidia-cuda-toolkit 12.4.131 has all of them. Needs apt-get, dpkg-deb, sha256sum and Debian's
# archive keyring (/usr/share/keyrings/debian-archive-keyring.gpg, package debian-archive-keyring); the
# binaries need glibc >= 2.34 on the build host. Downloads 1.03 GB (nvidia-cuda-dev is 934 MB: every CUDA
# library; only its headers and static runtime are kept), leaves 0.5 GB under the prefix; 2-3 min here.
#
# Checksums: apt checks each package against the signed trixie index; this script then checks each file
# against the SHA256 pinned below, so a different build of the same version is refused too. The archive is the
# one this machine's apt configuration uses (tools/_apt_mirror.sh; DEBIAN_MIRROR=... for another, e.g. Debian's
# snapshot archive once trixie no longer ships these versions: same file names and checksums).
set -euo pipefail
source "$(dirname "$0")/_apt_mirror.sh"
PREFIX="${PREFIX:-$HOME/.cache/fusedloss/cuda-12.4}"
MIRROR="$(debian_mirror)"
KEYRING="${DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}"
HOME_DIR="$PREFIX/home"   # the CUDA_HOME: bin/nvcc, nvvm/, include/, lib64/

# package=version  sha256 (of the .deb)
PACKAGES=(
  "nvidia-cuda-toolkit=12.4.131~12.4.1-2 cd5fe85aee38d108b315f408a688641478f2402622a10c677478eb7a6c4e5319"
  "libnvvm4=12.4.131~12.4.1-2 3c905c1df7453e1ad477516c4465629c310d2f58a796d66f44070dc289e7ec12"
  "nvidia-cuda-dev=12.4.127~12.4.1-2 d846838f914a0176948d48a8bcade5d6dbcccb5c9374343f6475f5503f173ee0"
  # <nv/target>, which cuda_fp16.h includes
  "libcu++-dev=2.3.2-2 30e911c1909265591b5ea793df0e49e56bed631238b68b3e75c97590c4985686"
)

if [[ -x "$HOME_DIR/bin/nvcc" ]] && "$HOME_DIR/bin/nvcc" --version 2>/dev/null | grep -q "release 12.4"; then
  echo "CUDA 12.4 already in $HOME_DIR" >&2
  echo "$HOME_DIR"
  exit 0
fi
for tool in apt-get dpkg-deb sha256sum; do
  command -v "$tool" >/dev/null || { echo "fetch_cuda12.sh needs $tool (a Debian or Ubuntu host)" >&2; exit 1; }
done
[[ -r "$KEYRING" ]] || { echo "fetch_cuda12.sh needs Debian's archive keyring at $KEYRING (DEBIAN_KEYRING=...)" >&2; exit 1; }

# PREFIX is emptied below: only ever one this script made (marked), or a new or empty directory
if [[ -d "$PREFIX" && -n "$(ls -A "$PREFIX")" && ! -f "$PREFIX/.fusedloss-cuda12" ]]; then
  echo "PREFIX=$PREFIX is a non-empty directory this script did not make; choose another" >&2; exit 1
fi
mkdir -p "$PREFIX" && touch "$PREFIX/.fusedloss-cuda12"

t0=$SECONDS
APT="$PREFIX/apt"
ROOTFS="$PREFIX/root"
mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/debs"
echo "deb [signed-by=$KEYRING] $MIRROR trixie main non-free" > "$APT/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$APT/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT/cache" -o Debug::NoLocking=1)
# as root, apt would hand the download to its _apt user, who cannot write into a private directory
[[ "$(id -u)" != 0 ]] || apt_opts+=(-o APT::Sandbox::User=root)
echo "== apt-get update (private lists in $APT)" >&2
apt-get "${apt_opts[@]}" -qq update >&2

echo "== apt-get download (1.03 GB)" >&2
specs=()
for entry in "${PACKAGES[@]}"; do specs+=("${entry%% *}"); done
(cd "$APT/debs" && apt-get "${apt_opts[@]}" -qq download "${specs[@]}" >&2)
for entry in "${PACKAGES[@]}"; do
  spec="${entry%% *}" sum="${entry##* }"
  name="${spec%%=*}" version="${spec#*=}"
  deb=("$APT/debs/${name}_${version//:/%3a}_"*.deb)
  [[ -f "${deb[0]}" ]] || { echo "not downloaded: $spec" >&2; exit 1; }
  echo "$sum  ${deb[0]}" | sha256sum --quiet -c - >&2 || { echo "checksum mismatch: ${deb[0]}" >&2; exit 1; }
done
echo "== checksums match; extracting with dpkg-deb (nothing installed)" >&2

rm -rf "$ROOTFS" "$HOME_DIR"
mkdir -p "$ROOTFS"
for deb in "$APT"/debs/*.deb; do
  case "$(basename "$deb")" in
    nvidia-cuda-dev_*)  # headers and the static runtime only (the shared CUDA libraries are 2 GB unpacked)
      dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$ROOTFS" --wildcards './usr/include/*' \
        './usr/lib/x86_64-linux-gnu/libcudart_static.a' './usr/lib/x86_64-linux-gnu/libcudadevrt.a' \
        './usr/lib/x86_64-linux-gnu/libculibos.a' ;;
    *) dpkg-deb -x "$deb" "$ROOTFS" ;;
  esac
done

# A CUDA_HOME in NVIDIA's layout, which nvcc (and setup.py) expect.
tk="$ROOTFS/usr/lib/nvidia-cuda-toolkit"
mkdir -p "$HOME_DIR/bin/crt" "$HOME_DIR/nvvm/bin" "$HOME_DIR/nvvm/lib64" "$HOME_DIR/nvvm/libdevice"
cp "$tk/bin/nvcc" "$HOME_DIR/bin/"
for b in ptxas fatbinary nvlink cudafe++ bin2c cuobjdump nvdisasm nvprune cu++filt; do
  cp "$ROOTFS/usr/bin/$b" "$HOME_DIR/bin/"
done
cp "$tk"/bin/crt/* "$HOME_DIR/bin/crt/"
cp "$tk/bin/cicc" "$HOME_DIR/nvvm/bin/"
cp "$tk/libdevice/libdevice.10.bc" "$HOME_DIR/nvvm/libdevice/"
cp -a "$ROOTFS"/usr/lib/x86_64-linux-gnu/libnvvm.so* "$HOME_DIR/nvvm/lib64/"
ln -sfn ../root/usr/include "$HOME_DIR/include"
ln -sfn ../root/usr/lib/x86_64-linux-gnu "$HOME_DIR/lib64"
cat > "$HOME_DIR/bin/nvcc.profile" <<'EOF'
TOP              = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
LD_LIBRARY_PATH += $(TOP)/lib64:
PATH            += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES        +=  "-I$(TOP)/include" $(_SPACE_)
LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/lib64"
CUDAFE_FLAGS    +=
PTXAS_FLAGS     +=
EOF
[[ "${KEEP_DEBS:-0}" == "1" ]] || rm -rf "$APT/debs"
"$HOME_DIR/bin/nvcc" --version | grep -q "release 12.4" || { echo "the extracted nvcc does not run" >&2; exit 1; }
echo "== CUDA 12.4 in $HOME_DIR ($(( SECONDS - t0 )) s; $(du -sh "$PREFIX" | cut -f1) on disk)" >&2
echo "$HOME_DIR"
