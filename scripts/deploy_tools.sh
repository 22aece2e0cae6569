#!/usr/bin/env bash
# Installs what `make test-deploy` needs beyond the build, idempotently:
#  - Debian packages: Prometheus and promtool, pytest, PyYAML, iproute2 (through
#    scripts/bootstrap.sh with WPREP_BOOTSTRAP_EXTRA=1);
#  - kubectl (Debian's kubernetes-client) and Node.js with npm, only when the machine has
#    none (both are on CI's machines already);
#  - the pinned npm packages of tests/deploy/tools/package-lock.json into .tools/
#    (git-ignored), reinstalled only when the lock file changes.
set -euo pipefail
cd "$(dirname "$0")/.."

WPREP_BOOTSTRAP_EXTRA=1 bash scripts/bootstrap.sh

SUDO=""
if [[ $(id -u) != 0 ]]; then SUDO="sudo"; fi
want=()
command -v kubectl >/dev/null || want+=(kubernetes-client)
command -v npm >/dev/null || want+=(nodejs npm)
if ((${#want[@]})); then
  echo "deploy_tools: installing ${want[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${want[@]}"
fi

lock=tests/deploy/tools/package-lock.json
stamp=.tools/.lock.sha256
sum=$(sha256sum "$lock" | cut -d' ' -f1)
if [[ -f $stamp && $(cat "$stamp") == "$sum" && -d .tools/node_modules ]]; then
  echo "deploy_tools: npm packages present"
  exit 0
fi
rm -rf .tools
mkdir -p .tools
cp tests/deploy/tools/package.json "$lock" .tools/
(cd .tools && npm ci --no-audit --no-fund --loglevel=error)
echo "$sum" >"$stamp"
echo "deploy_tools: npm packages installed in .tools/"
