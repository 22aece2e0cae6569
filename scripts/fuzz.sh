#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan + UBSan, no CUDA) in build-fuzz/ and fuzzes
# each for SECONDS (default 600): wprep_fuzz_request (the request edge and the planner,
# small plans run on the CPU engine), wprep_fuzz_stream (the stream framing) and
# wprep_fuzz_batch (ConvertBatch, small batches run on a fake GPU) and
# wprep_fuzz_safetensors (the safetensors header parser of the CLI). Each
# first replays its committed seeds (tests/fuzz/corpus/) and past crashes
# (tests/fuzz/regressions/), then mutates from them and from what earlier runs learned
# (build-fuzz/fuzz-corpus/, not committed). The three targets over wprep.v1 messages
# mutate them field by field too (tests/fuzz/proto_mutator.h: extreme dims, unset fields,
# unknown enums), and UBSan's division by zero, float division by zero, signed overflow
# and shift checks are errors. Exit 1 on any crash or sanitizer report; the input that
# caused it is in build-fuzz/fuzz-artifacts/.
#
#   scripts/fuzz.sh            # 10 minutes per target
#   scripts/fuzz.sh 3600       # an hour per target (CI runs 20 s: make test-fuzz)
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET=${1:-600}
BUILD=${FUZZ_BUILD:-build-fuzz}
JOBS=${JOBS:-$(nproc)}

bash scripts/bootstrap.sh
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
  -DCMAKE_CXX_COMPILER=clang++ -DWPREP_FUZZ=ON -DWPREP_ENABLE_CUDA=OFF ${CMAKE_FLAGS:-} > /dev/null
cmake --build "$BUILD" -j "$JOBS" --target wprep_fuzz_request wprep_fuzz_stream wprep_fuzz_batch wprep_fuzz_safetensors

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
status=0
for target in request stream batch safetensors; do
  bin="$BUILD/tests/fuzz/wprep_fuzz_$target"
  dirs=("tests/fuzz/corpus/$target")
  if [[ -d "tests/fuzz/regressions/$target" ]]; then dirs+=("tests/fuzz/regressions/$target"); fi
  work="$BUILD/fuzz-corpus/$target"
  artifacts="$BUILD/fuzz-artifacts/$target"
  mkdir -p "$work" "$artifacts"
  echo "== $target: replaying ${dirs[*]}"
  if ! "$bin" -runs=0 "${dirs[@]}" 2>&1 | tail -3; then status=1; continue; fi
  echo "== $target: fuzzing for ${SECONDS_PER_TARGET} s"
  if ! "$bin" -max_total_time="$SECONDS_PER_TARGET" -timeout=20 -rss_limit_mb=2560 -max_len=65536 \
       -print_final_stats=1 -artifact_prefix="$artifacts/" "$work" "${dirs[@]}" > "$BUILD/fuzz-$target.log" 2>&1; then
    status=1
    tail -60 "$BUILD/fuzz-$target.log"
    echo "== $target: FAILED; reproduce with $bin $artifacts/<crash file>;" \
         "add the input to tests/fuzz/regressions/$target/ with its fix"
  else
    grep -E "^(#[0-9]+.*DONE|stat::number_of_executed_units|stat::peak_rss_mb)" "$BUILD/fuzz-$target.log" || true
    echo "== $target: no crash, corpus $(ls "$work" | wc -l) inputs"
  fi
done
exit $status
