#!/usr/bin/env bash
# Builds Release (sm_90 machine code) here and gathers into .bundle/ every
# test, tool and benchmark binary plus the non-glibc shared libraries they need, so the
# GPU machine (which has no gRPC/protobuf/abseil) can run them with
# LD_LIBRARY_PATH=.bundle/lib. .bundle/ is git-ignored: pass it to the device in `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
# The H200 needs sm_90 only; the shipped default (sm_90 + sm_100 + PTX) triples binary
# size, and the carried tree is limited to 64 MiB.
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS:-90-real} ${CMAKE_FLAGS:-}
# TARGETS="wprep_bench kernels_cuda_test" builds and bundles only those (kernel iterations).
cmake --build "$BUILD" -j "$(nproc)" ${TARGETS:+--target $TARGETS}

rm -rf .bundle
mkdir -p .bundle/bin .bundle/lib
mapfile -t bins < <(find "$BUILD" -type f -executable \
  \( -name '*_test' -o -name 'wprep' -o -name 'wprepd' -o -name 'wprep_bench' -o -name 'wprep_quantize_bench' \
     -o -name 'wprep_rpc_bench' -o -name 'wprep_ipc_*' -o -name 'wprep_fault_client' -o -name 'wprep_vmm_client' -o -name 'wprep_memory_soak' -o -name 'wprep_loader_bench' -o -name 'wprep_fake_checkpoint' \) -not -path '*/CMakeFiles/*')
if [[ -n ${TARGETS:-} ]]; then
  mapfile -t bins < <(for b in "${bins[@]}"; do [[ " $TARGETS " == *" $(basename "$b") "* ]] && echo "$b"; done)
fi
for b in "${bins[@]}"; do
  cp "$b" .bundle/bin/
  strip --strip-unneeded ".bundle/bin/$(basename "$b")" 2>/dev/null || true
done
# glibc and the compiler runtime are newer on the GPU machine (Ubuntu 24.04): use its own.
skip='^(libc|libm|libdl|librt|libpthread|ld-linux-x86-64|libresolv|libstdc\+\+|libgcc_s)\.so'
for b in .bundle/bin/*; do
  ldd "$b" | awk '/=> \// {print $3}'
done | sort -u | while read -r lib; do
  name=$(basename "$lib")
  [[ $name =~ $skip ]] && continue
  cp -L "$lib" .bundle/lib/
done
du -sh .bundle .bundle/bin .bundle/lib
