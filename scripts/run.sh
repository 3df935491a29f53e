#!/usr/bin/env bash
# Builds kvlens and runs it on a model: today the offline CLI (kvlens-cli generate);
# extra arguments are passed to it. Installs what it needs first (idempotent).
#
#   scripts/run.sh                                   default model, default prompt
#   scripts/run.sh --prompt "And God said" --max-new-tokens 40 --temperature 0.8
#   KVLENS_MODEL=path/to/model.gguf scripts/run.sh   another model (GGUF or llama2.c .bin)
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh >/dev/null
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target kvlens-cli >/dev/null

MODEL=${KVLENS_MODEL:-../shared/testdata/stories260K/stories260K.gguf}
DEFAULT_PROMPT="Once upon a time"
has_prompt=0
for a in "$@"; do case "$a" in --prompt|--prompt=*) has_prompt=1 ;; esac; done
if [ "$has_prompt" = 1 ]; then
  exec build/clients/cli/kvlens-cli generate --model "$MODEL" --stats "$@"
fi
exec build/clients/cli/kvlens-cli generate --model "$MODEL" --prompt "$DEFAULT_PROMPT" \
  --max-new-tokens 100 --stats "$@"
