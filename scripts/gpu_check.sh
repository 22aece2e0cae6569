#!/usr/bin/env bash
# Runs on the GPU machine from the repo root, with .bundle/ carried (make gpu-bundle):
# every test binary (GPU tests included), compute-sanitizer on the CUDA engine tests, and
# the benchmark. Full logs go to $OUT; a short table is printed last.
# Env: WPREP_TESTS (glob of test binaries, default *_test; "none" runs none),
# WPREP_SANITIZER, WPREP_BENCH, WPREP_RPC_BENCH, WPREP_LOADER_BENCH, WPREP_SOAK (0 skips),
# WPREP_PYTHON (the Python GPU tests), WPREP_PYTHON_BENCH, WPREP_SAFETENSORS_BENCH,
# WPREP_BENCH_ARGS, WPREP_LOADER_ARGS. With .bundle-base/ carried too (a bundle of another
# commit), its rpc bench runs right after this one's, for a comparison in one run.
set -uo pipefail
OUT=${OUT:-/tmp/wprep-gpu-check}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.bundle/lib
export WPREP_GOLDEN_DIR=$PWD/tests/data/golden
export WPREP_TEST_DATA_DIR=$PWD/tests/data
export WPREP_CLI=$PWD/.bundle/bin/wprep
export WPREPD=$PWD/.bundle/bin/wprepd
export WPREP_IPC_CLIENT_PATH=$PWD/.bundle/bin/wprep_ipc_client
export WPREP_FAULT_CLIENT_PATH=$PWD/.bundle/bin/wprep_fault_client
export WPREP_VMM_CLIENT_PATH=$PWD/.bundle/bin/wprep_vmm_client
summary=()

{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

: > "$OUT/tests.log"
for t in .bundle/bin/${WPREP_TESTS:-*_test}; do
  [[ -x $t ]] || continue
  name=$(basename "$t")
  echo "=== $name" >> "$OUT/tests.log"
  timeout 300 "$t" --gtest_brief=0 >> "$OUT/tests.log" 2>&1
  rc=$?
  passed=$(grep -c '^\[       OK \]' <(sed -n "/=== $name\$/,/^=== /p" "$OUT/tests.log"))
  skipped=$(grep -cE '^\[  SKIPPED \] [A-Za-z].* \([0-9]+ ms\)$' <(sed -n "/=== $name\$/,/^=== /p" "$OUT/tests.log"))
  failed=$(grep -c '^\[  FAILED  \] [A-Za-z].*(' <(sed -n "/=== $name\$/,/^=== /p" "$OUT/tests.log"))
  summary+=("$(printf '%-28s rc=%-3s ok=%-4s skipped=%-3s failed=%s' "$name" "$rc" "$passed" "$skipped" "$failed")")
done

if command -v compute-sanitizer >/dev/null && [[ ${WPREP_SANITIZER:-1} == 1 ]]; then
  timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 .bundle/bin/kernels_cuda_test \
    --gtest_filter='*Strided*:*Empty*:*Rejects*:*Golden*:*LoaderTransposed*' > "$OUT/memcheck.log" 2>&1
  summary+=("compute-sanitizer memcheck rc=$? ($(grep -c 'ERROR SUMMARY: 0 errors' "$OUT/memcheck.log") clean summaries)")
  # Shared-memory races between the two stages of a tile.
  timeout 300 compute-sanitizer --tool racecheck --error-exitcode 9 .bundle/bin/kernels_cuda_test \
    --gtest_filter='*Golden*' >> "$OUT/memcheck.log" 2>&1
  summary+=("compute-sanitizer racecheck rc=$?")
fi

if [[ ${WPREP_BENCH:-1} == 1 ]]; then
  .bundle/bin/wprep_bench --csv "$OUT/bench.csv" ${WPREP_BENCH_ARGS:-} > "$OUT/bench.txt" 2>&1
  summary+=("bench rc=$?")
fi

if [[ ${WPREP_RPC_BENCH:-1} == 1 && -x .bundle/bin/wprep_rpc_bench ]]; then
  timeout 300 .bundle/bin/wprep_rpc_bench --iters=200 --stream-runs=9 --fresh-runs=5 > "$OUT/rpc_bench.txt" 2>&1
  summary+=("rpc bench rc=$?")
fi

if [[ ${WPREP_RPC_BENCH:-1} == 1 && -x .bundle-base/bin/wprep_rpc_bench ]]; then
  LD_LIBRARY_PATH=$PWD/.bundle-base/lib WPREPD=$PWD/.bundle-base/bin/wprepd timeout 300 \
    .bundle-base/bin/wprep_rpc_bench --iters=200 --stream-runs=9 --fresh-runs=5 > "$OUT/rpc_bench_base.txt" 2>&1
  summary+=("rpc bench (base bundle) rc=$?")
fi

if [[ ${WPREP_LOADER_BENCH:-1} == 1 && -x .bundle/bin/wprep_loader_bench ]]; then
  timeout 400 .bundle/bin/wprep_loader_bench ${WPREP_LOADER_ARGS:-} > "$OUT/loader_bench.txt" 2>&1
  summary+=("loader bench rc=$?")
fi

if [[ ${WPREP_SOAK:-1} == 1 && -x .bundle/bin/wprep_memory_soak ]]; then
  timeout 300 .bundle/bin/wprep_memory_soak > "$OUT/memory_soak.txt" 2>&1
  summary+=("memory soak rc=$?")
fi

echo
grep -E '^\[  FAILED  \]|Failure' "$OUT/tests.log" | head -20
# The summary lines (per-run lines and daemon logs stay in the file).
[[ -f $OUT/rpc_bench.txt ]] && grep -vE '^(fresh_)?daemon_log|_run[0-9]+[ _]' "$OUT/rpc_bench.txt"
[[ -f $OUT/rpc_bench_base.txt ]] && { echo "--- base bundle:"; grep -vE '^(fresh_)?daemon_log|_run[0-9]+[ _]' "$OUT/rpc_bench_base.txt"; }
[[ -f $OUT/loader_bench.txt ]] && tail -8 "$OUT/loader_bench.txt"
[[ -f $OUT/memory_soak.txt ]] && tail -12 "$OUT/memory_soak.txt"
[[ -f $OUT/bench.txt ]] && grep -E '^\||^GPU|^CPU' "$OUT/bench.txt"
printf '%s\n' "${summary[@]}"

# The Python client (client/python): its GPU tests and the gpt-oss-20b drop-in bench, with the
# machine's torch. WPREP_PYTHON=0 skips them; the default is on when torch imports. Without
# pytest the test file runs as a script (same tests, same skips).
if [[ ${WPREP_PYTHON:-$(python3 -c 'import torch' >/dev/null 2>&1 && echo 1 || echo 0)} == 1 ]]; then
  export PYTHONPATH=$PWD/client/python${PYTHONPATH:+:$PYTHONPATH}
  if python3 -c 'import pytest' >/dev/null 2>&1; then
    timeout 900 python3 -m pytest -v -rs -p no:cacheprovider client/python/tests -k gpu > "$OUT/python_gpu_tests.log" 2>&1
  else
    timeout 900 python3 client/python/tests/test_gpu.py > "$OUT/python_gpu_tests.log" 2>&1
  fi
  py_rc=$?
  echo
  grep -E '^(FAILED|SKIPPED|ERROR)|passed|failed' "$OUT/python_gpu_tests.log" | tail -20
  echo "python gpu tests rc=$py_rc"
fi
if [[ ${WPREP_PYTHON_BENCH:-${WPREP_PYTHON:-$(python3 -c 'import torch' >/dev/null 2>&1 && echo 1 || echo 0)}} == 1 ]]; then
  export PYTHONPATH=$PWD/client/python${PYTHONPATH:+:$PYTHONPATH}
  timeout 900 python3 client/python/bench/swizzle_bench.py --json "$OUT/python_bench.json" --profile "$OUT/python_profile.txt" > "$OUT/python_bench.txt" 2>&1
  bench_rc=$?
  tail -9 "$OUT/python_bench.txt"
  echo "python bench rc=$bench_rc"
fi

# convert-safetensors on a ~1 GiB gpt-oss-shaped checkpoint next to raw ConvertStream of the
# same bytes, on this machine's GPUs (WPREP_SAFETENSORS_BENCH=0 skips it).
if [[ ${WPREP_SAFETENSORS_BENCH:-1} == 1 && -x .bundle/bin/wprep_fake_checkpoint ]]; then
  BIN=.bundle/bin DAEMON_ARGS= WORK=${WPREP_SAFETENSORS_WORK:-/tmp/wprep-safetensors-bench} \
    timeout 400 bash scripts/safetensors_bench.sh > "$OUT/safetensors_bench.txt" 2>&1
  st_rc=$?
  tail -6 "$OUT/safetensors_bench.txt"
  echo "safetensors bench rc=$st_rc"
fi
