export LD_LIBRARY_PATH=$PWD/.bundle/lib
export WPREPD=$PWD/.bundle/bin/wprepd
for i in 1 2 3; do
  timeout 200 .bundle/bin/wprep_rpc_bench --iters=200 --stream-runs=1 > $OUT/rpc$i.txt 2>&1
  echo "run $i rc=$?"
done
