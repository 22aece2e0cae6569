#!/usr/bin/env bash
# Runs the deploy checks (pytest, tests/deploy) in private network and mount namespaces,
# as root: a veth carries the pod IP (non-loopback, as in a pod), a private /run holds the
# socket folder, and the staged image files (scripts/stage_runtime.sh) are mounted
# read-only at /opt/wprep, their path in the image. Fixed ports (8081, 9464, 9090) then
# collide with nothing else on the machine. Arguments go to pytest.
#   STAGE=.stage bash tests/deploy/run.sh [-k NAME] [tests/deploy/test_x.py]
set -euo pipefail
cd "$(dirname "$0")/../.."
STAGE=$(realpath "${STAGE:-.stage}")
POD_IP=10.244.0.5

if [[ ${WPREP_DEPLOY_SANDBOX:-0} != 1 ]]; then
  [[ -x $STAGE/opt/wprep/bin/wprepd ]] || { echo "run.sh: no staged files in $STAGE (make test-deploy)" >&2; exit 2; }
  if [[ $(id -u) != 0 ]]; then  # namespaces and setpriv need root, as scripts/bootstrap.sh does
    command -v sudo >/dev/null || { echo "run.sh: the deploy checks need root (namespaces, setpriv)" >&2; exit 2; }
    exec sudo STAGE="$STAGE" bash "$0" "$@"
  fi
  exec unshare --net --mount --fork --propagation private \
    env WPREP_DEPLOY_SANDBOX=1 STAGE="$STAGE" bash "$0" "$@"
fi

ip link set lo up
ip link add eth0 type veth peer name eth0-peer
ip addr add "$POD_IP/24" dev eth0
ip link set eth0 up
ip link set eth0-peer up
mount -t tmpfs -o mode=0755 tmpfs /run
mount -t tmpfs -o mode=0755 tmpfs /opt
mkdir /opt/wprep
mount --bind "$STAGE/opt/wprep" /opt/wprep
mount -o remount,bind,ro /opt/wprep
export WPREP_POD_IP=$POD_IP
# Test paths among the arguments replace the default, tests/deploy.
paths=(tests/deploy)
for a in "$@"; do [[ $a == tests/* ]] && paths=(); done
exec /usr/bin/python3 -m pytest -p no:cacheprovider -q -rfEsxX "${paths[@]}" "$@"
