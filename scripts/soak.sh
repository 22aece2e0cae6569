#!/usr/bin/env bash
# The long load and soak test: wprep_memory_soak sends SOAK_REQUESTS (default 100,000)
# mixed requests from SOAK_CLIENTS (default 64) clients, each on its own connection, to a
# wprepd it starts, checks every output, and prints throughput, latency per kind of
# request and the daemon's memory idle, at peak and after (with the connections open and
# once closed). Exit 0 when every request had its expected outcome and memory returned.
#
#   scripts/soak.sh                      # CPU engine (the daemon runs --devices=cpu)
#   SOAK_DEVICES=gpu scripts/soak.sh     # the daemon's GPUs; adds IPC requests on GPU 0
#   scripts/soak.sh --threads=128        # more flags for wprep_memory_soak
#
# The figures of docs/RELIABILITY.md come from this script (and from the CI run of
# 10,000 requests, ctest load_cpu_10k).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
REQUESTS=${SOAK_REQUESTS:-100000}
CLIENTS=${SOAK_CLIENTS:-64}
DEVICES=${SOAK_DEVICES:-cpu}

bash scripts/bootstrap.sh
[[ -f "$BUILD/build.ninja" ]] || cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD" -j "${JOBS:-$(nproc)}" --target wprep_memory_soak wprepd

daemon_flags=()
if [[ "$DEVICES" == cpu ]]; then daemon_flags+=(--devices=cpu); fi
echo "soak: $(date -u +%Y-%m-%dT%H:%MZ), $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(nproc) cores," \
     "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
exec "$BUILD/bench/wprep_memory_soak" --requests="$REQUESTS" --clients="$CLIENTS" --threads="$CLIENTS" "$@" \
  -- "${daemon_flags[@]}"
