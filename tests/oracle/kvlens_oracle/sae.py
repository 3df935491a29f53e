"""Sparse autoencoders (SAEs) on a hook's activations, in float64, as interpretability users
load them: SAELens directories and Google's Gemma Scope params.npz. No SAELens import; the
file readers are written out here (safetensors checked strictly, so broken files fail).

load_sae(path, hook=None) -> SAE
  a directory: SAELens, cfg.json + sae_weights.safetensors with W_enc [d_in, d_sae],
    b_enc [d_sae], W_dec [d_sae, d_in], b_dec [d_in] (+ threshold [d_sae] for "jumprelu"),
    nothing else. cfg.json: "architecture" "standard" | "jumprelu" | "topk" ("standard" with
    "activation_fn_str": "topk" is older SAELens's spelling of topk), "d_in", "d_sae",
    "hook_name", optional "hook_layer" (must agree with hook_name), "apply_b_dec_to_input",
    "normalize_activations" "none" (or null), "activation_fn_str" ("relu"; "topk" for topk),
    "activation_fn_kwargs" ({"k": K} for topk; newer SAELens's top-level "k" also read),
    "dtype" (float32 / float16 / bfloat16, optionally "torch."-prefixed; must be the
    stored tensors' dtype). Rejected: anything else, a "hook_head_index" other than null, a
    true "finetuning_scaling_factor".
  a *.npz: Gemma Scope (numpy.load): W_enc, W_dec, b_enc, b_dec, threshold; a JumpReLU SAE
    that does not subtract b_dec from its input; no hook in the file (hook_name None).
  hook (a TransformerLens name) overrides the cfg's hook_name, or supplies it: a SAELens
  cfg without hook_name and no hook is an error.
  Every tensor becomes float64 from the stored values (f16 / bf16 exactly widened).

encode(sae, x) -> f [..., d_sae]   (x [..., d_in], numpy or torch; float64 torch out)
  pre = (x - b_dec if apply_b_dec_to_input else x) @ W_enc + b_enc
  standard: f = relu(pre)
  jumprelu: f = relu(pre) where pre > threshold, else 0
  topk:     the k largest entries of pre (ties: lower index first) keep relu(pre), the
            rest 0
decode(sae, f) -> f @ W_dec + b_dec
pre_activations(sae, x) -> pre

parse_hook(name) -> (hook, layer), hook the act.{hook}.{layer} name of attribution.py:
  blocks.{l}.hook_resid_pre / hook_resid_mid / hook_resid_post / hook_attn_out / hook_mlp_out
  -> resid_pre / resid_mid / resid_post / attn_out / mlp_out; blocks.{l}.attn.hook_z -> z.
hook_input(acts, name) -> the [T, d] rows an SAE at that hook reads from activations()'s
  dict (act.z.{l} [T, H, hd] becomes [T, H*hd], heads side by side).
"""
import json
import math
import os
import re
import struct

import numpy as np
import torch

from .gguf import bf16_to_f32

ARCHITECTURES = ("standard", "jumprelu", "topk")
TENSORS = ("W_enc", "b_enc", "W_dec", "b_dec")
_HOOKS = {"hook_resid_pre": "resid_pre", "hook_resid_mid": "resid_mid",
          "hook_resid_post": "resid_post", "hook_attn_out": "attn_out",
          "hook_mlp_out": "mlp_out", "attn.hook_z": "z"}
_HOOK_RE = re.compile(r"blocks\.(0|[1-9][0-9]*)\.(" + "|".join(re.escape(h) for h in _HOOKS) + r")")
_CFG_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_ST_DTYPES = {"F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2)}


class SAE:
    """W_enc [d_in, d_sae], b_enc [d_sae], W_dec [d_sae, d_in], b_dec [d_in], threshold
    [d_sae] or None: float64 torch tensors. architecture, k (topk) or None,
    apply_b_dec_to_input, hook_name or None, dtype ("F32" / "F16" / "BF16" as stored),
    format ("saelens" / "npz")."""

    def __init__(self, tensors, architecture, k, apply_b_dec_to_input, hook_name, dtype, fmt):
        for name in (*TENSORS, "threshold"):
            v = tensors.get(name)
            setattr(self, name, None if v is None else torch.from_numpy(np.asarray(v, np.float64)))
        self.d_in, self.d_sae = self.W_enc.shape
        self.architecture, self.k = architecture, k
        self.apply_b_dec_to_input = apply_b_dec_to_input
        self.hook_name, self.dtype, self.format = hook_name, dtype, fmt

    def __repr__(self):
        return (f"SAE({self.format} {self.architecture} d_in={self.d_in} d_sae={self.d_sae} "
                f"k={self.k} apply_b_dec_to_input={self.apply_b_dec_to_input} "
                f"hook={self.hook_name} dtype={self.dtype})")


def parse_hook(name):
    m = _HOOK_RE.fullmatch(name or "")
    if not m:
        raise ValueError(f"unsupported hook name {name!r} (blocks.L.hook_resid_pre / "
                         "hook_resid_mid / hook_resid_post / hook_attn_out / hook_mlp_out / "
                         "attn.hook_z)")
    return _HOOKS[m.group(2)], int(m.group(1))


def hook_input(acts, name):
    hook, layer = parse_hook(name)
    key = f"act.{hook}.{layer}"
    if key not in acts:
        raise ValueError(f"hook {name}: no {key} (the model has fewer layers?)")
    a = np.asarray(acts[key], np.float64)
    return a.reshape(a.shape[0], -1)


def read_safetensors_strict(path):
    """Returns ({name: float64 array}, {name: dtype}); the header must describe the data
    exactly (sizes match shapes, tensors tile the data with no gap, overlap or tail)."""
    with open(path, "rb") as f:
        buf = f.read()
    if len(buf) < 8:
        raise ValueError(f"{path}: {len(buf)} bytes, shorter than the header length")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if 8 + n > len(buf):
        raise ValueError(f"{path}: header of {n} bytes runs past the file ({len(buf)} bytes)")
    try:
        header = json.loads(buf[8:8 + n])
    except ValueError as e:
        raise ValueError(f"{path}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    data = memoryview(buf)[8 + n:]
    spans, out, dtypes = [], {}, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {name}: bad header entry {info!r}") from None
        if dtype not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name}: dtype {dtype} (F32, F16, BF16 only)")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise ValueError(f"{path}: tensor {name}: bad shape {shape!r}")
        np_dtype, size = _ST_DTYPES[dtype]
        count = math.prod(shape)
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            raise ValueError(f"{path}: tensor {name}: bad data_offsets {[begin, end]}")
        if end - begin != count * size:
            raise ValueError(f"{path}: tensor {name}: {end - begin} bytes for shape {shape} {dtype}")
        if end > len(data):
            raise ValueError(f"{path}: tensor {name} ends at byte {end} of the data, which has "
                             f"{len(data)} (truncated file?)")
        raw = np.frombuffer(data[begin:end], np_dtype)
        arr = bf16_to_f32(raw) if dtype == "BF16" else raw
        out[name] = arr.astype(np.float64).reshape(shape)
        dtypes[name] = dtype
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise ValueError(f"{path}: tensor {name} starts at {begin}, expected {at} (gap or overlap)")
        at = end
    if at != len(data):
        raise ValueError(f"{path}: {len(data) - at} bytes after the last tensor")
    return out, dtypes


def _check_shapes(path, t, d_in, d_sae, want):
    shapes = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in),
              "b_dec": (d_in,), "threshold": (d_sae,)}
    missing = [n for n in want if n not in t]
    extra = sorted(set(t) - set(want))
    if missing or extra:
        raise ValueError(f"{path}: tensors {sorted(t)}: missing {missing}, unexpected {extra}")
    for name in want:
        if tuple(t[name].shape) != shapes[name]:
            raise ValueError(f"{path}: {name} has shape {list(t[name].shape)}, expected "
                             f"{list(shapes[name])} (d_in {d_in}, d_sae {d_sae})")
        if not np.all(np.isfinite(t[name])):
            raise ValueError(f"{path}: {name} holds a non-finite value")


def _load_npz(path, hook):
    with np.load(path, allow_pickle=False) as z:
        t = {name: np.asarray(z[name]) for name in z.files}
    for name, a in t.items():
        if a.dtype.kind != "f":
            raise ValueError(f"{path}: {name} has dtype {a.dtype}, expected floats")
    if "W_enc" not in t or t["W_enc"].ndim != 2:
        raise ValueError(f"{path}: no 2-D W_enc (keys {sorted(t)})")
    d_in, d_sae = t["W_enc"].shape
    want = (*TENSORS, "threshold")
    _check_shapes(path, t, d_in, d_sae, want)
    dtypes = {str(a.dtype) for a in t.values()}
    if hook is not None:
        parse_hook(hook)
    return SAE({k: t[k].astype(np.float64) for k in want}, "jumprelu", None, False, hook,
               "F32" if dtypes == {"float32"} else "/".join(sorted(dtypes)), "npz")


def _cfg_int(path, cfg, key):
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{path}: cfg {key} = {v!r}, expected a positive integer")
    return v


def _load_saelens(path, hook):
    cfg_path = os.path.join(path, "cfg.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path}: not a JSON object")
    arch, fn = cfg.get("architecture"), cfg.get("activation_fn_str", "relu")
    kwargs = cfg.get("activation_fn_kwargs") or {}
    if arch == "standard" and fn == "topk":
        arch = "topk"  # older SAELens: a topk SAE is "standard" with a topk activation
    if arch not in ARCHITECTURES:
        raise ValueError(f"{cfg_path}: architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
    want_fn = "topk" if arch == "topk" else "relu"
    if fn != want_fn:
        raise ValueError(f"{cfg_path}: activation_fn_str {fn!r} for architecture {arch} "
                         f"(expected {want_fn!r})")
    d_in, d_sae = _cfg_int(cfg_path, cfg, "d_in"), _cfg_int(cfg_path, cfg, "d_sae")
    k = None
    if arch == "topk":
        k = kwargs.get("k", cfg.get("k")) if isinstance(kwargs, dict) else None
        if isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= d_sae:
            raise ValueError(f"{cfg_path}: topk k = {k!r}, expected 1..d_sae ({d_sae})")
    if cfg.get("normalize_activations", "none") not in ("none", None):
        raise ValueError(f"{cfg_path}: normalize_activations "
                         f"{cfg['normalize_activations']!r} is not supported (only \"none\")")
    if cfg.get("hook_head_index") is not None:
        raise ValueError(f"{cfg_path}: hook_head_index {cfg['hook_head_index']!r} is not supported")
    if cfg.get("finetuning_scaling_factor"):
        raise ValueError(f"{cfg_path}: finetuning_scaling_factor is not supported")
    apply = cfg.get("apply_b_dec_to_input")
    if not isinstance(apply, bool):
        raise ValueError(f"{cfg_path}: apply_b_dec_to_input = {apply!r}, expected true or false")
    if hook is None:
        hook = cfg.get("hook_name")
        if hook is None:
            raise ValueError(f"{cfg_path}: no hook_name (give one: PATH@HOOK)")
        _, layer = parse_hook(hook)
        if "hook_layer" in cfg and cfg["hook_layer"] != layer:
            raise ValueError(f"{cfg_path}: hook_layer {cfg['hook_layer']!r} disagrees with "
                             f"hook_name {hook}")
    else:
        parse_hook(hook)
    tensors, dtypes = read_safetensors_strict(os.path.join(path, "sae_weights.safetensors"))
    want = (*TENSORS, "threshold") if arch == "jumprelu" else TENSORS
    _check_shapes(path, tensors, d_in, d_sae, want)
    stored = set(dtypes.values())
    cfg_dtype = str(cfg.get("dtype", ""))
    cfg_dtype = _CFG_DTYPES.get(cfg_dtype[6:] if cfg_dtype.startswith("torch.") else cfg_dtype)
    if cfg_dtype is None or stored != {cfg_dtype}:
        raise ValueError(f"{cfg_path}: dtype {cfg.get('dtype')!r} but the tensors are "
                         f"{sorted(stored)}")
    return SAE(tensors, arch, k, apply, hook, cfg_dtype, "saelens")


def load_sae(path, hook=None):
    if os.path.isdir(path):
        return _load_saelens(path, hook)
    if path.endswith(".npz"):
        return _load_npz(path, hook)
    raise ValueError(f"{path}: neither a SAELens directory nor a Gemma Scope .npz")


def _f64(x):
    return x.to(torch.float64) if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x, np.float64))


def pre_activations(sae, x):
    x = _f64(x)
    if x.shape[-1] != sae.d_in:
        raise ValueError(f"input width {x.shape[-1]}, the SAE reads {sae.d_in}")
    if sae.apply_b_dec_to_input:
        x = x - sae.b_dec
    return x @ sae.W_enc + sae.b_enc


def encode(sae, x):
    pre = pre_activations(sae, x)
    if sae.architecture == "standard":
        return torch.relu(pre)
    if sae.architecture == "jumprelu":
        return torch.where(pre > sae.threshold, torch.relu(pre), torch.zeros_like(pre))
    if sae.architecture == "topk":
        # stable descending sort: equal values keep index order, so ties go to the lower index
        idx = torch.sort(pre, dim=-1, descending=True, stable=True).indices[..., :sae.k]
        f = torch.zeros_like(pre)
        return f.scatter(-1, idx, torch.relu(pre.gather(-1, idx)))
    raise ValueError(f"architecture {sae.architecture}")


def decode(sae, f):
    f = _f64(f)
    if f.shape[-1] != sae.d_sae:
        raise ValueError(f"feature width {f.shape[-1]}, the SAE has {sae.d_sae}")
    return f @ sae.W_dec + sae.b_dec
