#!/usr/bin/env bash
# Fails when any C++/CUDA source differs from clang-format's output (.clang-format): the
# tracked ones and the new ones git does not ignore (so a file is formatted before its
# first commit). scripts/check-format.sh --fix rewrites the files instead.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files --cached --others --exclude-standard '*.h' '*.cc' '*.cu' '*.cuh' |
  grep -v '^engine/tokenizer/unicode_tables.cc$')
[ ${#files[@]} -gt 0 ] || exit 0
if [ "${1:-}" = "--fix" ]; then
  clang-format -i "${files[@]}"
  exit 0
fi
clang-format --dry-run --Werror "${files[@]}"
echo "format check: ${#files[@]} files clean"
