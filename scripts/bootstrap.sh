#!/usr/bin/env bash
# Installs every Debian package wprep needs to build, test and run. Idempotent:
# when everything is already installed it touches nothing (no apt-get update).
set -euo pipefail

PACKAGES=(
  build-essential clang cmake ninja-build pkg-config git
  libabsl-dev libssl-dev openssl nlohmann-json3-dev
  libgtest-dev libgmock-dev
  libprotobuf-dev protobuf-compiler libgrpc++-dev protobuf-compiler-grpc
  prometheus-cpp-dev
  # the Python client's tests (make test-python); pip, setuptools and wheel for its offline install
  python3-grpcio python3-protobuf python3-numpy python3-pytest python3-pip python3-setuptools python3-wheel
)
# Extra packages for the operational tests (real Prometheus and promtool, h2load, and
# what `make test-deploy` runs on: pytest, PyYAML, ip/unshare) are asked for with
# WPREP_BOOTSTRAP_EXTRA=1 so a plain build stays small.
if [[ "${WPREP_BOOTSTRAP_EXTRA:-0}" == 1 ]]; then
  PACKAGES+=(prometheus nghttp2-client python3-pytest python3-yaml iproute2 util-linux)
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "bootstrap: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [[ $(id -u) != 0 ]]; then SUDO="sudo"; fi
echo "bootstrap: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
