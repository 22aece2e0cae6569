#!/usr/bin/env bash
# Profiles one conversion kernel with Nsight Compute on the GPU machine (clocks left as
# they are). Usage: bash scripts/profile.sh "hopper mx-2 mma3 swizzle" [shape]
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.bundle/lib
name=${1:?conversion name (substring)}; shape=${2:-16x4096x4096}
ncu --clock-control none --kernel-name regex:ConvertKernel --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
  --section Occupancy --section SchedulerStats --section LaunchStats \
  .bundle/bin/wprep_bench --cpu=false --shapes="$shape" --only="$name" --warmup=1 --iters=3
