#!/usr/bin/env python3
"""Writes a small random Llama GGUF whose weight matrices use every ggml block type
kvlens decodes (q8_0, q4_0, q4_1, q5_0, q5_1, q2_K … q6_K, iq4_nl, iq4_xs), for the golden test of
quantised models (tests/engine/model/golden_test.cc): kvlens and the oracle read the same
bytes, each with its own decoder.

    /usr/bin/python3 tests/oracle/make_quantized_gguf.py --out /tmp/q.gguf

dim 256, 4 heads of 64 (2 KV heads), FFN 512, 2 layers, vocab 384 and no tokenizer; with
--tokenizer GGUF, that file's tokenizer and its vocabulary size (for tests that serve it).
--f32 writes every weight in F32 instead; --qwen2 makes it a Qwen2 (biases on q, k and v,
RoPE on half-split pairs); --rope-freqs adds Llama 3.1's rope scaling
(rope_freqs.weight), the factors convert_hf_to_gguf.py derives from rope_scaling
{factor 8, low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192}.
"""
import math
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from oracle_fixtures import llama_metadata, llama_projections, write_gguf  # noqa: E402

DIM, HEADS, KV_HEADS, FFN, LAYERS, VOCAB = 256, 4, 2, 512, 2, 384
# Per layer: q, k, v, output, gate, up, down.
LAYER_TYPES = [
    ["Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "Q4_0", "Q4_1"],
    ["Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "IQ4_XS", "Q5_K", "Q3_K"],
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--tokenizer", help="a GGUF whose tokenizer the model takes")
    ap.add_argument("--f32", action="store_true", help="every weight in F32")
    ap.add_argument("--rope-freqs", action="store_true", help="Llama 3.1's rope_freqs.weight")
    ap.add_argument("--qwen2", action="store_true",
                    help="a Qwen2 instead: architecture qwen2, biases on q, k and v")
    ap.add_argument("--no-add-bos", action="store_true",
                    help="tokenizer.ggml.add_bos_token = false (as Qwen2's files say)")
    ap.add_argument("--chat-template", metavar="JINJA",
                    help="tokenizer.chat_template: the model's Jinja chat template")
    ap.add_argument("--drop", action="append", default=[], metavar="TENSOR",
                    help="leave this tensor out (for tests of the loader's errors)")
    args = ap.parse_args()
    metadata, vocab = llama_metadata("kvlens-quantized-test", DIM, FFN, LAYERS, HEADS, KV_HEADS,
                                     256, tokenizer_from=args.tokenizer)
    vocab = vocab or VOCAB
    rng = np.random.default_rng(args.seed)
    kv = DIM // HEADS * KV_HEADS

    def mat(rows, cols):
        return rng.normal(0, 1 / np.sqrt(cols), (rows, cols))

    def norm():
        return 1 + rng.normal(0, 0.1, DIM)

    tensors = [("token_embd.weight", rng.normal(0, 1, (vocab, DIM)), "Q4_K")]
    for layer, kinds in enumerate(LAYER_TYPES):
        tensors.append((f"blk.{layer}.attn_norm.weight", norm(), "F32"))
        tensors.append((f"blk.{layer}.ffn_norm.weight", norm(), "F32"))
        for (name, shape), kind in zip(llama_projections(DIM, kv, FFN), kinds):
            tensors.append((f"blk.{layer}.{name}.weight", mat(*shape), kind))
    tensors.append(("output_norm.weight", norm(), "F32"))
    tensors.append(("output.weight", mat(vocab, DIM), "Q6_K"))
    if args.qwen2:
        metadata = {k.replace("llama.", "qwen2.", 1): v for k, v in metadata.items()}
        metadata["general.architecture"] = "qwen2"
        for layer in range(len(LAYER_TYPES)):
            for name, size in (("attn_q", DIM), ("attn_k", kv), ("attn_v", kv)):
                tensors.append((f"blk.{layer}.{name}.bias", rng.normal(0, 0.5, size), "F32"))
    if args.rope_freqs:
        tensors.append(("rope_freqs.weight", llama31_rope_factors(DIM // HEADS, 10000.0), "F32"))
    if args.f32:
        tensors = [(name, values, "F32") for name, values, _ in tensors]
    tensors = [t for t in tensors if t[0] not in args.drop]
    if args.no_add_bos:
        metadata["tokenizer.ggml.add_bos_token"] = False
    if args.chat_template is not None:
        metadata["tokenizer.chat_template"] = args.chat_template
    write_gguf(args.out, metadata, tensors)


def llama31_rope_factors(head_dim, base, factor=8.0, low=1.0, high=4.0, original=8192):
    """Per pair: 1 where the wavelength is under original/high, factor where it is over
    original/low, and between them 1 / ((1 - s)/factor + s), s = (original/wavelength - low)
    / (high - low)."""
    out = []
    for i in range(head_dim // 2):
        wavelength = 2 * math.pi * base ** (2 * i / head_dim)
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            s = (original / wavelength - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out)


if __name__ == "__main__":
    main()
