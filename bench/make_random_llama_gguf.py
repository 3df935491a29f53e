#!/usr/bin/env python3
"""Writes a random-weight Llama GGUF for decode benchmarks of quantised files, with the
stories260K tokenizer (../shared/testdata) so llama.cpp and kvlens both load it.

    /usr/bin/python3 bench/make_random_llama_gguf.py --out /tmp/m.gguf --recipe q4_k_m

Recipes: q4_k_m (llama.cpp's Q4_K_M mix: q4_K, with q6_K for the output, and for attn_v
and ffn_down on every other layer), q8_0, f16. Shape flags default to a 0.4B-parameter
model: dim 2048, FFN 5632, 8 layers, 32 heads of 64, 8 KV heads. --qwen3 writes a Qwen3
instead (RMSNorm weights over each head of q and k; --head-dim sets the head size, which
Qwen3 decouples from dim / heads): Qwen3-0.6B's layers are --dim 1024 --ffn 3072 --layers
28 --heads 16 --kv-heads 8 --head-dim 128.
"""
import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "oracle"))

from oracle_fixtures import llama_metadata, llama_projections, shared_testdata, write_gguf  # noqa: E402,E501


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--recipe", default="q4_k_m", choices=["q4_k_m", "q8_0", "f16"])
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, help="default: dim / heads")
    ap.add_argument("--qwen3", action="store_true", help="architecture qwen3 (q/k head norms)")
    args = ap.parse_args()
    data = shared_testdata()
    if data is None:
        sys.exit("needs ../shared/testdata (the stories260K tokenizer)")
    md, vocab = llama_metadata(f"random-llama-{args.recipe}", args.dim, args.ffn, args.layers,
                               args.heads, args.kv_heads, 2048,
                               tokenizer_from=os.path.join(data, "stories260K", "stories260K.gguf"))
    rng = np.random.default_rng(5)
    head_dim = args.head_dim or args.dim // args.heads
    dim, kv, q_dim = args.dim, head_dim * args.kv_heads, head_dim * args.heads
    if args.qwen3:
        md = {k.replace("llama.", "qwen3.", 1): v for k, v in md.items()}
        md["general.architecture"] = "qwen3"
        md["general.name"] = f"random-qwen3-{args.recipe}"
    arch = md["general.architecture"]
    md[f"{arch}.attention.key_length"] = np.uint32(head_dim)
    md[f"{arch}.attention.value_length"] = np.uint32(head_dim)
    md[f"{arch}.rope.dimension_count"] = np.uint32(head_dim)

    def kind(name, layer):
        if args.recipe != "q4_k_m":
            return args.recipe.upper()
        if name == "output":
            return "Q6_K"
        if name in ("attn_v", "ffn_down") and layer % 2 == 0:
            return "Q6_K"
        return "Q4_K"

    def mat(rows, cols):
        return rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)

    tensors = [("token_embd.weight", mat(vocab, dim), kind("token_embd", -1))]
    for l in range(args.layers):
        tensors.append((f"blk.{l}.attn_norm.weight", np.ones(dim), "F32"))
        tensors.append((f"blk.{l}.ffn_norm.weight", np.ones(dim), "F32"))
        for name, shape in llama_projections(dim, kv, args.ffn, q_dim):
            tensors.append((f"blk.{l}.{name}.weight", mat(*shape), kind(name, l)))
        if args.qwen3:
            for name in ("attn_q_norm", "attn_k_norm"):
                tensors.append((f"blk.{l}.{name}.weight", np.ones(head_dim), "F32"))
    tensors.append(("output_norm.weight", np.ones(dim), "F32"))
    tensors.append(("output.weight", mat(vocab, dim), kind("output", -1)))
    write_gguf(args.out, md, tensors)


if __name__ == "__main__":
    main()
