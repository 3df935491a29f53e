#!/usr/bin/env bash
# Fetches llama.cpp's tokenizer conformance vectors that ../shared/testdata does not hold:
# the vocabularies of the Llama 3 ("llama-bpe") and Qwen2 ("qwen2") pre-tokenizers, with
# their test strings and reference ids (llama.cpp's models/ggml-vocab-*.gguf{,.inp,.out},
# MIT). They come from the npm registry: node-llama-cpp's package carries llama.cpp's
# source as a git bundle. Every file is checked against its pinned sha256.
#
#   scripts/fetch-test-vocabs.sh [DEST]   (default: $KVLENS_VOCAB_DIR, or
#                                          ~/.cache/kvlens/llama-vocab)
#
# Idempotent: nothing is downloaded when the files are there with the right sums. Exits 1
# when they cannot be fetched (the tests that need them then skip, naming this script).
set -euo pipefail
DEST=${1:-${KVLENS_VOCAB_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvlens/llama-vocab}}
TARBALL_URL=https://registry.npmjs.org/node-llama-cpp/-/node-llama-cpp-3.22.1.tgz
TARBALL_SHA256=a0d9dd80eacd2ab1cfe71aee57ac8a806487fd70b3d2a38fbec637752d9e5c5f
SUMS="97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e  ggml-vocab-llama-bpe.gguf
be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0  ggml-vocab-llama-bpe.gguf.inp
118abf2034a197fc5c9dec5204dfdeee7004c7c70952ae577f66b99e212fab9b  ggml-vocab-llama-bpe.gguf.out
44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c  ggml-vocab-qwen2.gguf
be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0  ggml-vocab-qwen2.gguf.inp
de785bb305cc6fa9d43908ed5da337f853c0b79e971348fcfb9f0915a39c5363  ggml-vocab-qwen2.gguf.out"

mkdir -p "$DEST"
check() { (cd "$DEST" && printf '%s\n' "$SUMS" | sha256sum --check --quiet --status 2>/dev/null); }
if check; then
  echo "fetch-test-vocabs: present in $DEST"
  exit 0
fi
command -v curl >/dev/null && command -v git >/dev/null || {
  echo "fetch-test-vocabs: needs curl and git" >&2
  exit 1
}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch-test-vocabs: downloading $TARBALL_URL"
curl -sSfL --retry 3 -o "$tmp/pkg.tgz" "$TARBALL_URL"
echo "$TARBALL_SHA256  $tmp/pkg.tgz" | sha256sum --check --quiet
tar -xzf "$tmp/pkg.tgz" -C "$tmp" package/llama/gitRelease.bundle
git clone -q --bare "$tmp/package/llama/gitRelease.bundle" "$tmp/llama.git"
printf '%s\n' "$SUMS" | while read -r _ name; do
  git -C "$tmp/llama.git" show "HEAD:models/$name" > "$DEST/$name"
done
check || {
  echo "fetch-test-vocabs: checksum mismatch in $DEST" >&2
  exit 1
}
echo "fetch-test-vocabs: wrote $(printf '%s\n' "$SUMS" | wc -l) files to $DEST"
