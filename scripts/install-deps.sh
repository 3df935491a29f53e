#!/usr/bin/env bash
# Installs every Debian package kvlens needs to build, test, serve and train its default
# model. Idempotent: packages already present are left alone, and apt-get update runs only
# when something is missing. Run as root (or with sudo available).
set -euo pipefail

PACKAGES=(
  # toolchain
  build-essential cmake ninja-build ccache pkg-config git clang-format
  # C++ libraries
  libabsl-dev libgrpc++-dev libgrpc-dev protobuf-compiler protobuf-compiler-grpc
  libprotobuf-dev prometheus-cpp-dev libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev
  # Prometheus server and promtool: tests/load checks the Grafana dashboard's queries and
  # the alert rules (docker/prometheus) against them
  prometheus
  # Python: the PyTorch oracle, training the default model, the Python client
  python3 python3-torch python3-numpy python3-grpcio python3-protobuf python3-matplotlib
  # an optimised BLAS for python3-torch (Debian's torch otherwise uses the reference BLAS,
  # ~7x slower training on CPU); it becomes the libblas.so.3 alternative
  libopenblas0-openmp
  # public-domain English text the default model is trained on
  # (bible-kjv-text holds the data, bible-kjv the `bible` program that prints it)
  bible-kjv-text bible-kjv
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
