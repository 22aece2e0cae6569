#!/usr/bin/env bash
# `wprep convert-safetensors` next to raw ConvertStream of the same bytes, against one
# wprepd this script starts: makes a gpt-oss-shaped checkpoint (~1 GiB by default), times
# the conversion of the whole file (mmap in, every MXFP4 tensor through the daemon, every
# other tensor copied, a new file out), then `wprep bench --safetensors` on the same file
# (every MXFP4 tensor read into memory first, one ConvertStream each, outputs discarded),
# both JOBS requests at a time, and prints both rates over the MXFP4 bytes and their ratio.
# The checkpoint stays in the page cache between the runs (the machine needs ~3x its size
# in free memory); RUNS runs of each, the median reported.
#
#   bash scripts/safetensors_bench.sh                    # CPU engine (--devices=cpu)
#   DAEMON_ARGS= bash scripts/safetensors_bench.sh       # the daemon's GPUs
#   BIN=.bundle/bin bash scripts/safetensors_bench.sh    # binaries of scripts/gpu_bundle.sh
#
# Knobs: LAYERS (3), EXPERTS (28), HIDDEN (2880), INTERMEDIATE (2880) size the checkpoint
# (gpt-oss-20b's experts are 32 x 2880 x 2880); LAYOUT (hopper_value), JOBS (4), RUNS (3),
# WORK (/tmp/wprep-safetensors-bench), DAEMON_ARGS (--devices=cpu).
set -euo pipefail
cd "$(dirname "$0")/.."

LAYERS=${LAYERS:-3} EXPERTS=${EXPERTS:-28} HIDDEN=${HIDDEN:-2880} INTERMEDIATE=${INTERMEDIATE:-2880}
LAYOUT=${LAYOUT:-hopper_value} JOBS=${JOBS:-4} RUNS=${RUNS:-3}
WORK=${WORK:-/tmp/wprep-safetensors-bench}
DAEMON_ARGS=${DAEMON_ARGS---devices=cpu}
if [[ -n ${BIN:-} ]]; then
  WPREPD=$BIN/wprepd WPREP=$BIN/wprep MAKE_CKPT=$BIN/wprep_fake_checkpoint
  [[ -d .bundle/lib ]] && export LD_LIBRARY_PATH=$PWD/.bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
else
  B=${BUILD:-build}
  cmake --build "$B" --target wprepd wprep wprep_fake_checkpoint >/dev/null
  WPREPD=$B/server/wprepd WPREP=$B/client/cli/wprep MAKE_CKPT=$B/tests/client/wprep_fake_checkpoint
fi

mkdir -p "$WORK"
CKPT=$WORK/model-${LAYERS}x${EXPERTS}x${HIDDEN}x${INTERMEDIATE}.safetensors
[[ -f $CKPT ]] || "$MAKE_CKPT" "$CKPT" --layers="$LAYERS" --experts="$EXPERTS" --hidden="$HIDDEN" \
  --intermediate="$INTERMEDIATE"
cat "$CKPT" >/dev/null  # into the page cache

SOCK=$WORK/wprepd.sock
# shellcheck disable=SC2086
"$WPREPD" --listen="unix://$SOCK" --metrics-address= $DAEMON_ARGS 2>"$WORK/wprepd.log" &
DAEMON=$!
trap 'kill $DAEMON 2>/dev/null; wait $DAEMON 2>/dev/null; rm -f "$WORK"/out.safetensors*' EXIT
for _ in $(seq 1 600); do "$WPREP" health --target "unix://$SOCK" >/dev/null 2>&1 && break; sleep 0.5; done
"$WPREP" devices --target "unix://$SOCK"

median() { sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }

raw=() cs=()
for run in $(seq 1 "$RUNS"); do
  row=$("$WPREP" bench --target "unix://$SOCK" --safetensors "$CKPT" --modes stream --layouts "$LAYOUT" \
        --concurrency "$JOBS" | awk '$1 == "stream"')
  mx_bytes=$(awk '{split($3, a, "/"); sub("B", "", a[2]); print a[2]}' <<<"$row")
  raw+=("$(awk '{print $9}' <<<"$row")")
  t0=$(date +%s.%N)
  "$WPREP" convert-safetensors "$CKPT" "$WORK/out.safetensors" --layout "$LAYOUT" --jobs "$JOBS" \
    --target "unix://$SOCK" --progress none >"$WORK/summary.txt"
  t1=$(date +%s.%N)
  cs+=("$(awk -v b="$mx_bytes" -v t0="$t0" -v t1="$t1" 'BEGIN {printf "%.3f", b / (t1 - t0) / 1e9}')")
  echo "run $run: raw ConvertStream ${raw[-1]} GB/s, convert-safetensors ${cs[-1]} GB/s ($(cat "$WORK/summary.txt"))"
  rm -f "$WORK/out.safetensors"
done
RAW=$(printf '%s\n' "${raw[@]}" | median)
CS=$(printf '%s\n' "${cs[@]}" | median)
echo "checkpoint $CKPT: $(stat -c %s "$CKPT") bytes, $mx_bytes of them MXFP4; layout $LAYOUT; $JOBS at a time"
echo "raw ConvertStream (wprep bench --safetensors):  $RAW GB/s"
echo "convert-safetensors (whole file, mmap in/out): $CS GB/s over the same MXFP4 bytes"
awk -v a="$CS" -v b="$RAW" 'BEGIN {printf "ratio convert-safetensors / raw: %.2f\n", a / b}'
