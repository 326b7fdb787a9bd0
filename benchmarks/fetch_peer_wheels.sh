#!/usr/bin/env bash
# Download the peers' wheels into .carry/wheels (git-ignored), for python -m benchmarks.device to install
# on the GPU machine, which reaches no registry: pip install --no-deps --no-index --target <dir>.
#
#     bash benchmarks/fetch_peer_wheels.sh          # then carry ".carry/wheels" in the device run
#
# Only what the device image lacks (torch, triton, transformers, accelerate, huggingface-hub, pandas, pyarrow,
# psutil, xxhash, fsspec are there): the three peers, and TRL's
# pure-Python dependencies that are missing there (datasets, dill, multiprocess; TRL's backward imports
# trl.trainer.utils, which imports datasets). All pure-Python wheels: py3-none-any, any platform.
set -eu
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST="$ROOT/.carry/wheels"
mkdir -p "$DEST"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
PKGS=(
  "trl==1.16.0"
  "liger-kernel==0.8.5"
  "cut-cross-entropy==25.1.1"
  "datasets==5.2.0"
  "dill==0.4.1"
  "multiprocess==0.70.19"
)
for p in "${PKGS[@]}"; do
  python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$DEST" "$p"
done
ls -la "$DEST"
du -sh "$DEST"
