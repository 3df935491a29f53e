#!/usr/bin/env python3
"""Writes a small random Llama GGUF whose weight matrices use every ggml block type
kvlens decodes (q8_0, q4_0, q4_1, q5_0, q5_1, q2_K … q6_K, iq4_nl, iq4_xs), for the golden test of
quantised models (tests/engine/model/golden_test.cc): kvlens and the oracle read the same
bytes, each with its own decoder.

    /usr/bin/python3 tests/oracle/make_quantized_gguf.py --out /tmp/q.gguf

dim 256, 4 heads of 64 (2 KV heads), FFN 512, 2 layers, vocab 384 and no tokenizer; with
--tokenizer GGUF, that file's tokenizer and its vocabulary size (for tests that serve it).
--f32 writes every weight in F32 instead; --qwen2 makes it a Qwen2 (biases on q, k and v,
RoPE on half-split pairs); --qwen3 a Qwen3 (no biases, an RMSNorm over each head of q and k,
half-split RoPE, and heads of 128, so that the 4 query heads are 512 wide, twice dim); --phi3
a Phi-3 (q, k and v fused in attn_qkv, gate and up in ffn_up, half-split RoPE; its sliding
window by --set phi3.attention.sliding_window=N); --gemma a Gemma (GELU-gated feed-forward,
embeddings times sqrt(dim), half-split RoPE, heads of 256, tied embeddings; its norms hold
1 + weight as llama.cpp's converter writes them, its Hugging Face directory the weight
alone); --gemma2 a Gemma 2 (as --gemma, with norms on each block's outputs, every other
layer windowed by attention.sliding_window, and scores and logits soft-capped: set
gemma2.attn_logit_softcapping and final_logit_softcapping with --set-float); --rope-freqs adds Llama 3.1's rope scaling
(rope_freqs.weight), the factors convert_hf_to_gguf.py derives from rope_scaling
{factor 8, low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192}.
--hf DIR also writes the same values (as the GGUF decodes them) as a Hugging Face directory
(config.json + model.safetensors in F32): a Qwen2 or Qwen3, whose q and k rows GGUF keeps in
Hugging Face's order, or a Llama (--hf-type llama or mistral), whose rows it turns back from
GGUF's adjacent pairs to Hugging Face's halves; --hf-config JSON merges fields into its
config.json. --set KEY=N overrides an integer metadata field (for tests of the loader's
errors); --set-str KEY=TEXT a string one, --set-float KEY=X a float32 one.
"""
import argparse
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from oracle_fixtures import llama_metadata, llama_projections, to_half_split, write_gguf  # noqa: E402,E501

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
    ap.add_argument("--qwen3", action="store_true",
                    help="a Qwen3 instead: architecture qwen3, q/k head norms, head size 128")
    ap.add_argument("--phi3", action="store_true",
                    help="a Phi-3 instead: architecture phi3, q/k/v fused in attn_qkv and "
                         "gate/up in ffn_up (each in the type of its first part)")
    ap.add_argument("--gemma", action="store_true",
                    help="a Gemma instead: architecture gemma, GeGLU, heads of 256, tied")
    ap.add_argument("--gemma2", action="store_true",
                    help="a Gemma 2 instead: as --gemma, with norms on each block's outputs, "
                         "every other layer windowed, soft-capped scores and logits")
    ap.add_argument("--gemma3", action="store_true",
                    help="a Gemma 3 instead: as --gemma, with q/k head norms and norms on each "
                         "block's outputs (its GGUF, architecture gemma3, kvlens refuses)")
    ap.add_argument("--layers", type=int, default=LAYERS,
                    help="number of layers (their weight types cycle through LAYER_TYPES')")
    ap.add_argument("--rope-scaling-linear", type=float, metavar="FACTOR",
                    help="RoPE positions divided by FACTOR: rope.scaling.type linear (Hugging "
                         "Face: rope_scaling {rope_type linear, factor})")
    ap.add_argument("--long-rope", action="store_true",
                    help="Phi-3's LongRoPE factors (rope_factors_long/short.weight)")
    ap.add_argument("--no-add-bos", action="store_true",
                    help="tokenizer.ggml.add_bos_token = false (as Qwen2's files say)")
    ap.add_argument("--chat-template", metavar="JINJA",
                    help="tokenizer.chat_template: the model's Jinja chat template")
    ap.add_argument("--drop", action="append", default=[], metavar="TENSOR",
                    help="leave this tensor out (for tests of the loader's errors)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=N",
                    help="set an integer metadata field (uint32)")
    ap.add_argument("--set-str", action="append", default=[], metavar="KEY=TEXT",
                    help="set a string metadata field")
    ap.add_argument("--set-float", action="append", default=[], metavar="KEY=X",
                    help="set a float32 metadata field")
    ap.add_argument("--hf", metavar="DIR", help="also write a Hugging Face directory")
    ap.add_argument("--hf-type", default=None, help="its model_type (default: the GGUF's)")
    ap.add_argument("--hf-config", default="{}", metavar="JSON",
                    help="fields merged into its config.json")
    args = ap.parse_args()
    metadata, vocab = llama_metadata("kvlens-quantized-test", DIM, FFN, args.layers, HEADS, KV_HEADS,
                                     256, tokenizer_from=args.tokenizer)
    vocab = vocab or VOCAB
    rng = np.random.default_rng(args.seed)
    args.gemma = args.gemma or args.gemma2 or args.gemma3
    head_dim = 128 if args.qwen3 else 256 if args.gemma else DIM // HEADS
    kv, q_dim = head_dim * KV_HEADS, head_dim * HEADS

    def mat(rows, cols):
        return rng.normal(0, 1 / np.sqrt(cols), (rows, cols))

    def norm():
        return 1 + rng.normal(0, 0.1, DIM)

    tensors = [("token_embd.weight", rng.normal(0, 1, (vocab, DIM)), "Q4_K")]
    for layer in range(args.layers):
        kinds = LAYER_TYPES[layer % len(LAYER_TYPES)]
        tensors.append((f"blk.{layer}.attn_norm.weight", norm(), "F32"))
        tensors.append((f"blk.{layer}.ffn_norm.weight", norm(), "F32"))
        for (name, shape), kind in zip(llama_projections(DIM, kv, FFN, q_dim), kinds):
            tensors.append((f"blk.{layer}.{name}.weight", mat(*shape), kind))
    tensors.append(("output_norm.weight", norm(), "F32"))
    tensors.append(("output.weight", mat(vocab, DIM), "Q6_K"))
    if args.qwen2:
        metadata = {k.replace("llama.", "qwen2.", 1): v for k, v in metadata.items()}
        metadata["general.architecture"] = "qwen2"
        for layer in range(args.layers):
            for name, size in (("attn_q", DIM), ("attn_k", kv), ("attn_v", kv)):
                tensors.append((f"blk.{layer}.{name}.bias", rng.normal(0, 0.5, size), "F32"))
    if args.qwen3:
        metadata = {k.replace("llama.", "qwen3.", 1): v for k, v in metadata.items()}
        metadata["general.architecture"] = "qwen3"
        metadata["qwen3.attention.key_length"] = np.uint32(head_dim)
        metadata["qwen3.attention.value_length"] = np.uint32(head_dim)
        metadata["qwen3.rope.dimension_count"] = np.uint32(head_dim)
        for layer in range(args.layers):
            for name in ("attn_q_norm", "attn_k_norm"):
                tensors.append((f"blk.{layer}.{name}.weight",
                                1 + rng.normal(0, 0.3, head_dim), "F32"))
    if args.phi3:
        metadata = {k.replace("llama.", "phi3.", 1): v for k, v in metadata.items()}
        metadata["general.architecture"] = "phi3"
        metadata["phi3.rope.dimension_count"] = np.uint32(head_dim)
        by_name = {name: (values, kind) for name, values, kind in tensors}
        for layer in range(args.layers):
            p = f"blk.{layer}."
            for fused, parts in (("attn_qkv", ("attn_q", "attn_k", "attn_v")),
                                 ("ffn_up", ("ffn_gate", "ffn_up"))):
                kind = by_name[p + parts[0] + ".weight"][1]
                rows = np.concatenate([by_name.pop(p + x + ".weight")[0] for x in parts])
                by_name[p + fused + ".weight"] = (rows, kind)
        tensors = [(name, v, kind) for name, (v, kind) in by_name.items()]
    if args.gemma:
        metadata = {k.replace("llama.", "gemma.", 1): v for k, v in metadata.items()}
        metadata["general.architecture"] = "gemma"
        for key in ("key_length", "value_length"):
            metadata[f"gemma.attention.{key}"] = np.uint32(head_dim)
        metadata["gemma.rope.dimension_count"] = np.uint32(head_dim)
        tensors = [t for t in tensors if t[0] != "output.weight"]  # tied
    if args.gemma2 or args.gemma3:
        arch = "gemma2" if args.gemma2 else "gemma3"
        metadata = {k.replace("gemma.", arch + ".", 1): v for k, v in metadata.items()}
        metadata["general.architecture"] = arch
        extra_norms = (("post_attention_norm", DIM), ("post_ffw_norm", DIM))
        if args.gemma3:
            extra_norms = (("attn_q_norm", head_dim), ("attn_k_norm", head_dim)) + extra_norms
        for layer in range(args.layers):
            for name, size in extra_norms:
                # (within 1 ± 0.5, so that the weight alone, v − 1, is as exact in f32)
                tensors.append((f"blk.{layer}.{name}.weight", 1 + rng.normal(0, 0.1, size),
                                "F32"))
    if args.rope_scaling_linear is not None:
        arch = metadata["general.architecture"]
        metadata[f"{arch}.rope.scaling.type"] = "linear"
        metadata[f"{arch}.rope.scaling.factor"] = float(args.rope_scaling_linear)  # f32
    if args.long_rope:
        for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            tensors.append((name, 1 + rng.uniform(0, 3, head_dim // 2), "F32"))
    if args.rope_freqs:
        tensors.append(("rope_freqs.weight", llama31_rope_factors(head_dim, 10000.0), "F32"))
    if args.f32:
        tensors = [(name, values, "F32") for name, values, _ in tensors]
    tensors = [t for t in tensors if t[0] not in args.drop]
    if args.no_add_bos:
        metadata["tokenizer.ggml.add_bos_token"] = False
    if args.chat_template is not None:
        metadata["tokenizer.chat_template"] = args.chat_template
    for item in args.set:
        key, value = item.split("=", 1)
        metadata[key] = np.uint32(int(value))
    for item in args.set_str:
        key, value = item.split("=", 1)
        metadata[key] = value
    for item in args.set_float:
        key, value = item.split("=", 1)
        metadata[key] = float(value)  # written as f32
    values = write_gguf(args.out, metadata, tensors)
    if args.hf:
        arch = metadata["general.architecture"]
        values = {name: values[name] for name, _, _ in tensors}
        if arch == "llama":  # GGUF's q and k rows rotate adjacent pairs; HF's rotate halves
            for name in values:
                if name.endswith(("attn_q.weight", "attn_k.weight")):
                    heads = HEADS if "attn_q" in name else KV_HEADS
                    values[name] = to_half_split(values[name], heads)
        if arch in ("gemma", "gemma2", "gemma3"):  # HF keeps the weight; its norms add the 1
            values = {name: v - 1 if name.endswith("norm.weight") else v
                      for name, v in values.items()}
        extra = {"num_hidden_layers": args.layers}
        if args.rope_scaling_linear is not None:
            extra["rope_scaling"] = {"rope_type": "linear", "factor": args.rope_scaling_linear}
        if f"{arch}.attention.sliding_window" in metadata:
            extra["sliding_window"] = int(metadata[f"{arch}.attention.sliding_window"])
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
            if f"{arch}.{cap}" in metadata:
                extra[cap] = float(np.float32(metadata[f"{arch}.{cap}"]))
        extra.update(json.loads(args.hf_config))
        write_hf(args.hf, args.hf_type or {"gemma3": "gemma3_text"}.get(arch, arch), head_dim,
                 vocab, values, extra)


# GGUF names -> Hugging Face names (Qwen2 / Qwen3 layers).
HF_NAMES = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight":
            "post_attention_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
            "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
            "attn_output.weight": "self_attn.o_proj.weight", "ffn_gate.weight":
            "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight":
            "mlp.down_proj.weight", "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias":
            "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
            "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight":
            "self_attn.k_norm.weight"}


def write_hf(directory, model_type, head_dim, vocab, values, extra):
    """values: GGUF name -> the float64 values the GGUF holds, shaped [rows, cols] as GGUF
    and torch.nn.Linear both store a weight."""
    from kvlens_oracle.checkpoints import write_safetensors
    os.makedirs(directory, exist_ok=True)
    names = dict(HF_NAMES)
    if model_type in ("gemma2", "gemma3_text"):  # norms around attention and the feed-forward
        names.update({"ffn_norm.weight": "pre_feedforward_layernorm.weight",
                      "post_attention_norm.weight": "post_attention_layernorm.weight",
                      "post_ffw_norm.weight": "post_feedforward_layernorm.weight"})
    if model_type == "phi3":  # fused: q | k | v, gate | up
        names.update({"attn_qkv.weight": "self_attn.qkv_proj.weight",
                      "ffn_up.weight": "mlp.gate_up_proj.weight"})
    out = {}
    for name, v in values.items():
        if name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            out[f"model.layers.{layer}.{names[rest]}"] = v
        else:
            out[{"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight":
                 "model.norm.weight", "output.weight": "lm_head.weight"}[name]] = v
    write_safetensors(os.path.join(directory, "model.safetensors"), out)
    config = {"model_type": model_type, "hidden_size": DIM, "intermediate_size": FFN,
              "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "head_dim": head_dim, "vocab_size": vocab,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": "output.weight" not in values, "use_sliding_window": False}
    if model_type in ("gemma", "gemma2", "gemma3_text"):
        config["hidden_activation"] = "gelu_pytorch_tanh"
    config.update(extra)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


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
