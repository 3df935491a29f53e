"""Test helpers: file writers (GGUF, llama2.c, HF) and an independent numpy GPT-2."""
import json
import math
import os
import struct

import numpy as np

from kvlens_oracle import ggml_quants
from kvlens_oracle.checkpoints import write_safetensors

GGML = {"F32": 0, "F16": 1, "BF16": 30, **{k: v[0] for k, v in ggml_quants.TYPES.items()}}


def shared_testdata():
    here = os.path.dirname(os.path.abspath(__file__))
    shared = os.environ.get("KVLENS_SHARED_DIR") or os.path.join(here, "..", "..", "..", "shared")
    path = os.path.join(shared, "testdata")
    return path if os.path.isdir(path) else None


def repo_root():
    return os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


# The prompt the stories260K checks tokenize, and the trained default model's directory.
STORIES_PROBE = "Once upon a time, there was a little girl named Lily. She loved to play outside"
KJV_GPT2 = os.path.join(repo_root(), "models", "kjv-gpt2-4l")


# ------------------------------------------------------------------ GGUF writer
def _gguf_str(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _gguf_value(v):
    if isinstance(v, bool):
        return struct.pack("<I?", 7, v)
    if isinstance(v, np.uint32):  # as llama.cpp wants its hyperparameters
        return struct.pack("<II", 4, int(v))
    if isinstance(v, int):
        return struct.pack("<Ii", 5, v)
    if isinstance(v, float):
        return struct.pack("<If", 6, v)
    if isinstance(v, str):
        return struct.pack("<I", 8) + _gguf_str(v)
    if isinstance(v, list):
        body = [_gguf_value(x) for x in v]
        etype = struct.unpack("<I", body[0][:4])[0] if body else 5
        return struct.pack("<IIQ", 9, etype, len(v)) + b"".join(b[4:] for b in body)
    raise TypeError(type(v))


def quantize(arr, kind):
    """Returns (bytes, exactly dequantized float64 values) for a ggml type."""
    a = np.asarray(arr, np.float64).reshape(-1)
    if kind == "F32":
        return a.astype("<f4").tobytes(), a.astype(np.float32).astype(np.float64)
    if kind == "F16":
        return a.astype("<f2").tobytes(), a.astype(np.float16).astype(np.float64)
    if kind == "BF16":
        bits = a.astype("<f4").view("<u4")
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")  # round to nearest even
        return bits.tobytes(), (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if kind in ggml_quants.TYPES:
        raw = ggml_quants.encode(a, kind)
        return raw, ggml_quants.decode(raw, kind, a.size)
    raise ValueError(kind)


def write_gguf(path, metadata, tensors, version=3, alignment=32):
    """tensors: list of (name, numpy array, ggml type name). Returns {name: dequantized}."""
    md = dict(metadata)
    if alignment != 32:
        md["general.alignment"] = alignment
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(md))
    head += b"".join(_gguf_str(k) + _gguf_value(v) for k, v in md.items())
    data, expect = b"", {}
    for name, arr, kind in tensors:
        raw, deq = quantize(arr, kind)
        data += b"\0" * (-len(data) % alignment)
        ne = list(reversed(arr.shape))
        head += _gguf_str(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, GGML[kind], len(data))
        data += raw
        expect[name] = deq.reshape(arr.shape)
    with open(path, "wb") as f:
        f.write(head + b"\0" * (-len(head) % alignment) + data)
    return expect


# ------------------------------------------------------ random Llama GGUF models
def llama_projections(dim, kv_dim, ffn, q_dim=None):
    """A Llama layer's linear weights, in GGUF's names: [(name, (rows, cols)), ...]. q_dim:
    the query heads' width (heads × head size) where it is not dim (Qwen3)."""
    q_dim = q_dim or dim
    return [("attn_q", (q_dim, dim)), ("attn_k", (kv_dim, dim)), ("attn_v", (kv_dim, dim)),
            ("attn_output", (dim, q_dim)), ("ffn_gate", (ffn, dim)), ("ffn_up", (ffn, dim)),
            ("ffn_down", (dim, ffn))]


def llama_metadata(name, dim, ffn, layers, heads, kv_heads, context, tokenizer_from=None):
    """GGUF metadata for a Llama, counts as uint32 (llama.cpp requires it); with
    tokenizer_from (a GGUF path), that file's tokenizer. Returns (metadata, its vocab size
    or None)."""
    md = {
        "general.architecture": "llama",
        "general.name": name,
        "llama.embedding_length": np.uint32(dim),
        "llama.feed_forward_length": np.uint32(ffn),
        "llama.block_count": np.uint32(layers),
        "llama.attention.head_count": np.uint32(heads),
        "llama.attention.head_count_kv": np.uint32(kv_heads),
        "llama.context_length": np.uint32(context),
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 10000.0,
        "llama.rope.dimension_count": np.uint32(dim // heads),
    }
    if tokenizer_from is None:
        return md, None
    from kvlens_oracle.gguf import GGUFFile
    src = GGUFFile(tokenizer_from).metadata
    md.update({k: np.uint32(v) if isinstance(v, int) else v  # token ids: uint32, as there
               for k, v in src.items() if k.startswith("tokenizer.")})
    return md, len(src["tokenizer.ggml.tokens"])


# --------------------------------------------------------- llama2.c -> other files
def write_llama2c(path, hdr, t, untied):
    order = ["token_embedding", "rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3",
             "rms_final"]
    vocab = -hdr["vocab_size"] if untied else hdr["vocab_size"]
    fields = [hdr[k] for k in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads")]
    with open(path, "wb") as f:
        f.write(struct.pack("<7i", *fields, vocab, hdr["seq_len"]))
        for k in order:
            f.write(t[k].astype("<f4").tobytes())
        f.write(np.zeros(hdr["seq_len"] * hdr["dim"] // hdr["n_heads"], "<f4").tobytes())
        if untied:
            f.write(t["wcls"].astype("<f4").tobytes())


def to_half_split(w, n_heads):
    """Reorders each head's rows from adjacent pairs (0,1),(2,3).. to halves (i, i+hd/2)."""
    hd = w.shape[0] // n_heads
    perm = np.concatenate([np.arange(0, hd, 2), np.arange(1, hd, 2)])
    return w.reshape(n_heads, hd, -1)[:, perm].reshape(w.shape)


def write_hf_llama(directory, hdr, t, eps, shards=1):
    """Saves a llama2.c model as a HF llama directory (q/k rows permuted to half-split)."""
    os.makedirs(directory, exist_ok=True)
    sd = {"model.embed_tokens.weight": t["token_embedding"], "model.norm.weight": t["rms_final"]}
    for i in range(hdr["n_layers"]):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = to_half_split(t["wq"][i], hdr["n_heads"])
        sd[p + "self_attn.k_proj.weight"] = to_half_split(t["wk"][i], hdr["n_kv_heads"])
        sd[p + "self_attn.v_proj.weight"] = t["wv"][i]
        sd[p + "self_attn.o_proj.weight"] = t["wo"][i]
        sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.down_proj.weight"] = t["w1"][i], t["w2"][i]
        sd[p + "mlp.up_proj.weight"] = t["w3"][i]
        sd[p + "input_layernorm.weight"] = t["rms_att"][i]
        sd[p + "post_attention_layernorm.weight"] = t["rms_ffn"][i]
    names = list(sd)
    weight_map = {}
    for s in range(shards):
        fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        part = names[s::shards]
        write_safetensors(os.path.join(directory, fn), {n: sd[n] for n in part})
        weight_map.update({n: fn for n in part})
    if shards > 1:
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    cfg = dict(model_type="llama", hidden_size=hdr["dim"], intermediate_size=hdr["hidden_dim"],
               num_hidden_layers=hdr["n_layers"], num_attention_heads=hdr["n_heads"],
               num_key_value_heads=hdr["n_kv_heads"], vocab_size=hdr["vocab_size"],
               rms_norm_eps=eps, rope_theta=10000.0, tie_word_embeddings=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)


# ------------------------------------------------------------------ tiny GPT-2
def tiny_gpt2(directory, seed=0, d=32, n_head=4, n_layer=2, vocab=50, n_pos=24, prefix=True):
    """Random GPT-2 saved as HF (Conv1D [in, out] weights). Returns (raw numpy dict, config)."""
    rng = np.random.default_rng(seed)
    p = "transformer." if prefix else ""
    r = lambda *s: rng.normal(0, 0.3, s)  # noqa: E731
    sd = {p + "wte.weight": r(vocab, d), p + "wpe.weight": r(n_pos, d),
          p + "ln_f.weight": 1 + r(d), p + "ln_f.bias": r(d)}
    for i in range(n_layer):
        q = f"{p}h.{i}."
        for ln in ("ln_1", "ln_2"):
            sd[q + ln + ".weight"], sd[q + ln + ".bias"] = 1 + r(d), r(d)
        for name, (i_, o_) in (("attn.c_attn", (d, 3 * d)), ("attn.c_proj", (d, d)),
                               ("mlp.c_fc", (d, 4 * d)), ("mlp.c_proj", (4 * d, d))):
            sd[q + name + ".weight"], sd[q + name + ".bias"] = r(i_, o_), r(o_)
    sd = {k: v.astype(np.float32).astype(np.float64) for k, v in sd.items()}
    os.makedirs(directory, exist_ok=True)
    write_safetensors(os.path.join(directory, "model.safetensors"), sd)
    cfg = dict(model_type="gpt2", n_embd=d, n_head=n_head, n_layer=n_layer, vocab_size=vocab,
               n_positions=n_pos, layer_norm_epsilon=1e-5, activation_function="gelu_new")
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    return {k[len(p):]: v for k, v in sd.items()}, cfg


def numpy_gpt2(sd, cfg, tokens):
    """GPT-2 with Conv1D weights as stored (y = x W + b), one head at a time, in numpy."""
    d, H, eps = cfg["n_embd"], cfg["n_head"], cfg["layer_norm_epsilon"]
    hd, T = d // H, len(tokens)

    def ln(x, g, b):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * g + b

    x = sd["wte.weight"][tokens] + sd["wpe.weight"][:T]
    maps = []
    for i in range(cfg["n_layer"]):
        P = lambda n: sd[f"h.{i}.{n}"]  # noqa: E731
        qkv = ln(x, P("ln_1.weight"), P("ln_1.bias")) @ P("attn.c_attn.weight") + P("attn.c_attn.bias")
        heads, probs = [], []
        for h in range(H):
            q, k, v = (qkv[:, j * d + h * hd: j * d + (h + 1) * hd] for j in range(3))
            s = q @ k.T / math.sqrt(hd)
            s[np.triu_indices(T, 1)] = -np.inf
            a = np.exp(s - s.max(1, keepdims=True))
            a /= a.sum(1, keepdims=True)
            heads.append(a @ v)
            probs.append(a)
        x = x + np.concatenate(heads, 1) @ P("attn.c_proj.weight") + P("attn.c_proj.bias")
        u = ln(x, P("ln_2.weight"), P("ln_2.bias")) @ P("mlp.c_fc.weight") + P("mlp.c_fc.bias")
        g = 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))
        x = x + g @ P("mlp.c_proj.weight") + P("mlp.c_proj.bias")
        maps.append(np.stack(probs))
    return ln(x, sd["ln_f.weight"], sd["ln_f.bias"]) @ sd["wte.weight"].T, np.stack(maps)


def build_models(directory, specs):
    """specs: name -> make_quantized_gguf.py arguments, or None for tiny_gpt2(seed=4,
    n_layer=3). Writes each model under `directory` and loads it: (paths, models), dicts by
    name."""
    import sys
    from kvlens_oracle import load_model
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "make_quantized_gguf.py")
    paths, models = {}, {}
    for name, args in specs.items():
        if args is None:
            path = os.path.join(directory, name)
            tiny_gpt2(path, seed=4, n_layer=3)
        else:
            path = os.path.join(directory, f"{name}.gguf")
            if os.system(f"{sys.executable} {script} --out {path} {args}") != 0:
                raise RuntimeError("make_quantized_gguf.py failed")
        paths[name], models[name] = path, load_model(path)
    return paths, models
