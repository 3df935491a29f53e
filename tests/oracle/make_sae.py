#!/usr/bin/python3
"""Writes a random sparse autoencoder (SAE) for kvlens's SAE tests, in either on-disk format
interpretability users load: a SAELens directory (cfg.json + sae_weights.safetensors) or a
Google Gemma Scope params.npz. The oracle computes its features with
kvlens_oracle/sae.py (oracle.py --sae PATH[@HOOK]).

    /usr/bin/python3 tests/oracle/make_sae.py --format saelens --out DIR --d-in 192 \\
        --hook blocks.2.hook_resid_post [--d-sae 768] [--architecture standard|jumprelu|topk]
        [--k 8] [--apply-b-dec-to-input 0|1] [--dtype f32|f16|bf16] [--seed 0] [--scale 1]
    /usr/bin/python3 tests/oracle/make_sae.py --format npz --out FILE.npz --d-in 192 [--d-sae M]
        [--seed S] [--scale X]
    /usr/bin/python3 tests/oracle/make_sae.py --format npz --out FILE.npz --same-as SAELENS_DIR
    /usr/bin/python3 tests/oracle/make_sae.py --format saelens --out DIR --same-as FILE.npz \\
        --hook blocks.2.hook_resid_post [--dtype f32|f16|bf16]
    /usr/bin/python3 tests/oracle/make_sae.py --format saelens --out DIR --d-in 192 \\
        --hook blocks.2.hook_resid_post --corrupt missing-tensor

Weights (float32 from numpy's default_rng(seed), drawn in this order whatever the
architecture or dtype, so one seed gives the same values in every file):
  W_enc [d_in, d_sae] ~ N(0, 1/d_in) times --scale   b_enc [d_sae] ~ N(-0.1, 0.1^2)
  W_dec [d_sae, d_in] ~ N(0, 1/d_sae)                 b_dec [d_in]  ~ N(0, 0.1^2)
  threshold [d_sae] ~ U(0, 0.3)                       (jumprelu and npz only)
On residual-stream rows of norm about sqrt(d_in) each pre-activation is then about
N(-0.1, 1): roughly 45% of a standard SAE's features and 40% of a jumprelu's are active.

SAELens (--format saelens, --out a directory): cfg.json with architecture, d_in, d_sae,
hook_name, hook_layer, apply_b_dec_to_input (default true for standard / topk, false for
jumprelu), normalize_activations "none", activation_fn_str ("relu"; "topk" for topk),
activation_fn_kwargs ({"k": K} for topk), dtype (float32 / float16 / bfloat16 as stored;
bf16 is float32 rounded to nearest even), model_name "kvlens-test"; tensors W_enc, b_enc,
W_dec, b_dec (+ threshold for jumprelu). --hook is required.
Gemma Scope (--format npz, --out a file): np.savez (uncompressed, float32) of W_enc, W_dec,
b_enc, b_dec, threshold: a JumpReLU SAE that does not subtract b_dec from its input; no
hook in the file.
--same-as PATH writes the weights of an existing SAE of the other format, so both give the
same features: an npz becomes a jumprelu SAELens dir with apply_b_dec_to_input false (in
--dtype; f16 / bf16 round); a SAELens dir becomes an npz only if it does not subtract b_dec
and is jumprelu (its thresholds) or standard (thresholds 0: relu(p) = p where p > 0).
--corrupt KIND (SAELens only) writes a deliberately broken directory for the loader's error
tests: missing-tensor (no W_dec), wrong-shape (W_enc [d_in, d_sae + 1]), truncated (the
safetensors file cut short of its header's data), bad-architecture ("gated"),
bad-normalize ("expected_average_only_in"), no-hook (cfg without hook_name).
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CORRUPTIONS = ("missing-tensor", "wrong-shape", "truncated", "bad-architecture",
               "bad-normalize", "no-hook")
DTYPES = {"f32": ("F32", "float32"), "f16": ("F16", "float16"), "bf16": ("BF16", "bfloat16")}
ORDER = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")


def f32_to_bf16_bits(a):
    """float32 -> bfloat16 bit patterns (uint16): the top 16 bits, rounded to nearest even."""
    bits = np.ascontiguousarray(a, dtype="<f4").view("<u4").astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")


def tensor_bytes(arr, dtype):
    """Little-endian bytes of arr in safetensors dtype F32 / F16 / BF16."""
    if dtype == "BF16":
        return f32_to_bf16_bits(arr).tobytes()
    return np.ascontiguousarray(arr, dtype={"F32": "<f4", "F16": "<f2"}[dtype]).tobytes()


def write_safetensors(path, tensors, dtype="F32"):
    """{name: array} in order -> safetensors: 8-byte LE header length, JSON header
    {name: {dtype, shape, data_offsets}, "__metadata__": {"format": "pt"}} (space-padded to
    a multiple of 8), then the tensors' data back to back."""
    header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        data = tensor_bytes(arr, dtype)
        header[name] = {"dtype": dtype, "shape": list(np.shape(arr)), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    header["__metadata__"] = {"format": "pt"}
    hjson = json.dumps(header).encode()
    hjson += b" " * (-len(hjson) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)) + hjson + b"".join(blobs))


def saelens_cfg(architecture, d_in, d_sae, hook_name, apply_b_dec_to_input, dtype="f32", k=None):
    from kvlens_oracle.sae import parse_hook
    return {
        "architecture": architecture,
        "d_in": d_in,
        "d_sae": d_sae,
        "hook_name": hook_name,
        "hook_layer": parse_hook(hook_name)[1],
        "hook_head_index": None,
        "apply_b_dec_to_input": bool(apply_b_dec_to_input),
        "normalize_activations": "none",
        "activation_fn_str": "topk" if architecture == "topk" else "relu",
        "activation_fn_kwargs": {"k": k} if architecture == "topk" else {},
        "finetuning_scaling_factor": False,
        "dtype": DTYPES[dtype][1],
        "model_name": "kvlens-test",
    }


def write_saelens(directory, tensors, cfg, dtype="f32"):
    """tensors: {name: float32 array}, written in ORDER; cfg: saelens_cfg(...)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "cfg.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    ordered = {n: tensors[n] for n in ORDER if n in tensors}
    write_safetensors(os.path.join(directory, "sae_weights.safetensors"), ordered, DTYPES[dtype][0])


def write_npz(path, tensors):
    """Gemma Scope params.npz: np.savez (uncompressed) of the five float32 arrays."""
    with open(path, "wb") as f:  # a file object, so numpy adds no ".npz" to the name
        np.savez(f, **{n: np.asarray(tensors[n], np.float32)
                       for n in ("W_enc", "W_dec", "b_enc", "b_dec", "threshold")})


def random_sae(d_in, d_sae, seed=0, scale=1.0):
    """The five float32 arrays (see the module docstring for the distributions)."""
    rng = np.random.default_rng(seed)
    t = {
        "W_enc": rng.normal(0.0, 1.0 / np.sqrt(d_in), (d_in, d_sae)) * scale,
        "b_enc": rng.normal(-0.1, 0.1, d_sae),
        "W_dec": rng.normal(0.0, 1.0 / np.sqrt(d_sae), (d_sae, d_in)),
        "b_dec": rng.normal(0.0, 0.1, d_in),
        "threshold": rng.uniform(0.0, 0.3, d_sae),
    }
    return {k: v.astype(np.float32) for k, v in t.items()}


def _corrupt(directory, kind, tensors, cfg, dtype, rng):
    if kind == "missing-tensor":
        tensors = {k: v for k, v in tensors.items() if k != "W_dec"}
    elif kind == "wrong-shape":
        extra = rng.normal(0.0, 1.0, (tensors["W_enc"].shape[0], 1)).astype(np.float32)
        tensors = dict(tensors, W_enc=np.concatenate([tensors["W_enc"], extra], axis=1))
    elif kind == "bad-architecture":
        cfg = dict(cfg, architecture="gated")
    elif kind == "bad-normalize":
        cfg = dict(cfg, normalize_activations="expected_average_only_in")
    elif kind == "no-hook":
        cfg = {k: v for k, v in cfg.items() if k != "hook_name"}
    write_saelens(directory, tensors, cfg, dtype)
    if kind == "truncated":
        path = os.path.join(directory, "sae_weights.safetensors")
        with open(path, "rb") as f:
            buf = f.read()
        (n,) = struct.unpack_from("<Q", buf, 0)
        cut = 8 + n + (len(buf) - 8 - n) // 2  # half the data: the header stays whole
        with open(path, "wb") as f:
            f.write(buf[:cut])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", required=True, choices=("saelens", "npz"))
    ap.add_argument("--out", required=True, help="a directory (saelens) or a file (npz)")
    ap.add_argument("--d-in", type=int, help="input width (the hook's; required unless --same-as)")
    ap.add_argument("--d-sae", type=int, help="number of features (default 4 x d_in)")
    ap.add_argument("--hook", help="TransformerLens hook name, e.g. blocks.2.hook_resid_post "
                                   "(saelens; required there)")
    ap.add_argument("--architecture", choices=("standard", "jumprelu", "topk"),
                    help="saelens (default standard); npz is always jumprelu")
    ap.add_argument("--k", type=int, help="topk: features kept per row (required for topk)")
    ap.add_argument("--apply-b-dec-to-input", type=int, choices=(0, 1),
                    help="saelens: subtract b_dec from the input (default 1 for standard / "
                         "topk, 0 for jumprelu)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), help="saelens tensors (default f32); npz is f32")
    ap.add_argument("--seed", type=int, help="default 0")
    ap.add_argument("--scale", type=float, help="multiplies W_enc (default 1)")
    ap.add_argument("--same-as", metavar="PATH", help="copy the weights of an SAE of the other format")
    ap.add_argument("--corrupt", choices=CORRUPTIONS, help="saelens: write a broken directory")
    a = ap.parse_args(argv)

    if a.k is not None and a.k <= 0:
        ap.error("--k must be positive")
    if a.format == "npz":
        for flag, value in (("--hook", a.hook), ("--k", a.k), ("--corrupt", a.corrupt),
                            ("--apply-b-dec-to-input", a.apply_b_dec_to_input)):
            if value is not None:
                ap.error(f"{flag} is for --format saelens (npz: jumprelu, b_dec not subtracted, no hook)")
        if a.architecture not in (None, "jumprelu"):
            ap.error("--format npz is always jumprelu")
        if a.dtype not in (None, "f32"):
            ap.error("--format npz is always f32")
    elif not a.hook:
        ap.error("--format saelens needs --hook")
    dtype = a.dtype or "f32"

    if a.same_as:
        from kvlens_oracle.sae import load_sae
        for flag, value in (("--seed", a.seed), ("--scale", a.scale), ("--corrupt", a.corrupt)):
            if value is not None:
                ap.error(f"{flag} does not go with --same-as")
        src = load_sae(a.same_as, hook=a.hook if a.same_as.endswith(".npz") else None)
        want_fmt = "npz" if a.format == "saelens" else "saelens"
        if src.format != want_fmt:
            ap.error(f"--same-as takes an SAE of the other format ({want_fmt}), got {src.format}")
        for flag, value, have in (("--d-in", a.d_in, src.d_in), ("--d-sae", a.d_sae, src.d_sae)):
            if value is not None and value != have:
                ap.error(f"{flag} {value}, but {a.same_as} has {have}")
        t = {n: getattr(src, n).numpy().astype(np.float32) for n in ORDER if getattr(src, n) is not None}
        if a.format == "saelens":  # from npz
            if a.architecture not in (None, "jumprelu") or a.apply_b_dec_to_input == 1 or a.k is not None:
                ap.error("an npz copies as jumprelu with apply_b_dec_to_input 0")
            write_saelens(a.out, t, saelens_cfg("jumprelu", src.d_in, src.d_sae, a.hook, False, dtype), dtype)
        else:
            if src.apply_b_dec_to_input or src.architecture not in ("jumprelu", "standard"):
                ap.error(f"{a.same_as}: an npz cannot say the same as a {src.architecture} SAE "
                         f"with apply_b_dec_to_input {src.apply_b_dec_to_input} (needs jumprelu "
                         "or standard, apply_b_dec_to_input false)")
            if src.architecture == "standard":
                t["threshold"] = np.zeros(src.d_sae, np.float32)
            write_npz(a.out, t)
        return 0

    if a.d_in is None or a.d_in <= 0:
        ap.error("--d-in N (positive) is required")
    d_sae = a.d_sae if a.d_sae is not None else 4 * a.d_in
    if d_sae <= 0:
        ap.error("--d-sae must be positive")
    seed = 0 if a.seed is None else a.seed
    t = random_sae(a.d_in, d_sae, seed, 1.0 if a.scale is None else a.scale)
    if a.format == "npz":
        write_npz(a.out, t)
        return 0

    arch = a.architecture or "standard"
    if arch == "topk":
        if a.k is None or a.k > d_sae:
            ap.error(f"topk needs --k between 1 and d_sae ({d_sae})")
    elif a.k is not None:
        ap.error("--k is for --architecture topk")
    if arch != "jumprelu":
        del t["threshold"]
    apply = a.apply_b_dec_to_input if a.apply_b_dec_to_input is not None else int(arch != "jumprelu")
    try:
        cfg = saelens_cfg(arch, a.d_in, d_sae, a.hook, apply, dtype, a.k)
    except ValueError as e:
        ap.error(str(e))
    if a.corrupt:
        _corrupt(a.out, a.corrupt, t, cfg, dtype, np.random.default_rng(seed + 1))
    else:
        write_saelens(a.out, t, cfg, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
