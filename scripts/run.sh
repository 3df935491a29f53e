#!/usr/bin/env bash
# Builds kvlens and starts kvlens-server on the embedded default model (models/kjv-gpt2-4l),
# in the foreground: gRPC on :50051, Prometheus metrics on :9464/metrics. Extra arguments go
# to kvlens-server (see build/server/kvlens-server --help). Installs what it needs first
# (idempotent). Talk to it from another terminal:
#
#   build/clients/cli/kvlens-cli generate --server localhost:50051 --prompt "And God said"
#
#   build/clients/cli/kvlens-cli sae --server localhost:50051 --text "And God said"
#
# The default model is served with its SAE (models/kjv-gpt2-4l-sae, Interpret.SaeFeatures).
#   KVLENS_MODEL=path scripts/run.sh   another model (GGUF, llama2.c .bin, or HF directory),
#                                      without an SAE unless --sae is passed
set -euo pipefail
cd "$(dirname "$0")/.."
export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1

scripts/install-deps.sh >/dev/null
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target kvlens-server kvlens-cli >/dev/null

MODEL=${KVLENS_MODEL:-models/kjv-gpt2-4l}
SAE=()
[ -z "${KVLENS_MODEL:-}" ] && SAE=(--sae models/kjv-gpt2-4l-sae)
echo "kvlens: serving $MODEL (gRPC :50051 and metrics :9464 unless overridden); try:" >&2
echo "  build/clients/cli/kvlens-cli generate --server localhost:50051 --prompt \"And God said\"" >&2
exec build/server/kvlens-server --model "$MODEL" "${SAE[@]}" --port 50051 --metrics-port 9464 "$@"
