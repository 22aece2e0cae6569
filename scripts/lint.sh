#!/usr/bin/env bash
# Static analysis of the project's C++ (CUDA files excluded: neither tool parses them):
# clang-tidy with the checks in .clang-tidy (bugs and waste, warnings are errors), over the
# compile commands of the build in $BUILD, then cppcheck. Exit status: 0 when both are clean.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
JOBS=${JOBS:-$(nproc)}
SOURCES=('server/src/.*\.cc$' 'server/main\.cc$' 'client/lib/src/.*\.cc$' 'client/cli/.*\.cc$'
         'spec/src/.*\.cc$' 'flags/src/.*\.cc$' 'proto/src/.*\.cc$' 'kernels/src/(plan|cpu_engine|cuda_engine_stub|moe_plan|moe_cpu|moe_cuda_stub)\.cc$')
echo "lint: clang-tidy"
run-clang-tidy -p "$BUILD" -j "$JOBS" -quiet "${SOURCES[@]}" > "$BUILD/clang-tidy.log" 2>&1 || {
  grep -E "error:|warning:" "$BUILD/clang-tidy.log" | sort -u
  echo "lint: clang-tidy found problems (full log: $BUILD/clang-tidy.log)"
  exit 1
}
echo "lint: cppcheck"
# cpu_engine.cc uses template lambdas ([&]<class T>()), which cppcheck 2.10 cannot parse.
cppcheck --enable=warning,performance,portability --std=c++20 --inline-suppr --quiet --error-exitcode=1 \
  --suppress=internalAstError:kernels/src/cpu_engine.cc \
  -I spec/include -I flags/include -I kernels/include -I server/include -I server/src -I client/lib/include \
  server/src server/main.cc client/lib/src client/cli spec/src flags/src proto/src \
  kernels/src/plan.cc kernels/src/cpu_engine.cc kernels/src/cuda_engine_stub.cc \
  kernels/src/moe_plan.cc kernels/src/moe_cpu.cc kernels/src/moe_cuda_stub.cc
echo "lint: clean"
