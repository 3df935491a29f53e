#!/usr/bin/python3
"""Independent check of the shipped default model files (numpy only, float64).

Reads model.safetensors with its own parser, config.json and tokenizer.json, runs the
Hugging Face GPT-2 forward pass (GPT2LMHeadModel maths: learned positions, pre-LN,
gelu_new, Conv1D weights stored [in, out], tied lm_head), and
  1. compares its logits with the training model's logits on a held-out sequence
     (models/.kjv-probe-logits.npy, written by train_default_model.py), if present;
  2. round-trips text through its own byte-level BPE from tokenizer.json;
  3. greedily generates from the prompts.

  /usr/bin/python3 models/verify_default_model.py [models/kjv-gpt2-4l]
"""
import json
import os
import re
import struct
import sys

import numpy as np

D = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "kjv-gpt2-4l")


def load_safetensors(path):
    with open(path, "rb") as f:
        buf = f.read()
    n = struct.unpack("<Q", buf[:8])[0]
    header = json.loads(buf[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32", info
        s, e = info["data_offsets"]
        out[name] = np.frombuffer(buf[base + s:base + e], dtype="<f4").reshape(info["shape"]).astype(np.float64)
    return out


cfg = json.load(open(os.path.join(D, "config.json")))
W = load_safetensors(os.path.join(D, "model.safetensors"))
L, H, E, eps = cfg["n_layer"], cfg["n_head"], cfg["n_embd"], cfg["layer_norm_epsilon"]
assert cfg["activation_function"] == "gelu_new" and cfg["tie_word_embeddings"]
assert "lm_head.weight" not in W


def ln(x, p):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * W[p + ".weight"] + W[p + ".bias"]


def conv1d(x, p):  # HF Conv1D: y = x @ W[in, out] + b
    return x @ W[p + ".weight"] + W[p + ".bias"]


def gelu_new(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def forward(ids):
    T = len(ids)
    x = W["transformer.wte.weight"][ids] + W["transformer.wpe.weight"][:T]
    mask = np.triu(np.ones((T, T), dtype=bool), 1)
    for i in range(L):
        p = f"transformer.h.{i}."
        qkv = conv1d(ln(x, p + "ln_1"), p + "attn.c_attn")
        q, k, v = np.split(qkv, 3, axis=-1)
        hd = E // H
        q, k, v = (t.reshape(T, H, hd).transpose(1, 0, 2) for t in (q, k, v))
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
        s[:, mask] = -np.inf
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        a = (s @ v).transpose(1, 0, 2).reshape(T, E)
        x = x + conv1d(a, p + "attn.c_proj")
        x = x + conv1d(gelu_new(conv1d(ln(x, p + "ln_2"), p + "mlp.c_fc")), p + "mlp.c_proj")
    return ln(x, "transformer.ln_f") @ W["transformer.wte.weight"].T


# ---- byte-level BPE read from tokenizer.json (independent of the training script)
tj = json.load(open(os.path.join(D, "tokenizer.json")))
assert tj["model"]["type"] == "BPE" and tj["pre_tokenizer"]["type"] == "ByteLevel"
vocab = tj["model"]["vocab"]
inv = {i: t for t, i in vocab.items()}
ranks = {tuple(m.split(" ")): r for r, m in enumerate(tj["model"]["merges"])}
special = {t["content"]: t["id"] for t in tj["added_tokens"]}
eot = special["<|endoftext|>"]
assert eot == cfg["bos_token_id"] == cfg["eos_token_id"] and len(vocab) == cfg["vocab_size"]
printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
b2u, n = {}, 0
for b in range(256):
    if b in printable:
        b2u[b] = chr(b)
    else:
        b2u[b] = chr(256 + n)
        n += 1
u2b = {u: b for b, u in b2u.items()}
pat = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")


def encode(text):
    ids = []
    for w in pat.findall(text):
        parts = [b2u[b] for b in w.encode()]
        while len(parts) > 1:
            r, k = min((ranks.get((a, b), 1 << 30), j) for j, (a, b) in enumerate(zip(parts, parts[1:])))
            if r == 1 << 30:
                break
            parts[k:k + 2] = [parts[k] + parts[k + 1]]
        ids += [vocab[p] for p in parts]
    return ids


def decode(ids):
    return bytes(b for i in ids for b in (inv[i].encode() if i == eot else bytes(u2b[c] for c in inv[i]))).decode()


n_params = sum(v.size for v in W.values())
print(f"{D}: {len(W)} tensors, {n_params} parameters, vocab {len(vocab)}, <|endoftext|> id {eot}")
s = "And God said, Let there be light: and there was light."
assert decode(encode(s)) == s
print("tokenize:", encode(s))

probe = os.path.join(D, "..", ".kjv-probe-logits.npy")
log = os.path.join(D, "training_log.json")
if os.path.exists(probe) and os.path.exists(log):
    ref = np.load(probe)
    ids = json.load(open(log))["probe_ids"]
    got = forward(ids)
    diff = np.abs(got - ref).max()
    lp = got - got.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    nll = -lp[np.arange(len(ids) - 1), ids[1:]].mean()
    print(f"held-out probe ({len(ids)} tokens): max |logit diff| vs training model = {diff:.2e}; "
          f"float64 loss on it {nll:.4f}")
    assert diff < 1e-3, diff

for prompt in ["And God said", "In the beginning", "The LORD is"]:
    ids = encode(prompt)
    for _ in range(40):
        nxt = int(forward(ids[-cfg["n_positions"]:])[-1].argmax())
        if nxt == eot:
            break
        ids.append(nxt)
    print(f"greedy {prompt!r}: {decode(ids)!r}")
