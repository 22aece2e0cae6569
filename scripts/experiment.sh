set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.bundle/lib
for v in 3 4 2; do echo "== min blocks $v"; WPREP_EXPERIMENT_MIN_BLOCKS=$v .bundle/bin/wprep_bench --cpu=false --iters=200 | grep cuda; done
WPREP_GOLDEN_DIR=$PWD/tests/data/golden .bundle/bin/kernels_cuda_test 2>&1 | tail -3
