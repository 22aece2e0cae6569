#!/usr/bin/env bash
# Builds wprepd and wprep the way CI does (`make build`) and lays out, under DEST, the
# files of the runtime image: DEST/opt/wprep/bin/{wprepd,wprep}, the shared libraries they
# need in DEST/opt/wprep/lib (every one but glibc's and the compiler runtime's, which the
# runtime image has), and the empty socket folder DEST/run/wprep. The Dockerfile's build
# stage runs this script; `make test-deploy` runs it too and tests the staged files.
#   bash scripts/stage_runtime.sh DEST    (CUDA_ARCHS=90-real: Hopper machine code only)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:?usage: stage_runtime.sh DEST}
BUILD=${BUILD:-build}

flags=${CMAKE_FLAGS:-}
if [[ -n ${CUDA_ARCHS:-} ]]; then flags+=" -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHS"; fi
make build BUILD="$BUILD" CMAKE_FLAGS="$flags"

rm -rf "$DEST"
mkdir -p "$DEST/opt/wprep/bin" "$DEST/opt/wprep/lib" "$DEST/run/wprep"
for b in "$BUILD/server/wprepd" "$BUILD/client/cli/wprep"; do
  install -m 0755 "$b" "$DEST/opt/wprep/bin/"
  strip --strip-unneeded "$DEST/opt/wprep/bin/$(basename "$b")"
done
# The runtime image is the build image's OS release: its glibc, libstdc++ and libgcc_s
# serve. The CUDA runtime is linked statically; the driver (libcuda) comes from the host
# through the NVIDIA container runtime.
skip='^(libc|libm|libdl|librt|libpthread|ld-linux-x86-64|libresolv|libstdc\+\+|libgcc_s|libcuda)\.so'
for b in "$DEST"/opt/wprep/bin/*; do
  if ldd "$b" | grep -q 'not found'; then
    echo "stage_runtime: $b has unresolved libraries:" >&2
    ldd "$b" | grep 'not found' >&2
    exit 1
  fi
  ldd "$b" | awk '/=> \// {print $3}'
done | sort -u | while read -r lib; do
  [[ $(basename "$lib") =~ $skip ]] && continue
  cp -L "$lib" "$DEST/opt/wprep/lib/"
done
chmod 0644 "$DEST"/opt/wprep/lib/*
du -sh "$DEST/opt/wprep/bin" "$DEST/opt/wprep/lib"
