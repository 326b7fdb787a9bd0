#!/usr/bin/env bash
# An older Debian root to build the release wheels against: Debian 11 bullseye (glibc 2.31, gcc 10), made with
# debootstrap from Debian's packages. tools/build_wheels.sh compiles and links the extension's host code with
# that root's gcc and --sysroot, so the wheel needs glibc 2.31 instead of this host's (Ubuntu 20.04, Debian 11,
# RHEL 9 and newer).
#
#     SYSROOT="$(bash tools/make_sysroot.sh | tail -1)" bash tools/build_wheels.sh
#     PREFIX=/scratch/bullseye bash tools/make_sysroot.sh
#
# Needs root: debootstrap's second stage configures the packages with dpkg inside a chroot of the new root.
# Nothing outside PREFIX changes (debootstrap itself is used from the host, or its .deb, a pinned version, is
# downloaded with the machine's apt-get, checked against its pinned SHA256 and unpacked next to the root when the
# host has none). ~400 MB on disk, 12 min on a busy 2-core VM. Release signatures are checked by debootstrap
# against Debian's bullseye archive key. The archive is the one this machine's apt configuration uses
# (tools/_apt_mirror.sh; DEBIAN_MIRROR=... for another).
set -euo pipefail
source "$(dirname "$0")/_apt_mirror.sh"
PREFIX="${PREFIX:-$HOME/.cache/fusedloss/bullseye}"
SUITE="${SUITE:-bullseye}"
MIRROR="$(debian_mirror)"
# bookworm's debootstrap (it knows bullseye); another Debian release: set both from `apt-cache show debootstrap`
DEBOOTSTRAP_VERSION="${DEBOOTSTRAP_VERSION:-1.0.128+nmu2+deb12u2}"
DEBOOTSTRAP_SHA256="${DEBOOTSTRAP_SHA256:-63f354316e9bbe747b143b7b0d83e5f237c90314a17734fba9ff202c2ef02760}"
KEYRING="${DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-bullseye-stable.gpg}"

if compgen -G "$PREFIX/usr/bin/g++-[0-9]*" >/dev/null && [[ -f "$PREFIX/.complete" ]]; then
  echo "$SUITE root already in $PREFIX" >&2
  echo "$PREFIX"
  exit 0
fi
[[ "$(id -u)" == 0 ]] || { echo "make_sysroot.sh needs root (debootstrap chroots into the new root)" >&2; exit 1; }
[[ -r "$KEYRING" ]] || { echo "no Debian archive key at $KEYRING (DEBIAN_KEYRING=...)" >&2; exit 1; }

t0=$SECONDS
if command -v debootstrap >/dev/null; then
  debootstrap=(debootstrap)
else
  tools="$PREFIX.debootstrap"
  mkdir -p "$tools"
  (cd "$tools" && apt-get -qq -o APT::Sandbox::User=root download "debootstrap=$DEBOOTSTRAP_VERSION" >&2)
  deb=("$tools"/debootstrap_*.deb)
  echo "$DEBOOTSTRAP_SHA256  ${deb[0]}" | sha256sum --quiet -c - >&2 \
    || { echo "checksum mismatch: ${deb[0]}" >&2; exit 1; }
  dpkg-deb -x "${deb[0]}" "$tools/x"
  export DEBOOTSTRAP_DIR="$tools/x/usr/share/debootstrap"
  debootstrap=("$tools/x/usr/sbin/debootstrap")
fi
# PREFIX is emptied: only ever a root this script started (marked), or a new or empty directory
if [[ -d "$PREFIX" && -n "$(ls -A "$PREFIX")" && ! -f "$PREFIX/.fusedloss-sysroot" ]]; then
  echo "PREFIX=$PREFIX is a non-empty directory this script did not make; choose another" >&2; exit 1
fi
rm -rf "$PREFIX"
mkdir -p "$PREFIX" && touch "$PREFIX/.fusedloss-sysroot"
echo "== debootstrap $SUITE into $PREFIX (minbase + g++, libc6-dev)" >&2
"${debootstrap[@]}" --variant=minbase --include=g++,libc6-dev --keyring="$KEYRING" "$SUITE" "$PREFIX" "$MIRROR" >&2
rm -rf "$PREFIX"/var/cache/apt/archives/*.deb
# As a sysroot, the root is read from outside: its absolute library links (lib64/ld-linux-x86-64.so.2 ->
# /lib/x86_64-linux-gnu/ld-2.31.so, ...) would point into this host, so make them relative.
while IFS= read -r link; do
  ln -sfn "$(realpath -m --relative-to="$(dirname "$link")" "$PREFIX$(readlink "$link")")" "$link"
done < <(find -H "$PREFIX/usr/lib" "$PREFIX/usr/lib64" -type l -lname '/*')
touch "$PREFIX/.complete"
echo "== $SUITE root: $(ls "$PREFIX"/usr/bin/g++-[0-9]* | head -1), $(ls "$PREFIX"/lib/x86_64-linux-gnu/libc-*.so | head -1) ($(( SECONDS - t0 )) s, $(du -sh "$PREFIX" | cut -f1))" >&2
echo "$PREFIX"
