"""Turns a model file or directory into an OracleModel: config + float64 torch weights.

Llama-family weights use torch.nn.Linear orientation [out, in] (y = W x).
GPT-2 Conv1D weights ([in, out] in the files) are transposed here to [out, in].
"""
import glob
import json
import math
import os
import struct

import numpy as np
import torch

from .checkpoints import read_llama2c, read_safetensors
from .gguf import GGUFFile

F64 = torch.float64


def _t(a):
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64)).to(F64)


class OracleModel:
    """family: "llama" | "gpt2"; cfg: dict; w: global tensors; layers: list of dicts."""

    def __init__(self, family, cfg, w, layers, source):
        self.family, self.cfg, self.w, self.layers, self.source = family, cfg, w, layers, source

    def __repr__(self):
        return f"OracleModel({self.family}, {self.cfg}, from {self.source})"


def _llama_cfg(d, n_layers, n_heads, n_kv, vocab, eps, base, rope_style, head_dim=None):
    return dict(dim=d, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, vocab_size=vocab,
                head_dim=int(head_dim) if head_dim else d // n_heads, eps=float(eps), rope_base=float(base),
                rope_style=rope_style)


def _gemma(cfg):
    cfg.update(gate="gelu_tanh", embed_scale=math.sqrt(cfg["dim"]))


def load_llama2c(path):
    h, t = read_llama2c(path)
    # run.c adds the float literal 1e-5f inside RMSNorm, so eps is float32(1e-5).
    cfg = _llama_cfg(h["dim"], h["n_layers"], h["n_heads"], h["n_kv_heads"], h["vocab_size"],
                     np.float32(1e-5), 10000.0, "adjacent")
    layers = [dict(attn_norm=_t(t["rms_att"][i]), wq=_t(t["wq"][i]), wk=_t(t["wk"][i]),
                   wv=_t(t["wv"][i]), wo=_t(t["wo"][i]), ffn_norm=_t(t["rms_ffn"][i]),
                   w1=_t(t["w1"][i]), w2=_t(t["w2"][i]), w3=_t(t["w3"][i]))
              for i in range(h["n_layers"])]
    w = dict(embed=_t(t["token_embedding"]), final_norm=_t(t["rms_final"]), out=_t(t["wcls"]))
    return OracleModel("llama", cfg, w, layers, path)


def load_gguf(path):
    """A GGUF Llama, or a Qwen2: a Llama with q/k/v biases whose q and k rows llama.cpp's
    converter leaves as Hugging Face wrote them (rotate_half RoPE: "half" pairs), or a
    Qwen3: no biases, an RMSNorm over each head of q and k, heads of key_length; or a Phi-3:
    q, k and v fused in attn_qkv (rows q | k | v), gate and up in ffn_up (rows gate | up),
    half-split RoPE, and a sliding window (attention.sliding_window), as Hugging Face's
    Phi-3 applies it; or a Gemma: GELU-gated feed-forward, embeddings times sqrt(dim),
    half-split RoPE, norms whose 1 + weight llama.cpp's converter stores; or a Gemma 3, as
    llama.cpp reads one. rope.scaling.type "linear" divides every frequency by its factor."""
    g = GGUFFile(path)
    arch = g.metadata.get("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3"):
        raise NotImplementedError(f"GGUF architecture {arch!r} not supported by the oracle")
    m, T = g.metadata, g.tensors
    n_heads = int(m[f"{arch}.attention.head_count"])
    cfg = _llama_cfg(int(m[f"{arch}.embedding_length"]), int(m[f"{arch}.block_count"]), n_heads,
                     int(m.get(f"{arch}.attention.head_count_kv", n_heads)),
                     T["token_embd.weight"].shape[0],
                     m.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
                     m.get(f"{arch}.rope.freq_base", 10000.0),
                     "half" if arch in ("qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3")
                     else "adjacent",
                     m.get(f"{arch}.attention.key_length"))
    if int(m.get(f"{arch}.rope.dimension_count", cfg["head_dim"])) != cfg["head_dim"]:
        raise NotImplementedError("partial rotary embeddings are not supported by the oracle")
    if arch in ("gemma", "gemma2", "gemma3"):
        _gemma(cfg)
    if arch == "gemma2":  # llama.cpp's defaults when the file leaves the caps out
        cfg["attn_softcap"] = float(m.get("gemma2.attn_logit_softcapping", 50.0))
        cfg["final_softcap"] = float(m.get("gemma2.final_logit_softcapping", 30.0))
    elif arch == "gemma3" and m.get("gemma3.final_logit_softcapping"):
        cfg["final_softcap"] = float(m["gemma3.final_logit_softcapping"])
    scaling = m.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":  # positions divided by the factor
        cfg["rope_factors"] = torch.full((cfg["head_dim"] // 2,),
                                         float(m[f"{arch}.rope.scaling.factor"]), dtype=F64)
    elif scaling != "none":
        raise NotImplementedError(f"rope.scaling.type {scaling!r} is not supported by the oracle")
    if arch in ("gemma2", "gemma3") and m.get(f"{arch}.attention.sliding_window"):
        # llama.cpp: Gemma 2 windows its even layers; Gemma 3 five of six, turning with an
        # unscaled RoPE base of 1e4
        pattern = 2 if arch == "gemma2" else 6
        cfg.update(sliding_window=int(m[f"{arch}.attention.sliding_window"]),
                   windowed_layers=[(i + 1) % pattern != 0 for i in range(cfg["n_layers"])],
                   rope_local_base=1e4 if arch == "gemma3" else None)
    if cfg["n_layers"] == {"gemma2": 46, "gemma3": 62}.get(arch):  # 27B: scalar dim / heads
        cfg["attn_scale"] = (cfg["dim"] / cfg["n_heads"]) ** -0.5
    if "rope_freqs.weight" in T and "rope_factors" in cfg:
        raise NotImplementedError("rope_freqs.weight together with rope.scaling.type")
    if "rope_freqs.weight" in T:  # Llama 3.1's rope scaling: divisors of the frequencies
        cfg["rope_factors"] = _t(T["rope_freqs.weight"]).reshape(-1)
    names = dict(attn_norm="attn_norm", wq="attn_q", wk="attn_k", wv="attn_v", wo="attn_output",
                 ffn_norm="ffn_norm", w1="ffn_gate", w2="ffn_down", w3="ffn_up")
    if arch == "phi3":
        if "rope_factors_long.weight" in T or "rope_factors_short.weight" in T:
            raise NotImplementedError("Phi-3's LongRoPE is not supported by the oracle")
        names = dict(attn_norm="attn_norm", wo="attn_output", ffn_norm="ffn_norm", w2="ffn_down")
        if m.get("phi3.attention.sliding_window"):
            cfg["sliding_window"] = int(m["phi3.attention.sliding_window"])
    layers = [{k: _t(T[f"blk.{i}.{v}.weight"]) for k, v in names.items()}
              for i in range(cfg["n_layers"])]
    if arch == "phi3":
        qd, kvd = cfg["n_heads"] * cfg["head_dim"], cfg["n_kv_heads"] * cfg["head_dim"]
        for i, lw in enumerate(layers):
            qkv, up = _t(T[f"blk.{i}.attn_qkv.weight"]), _t(T[f"blk.{i}.ffn_up.weight"])
            lw.update(wq=qkv[:qd], wk=qkv[qd:qd + kvd], wv=qkv[qd + kvd:])
            ff = up.shape[0] // 2
            lw.update(w1=up[:ff], w3=up[ff:])
    if arch == "qwen2":
        for i, lw in enumerate(layers):
            for k, v in (("bq", "attn_q"), ("bk", "attn_k"), ("bv", "attn_v")):
                lw[k] = _t(T[f"blk.{i}.{v}.bias"])
    if arch in ("qwen3", "gemma3"):
        for i, lw in enumerate(layers):
            for k in ("q_norm", "k_norm"):
                lw[k] = _t(T[f"blk.{i}.attn_{k}.weight"])
    if arch in ("gemma2", "gemma3"):  # norms on the block outputs (1 + weight stored)
        for i, lw in enumerate(layers):
            lw["post_attn_norm"] = _t(T[f"blk.{i}.post_attention_norm.weight"])
            lw["post_ffn_norm"] = _t(T[f"blk.{i}.post_ffw_norm.weight"])
    out = T.get("output.weight", T["token_embd.weight"])
    w = dict(embed=_t(T["token_embd.weight"]), final_norm=_t(T["output_norm.weight"]), out=_t(out))
    model = OracleModel("llama", cfg, w, layers, path)
    model.tensor_types = g.tensor_types
    return model


def _read_hf_tensors(directory):
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(directory, x) for x in files]
    else:
        files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors files")
    tensors = {}
    for fn in files:
        tensors.update(read_safetensors(fn))
    return tensors


def _load_hf_llama(c, T, path):
    p = "model."
    rs = c.get("rope_scaling")
    if rs and rs.get("rope_type", rs.get("type")) != "linear":
        raise NotImplementedError("rope_scaling other than linear is not supported by the oracle")
    cfg = _llama_cfg(c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
                     c.get("num_key_value_heads", c["num_attention_heads"]), c["vocab_size"],
                     c.get("rms_norm_eps", 1e-6), c.get("rope_theta", 10000.0), "half",
                     c.get("head_dim"))
    if rs:  # linear: positions divided by the factor
        cfg["rope_factors"] = torch.full((cfg["head_dim"] // 2,), float(rs["factor"]), dtype=F64)
    names = dict(attn_norm="input_layernorm", wq="self_attn.q_proj", wk="self_attn.k_proj",
                 wv="self_attn.v_proj", wo="self_attn.o_proj", ffn_norm="post_attention_layernorm",
                 w1="mlp.gate_proj", w2="mlp.down_proj", w3="mlp.up_proj")
    phi3 = c.get("model_type") == "phi3"
    if phi3:  # q | k | v fused in qkv_proj, gate | up in gate_up_proj
        for k in ("wq", "wk", "wv", "w1", "w3"):
            del names[k]
    layers = [{k: _t(T[f"{p}layers.{i}.{v}.weight"]) for k, v in names.items()}
              for i in range(cfg["n_layers"])]
    if phi3:
        qd, kvd = cfg["n_heads"] * cfg["head_dim"], cfg["n_kv_heads"] * cfg["head_dim"]
        for i, lw in enumerate(layers):
            qkv = _t(T[f"{p}layers.{i}.self_attn.qkv_proj.weight"])
            up = _t(T[f"{p}layers.{i}.mlp.gate_up_proj.weight"])
            lw.update(wq=qkv[:qd], wk=qkv[qd:qd + kvd], wv=qkv[qd + kvd:])
            ff = up.shape[0] // 2
            lw.update(w1=up[:ff], w3=up[ff:])
    if c.get("model_type") in ("mistral", "phi3") and c.get("sliding_window") is not None:
        cfg["sliding_window"] = c["sliding_window"]
    gemma = c.get("model_type") == "gemma"
    if gemma:  # GemmaRMSNorm scales by 1 + weight
        if c.get("hidden_activation") not in (None, "gelu_pytorch_tanh"):
            raise NotImplementedError("Gemma's hidden_activation: the oracle implements "
                                      "gelu_pytorch_tanh only")
        _gemma(cfg)
        for lw in layers:
            lw["attn_norm"], lw["ffn_norm"] = 1 + lw["attn_norm"], 1 + lw["ffn_norm"]
    if c.get("model_type") == "qwen3":
        for i, lw in enumerate(layers):
            for k in ("q_norm", "k_norm"):
                lw[k] = _t(T[f"{p}layers.{i}.self_attn.{k}.weight"])
    embed = T[p + "embed_tokens.weight"]
    out = T.get("lm_head.weight", embed)
    w = dict(embed=_t(embed), final_norm=_t(T[p + "norm.weight"]), out=_t(out))
    if gemma:
        w["final_norm"] = 1 + w["final_norm"]
    return OracleModel("llama", cfg, w, layers, path)


def _load_hf_gemma3(c, T, path, gemma2=False):
    """Gemma 3's text model (model_type gemma3_text, or a gemma3's text_config; absent fields
    take Gemma3TextConfig's defaults): Gemma's GeGLU, sqrt(dim) and 1 + weight norms, plus
    RMSNorms over each head of q and k, norms on the attention and feed-forward outputs,
    scores times query_pre_attn_scalar^-1/2, and layers that see sliding_window keys with
    RoPE base rope_local_base_freq, but every sliding_window_pattern-th (or layer_types'
    "full_attention" ones) all keys with rope_theta and rope_scaling ("linear": positions
    divided by factor). With gemma2: Gemma2Config's defaults, no head norms, one RoPE base,
    every other layer windowed, scores and logits soft-capped (50 and 30 unless given)."""
    if c.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise NotImplementedError("Gemma 3's hidden_activation must be gelu_pytorch_tanh")
    g = lambda key, default: c[key] if c.get(key) is not None else default  # noqa: E731
    n_layers = g("num_hidden_layers", 26)
    cfg = _llama_cfg(g("hidden_size", 2304), n_layers, g("num_attention_heads", 8),
                     g("num_key_value_heads", 4), g("vocab_size", 256000 if gemma2 else 262208),
                     g("rms_norm_eps", 1e-6), g("rope_theta", 1e4 if gemma2 else 1e6), "half",
                     g("head_dim", 256))
    _gemma(cfg)
    caps = (50.0, 30.0) if gemma2 else (None, None)
    for key, name, default in (("attn_logit_softcapping", "attn_softcap", caps[0]),
                               ("final_logit_softcapping", "final_softcap", caps[1])):
        cfg[name] = c[key] if key in c else default  # null: none
    pattern = g("sliding_window_pattern", 2 if gemma2 else 6)
    types = g("layer_types", ["sliding_attention" if (i + 1) % pattern else "full_attention"
                              for i in range(n_layers)])
    cfg.update(sliding_window=g("sliding_window", 4096),
               windowed_layers=[t == "sliding_attention" for t in types],
               rope_local_base=None if gemma2 else float(g("rope_local_base_freq", 10000.0)),
               attn_scale=float(g("query_pre_attn_scalar", 256)) ** -0.5)
    rs = c.get("rope_scaling")
    if rs is not None:
        if rs.get("rope_type", rs.get("type")) != "linear":
            raise NotImplementedError("Gemma 3 rope_scaling: the oracle implements linear only")
        cfg["rope_factors"] = torch.full((cfg["head_dim"] // 2,), float(rs["factor"]), dtype=F64)
    p = next(x for x in ("model.", "language_model.model.", "model.language_model.")
             if x + "embed_tokens.weight" in T)
    names = dict(attn_norm="input_layernorm", wq="self_attn.q_proj", wk="self_attn.k_proj",
                 wv="self_attn.v_proj", wo="self_attn.o_proj", q_norm="self_attn.q_norm",
                 k_norm="self_attn.k_norm", post_attn_norm="post_attention_layernorm",
                 ffn_norm="pre_feedforward_layernorm", post_ffn_norm="post_feedforward_layernorm",
                 w1="mlp.gate_proj", w2="mlp.down_proj", w3="mlp.up_proj")
    if gemma2:
        del names["q_norm"], names["k_norm"]
    norms = ("attn_norm", "q_norm", "k_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm")
    layers = [{k: _t(T[f"{p}layers.{i}.{v}.weight"]) + (1 if k in norms else 0)
               for k, v in names.items()} for i in range(n_layers)]
    embed = _t(T[p + "embed_tokens.weight"])
    w = dict(embed=embed, final_norm=1 + _t(T[p + "norm.weight"]), out=embed)
    return OracleModel("llama", cfg, w, layers, path)


def _load_hf_gpt2(c, T, path):
    p = "transformer." if "transformer.wte.weight" in T else ""
    d = c["n_embd"]
    cfg = dict(dim=d, n_layers=c["n_layer"], n_heads=c["n_head"], head_dim=d // c["n_head"],
               vocab_size=c["vocab_size"], n_positions=c.get("n_positions", 1024),
               eps=float(c.get("layer_norm_epsilon", 1e-5)))
    act = c.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise NotImplementedError(f"GPT-2 activation {act!r}: the oracle implements tanh GELU only")
    layers = []
    for i in range(cfg["n_layers"]):
        q = f"{p}h.{i}."
        # Conv1D: y = x @ W + b with W [in, out]; store W^T [out, in].
        layers.append(dict(
            ln1_w=_t(T[q + "ln_1.weight"]), ln1_b=_t(T[q + "ln_1.bias"]),
            w_qkv=_t(T[q + "attn.c_attn.weight"].T), b_qkv=_t(T[q + "attn.c_attn.bias"]),
            w_o=_t(T[q + "attn.c_proj.weight"].T), b_o=_t(T[q + "attn.c_proj.bias"]),
            ln2_w=_t(T[q + "ln_2.weight"]), ln2_b=_t(T[q + "ln_2.bias"]),
            w_fc=_t(T[q + "mlp.c_fc.weight"].T), b_fc=_t(T[q + "mlp.c_fc.bias"]),
            w_proj=_t(T[q + "mlp.c_proj.weight"].T), b_proj=_t(T[q + "mlp.c_proj.bias"])))
    wte = T[p + "wte.weight"]
    w = dict(wte=_t(wte), wpe=_t(T[p + "wpe.weight"]), lnf_w=_t(T[p + "ln_f.weight"]),
             lnf_b=_t(T[p + "ln_f.bias"]), out=_t(T.get("lm_head.weight", wte)))
    return OracleModel("gpt2", cfg, w, layers, path)


def load_hf(path):
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    with open(os.path.join(directory, "config.json")) as f:
        c = json.load(f)
    T = _read_hf_tensors(directory)
    mt = c.get("model_type")
    if mt == "gpt2":
        return _load_hf_gpt2(c, T, directory)
    if mt == "gemma3":
        return _load_hf_gemma3(c["text_config"], T, directory)
    if mt == "gemma3_text":
        return _load_hf_gemma3(c, T, directory)
    if mt == "gemma2":
        return _load_hf_gemma3(c, T, directory, gemma2=True)
    if mt in ("llama", "mistral", "qwen3", "phi3", "gemma"):
        return _load_hf_llama(c, T, directory)
    raise NotImplementedError(f"model_type {mt!r} not supported by the oracle")


def load_model(path):
    """Dispatches on the file: directory / config.json / *.safetensors -> Hugging Face,
    GGUF magic -> GGUF, otherwise a llama2.c checkpoint."""
    if os.path.isdir(path) or path.endswith((".json", ".safetensors")):
        return load_hf(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return load_gguf(path)
    if len(magic) == 4 and struct.unpack("<i", magic)[0] > 0:
        return load_llama2c(path)
    raise ValueError(f"{path}: unrecognised model file")
