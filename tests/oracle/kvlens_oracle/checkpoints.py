"""Readers for llama2.c checkpoints (.bin) and safetensors files, pure numpy."""
import json
import struct

import numpy as np

from .gguf import bf16_to_f32

LLAMA2C_HEADER = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")


def read_llama2c(path):
    """Returns (header dict, tensors dict of float64 arrays in llama2.c's order and shapes).

    Seven int32 header fields; a negative vocab_size means an untied classifier
    `wcls` [vocab, dim] follows the RoPE tables at the end.
    """
    with open(path, "rb") as f:
        buf = f.read()
    hdr = dict(zip(LLAMA2C_HEADER, struct.unpack_from("<7i", buf, 0)))
    shared = hdr["vocab_size"] > 0
    hdr["vocab_size"] = abs(hdr["vocab_size"])
    d, hid, L = hdr["dim"], hdr["hidden_dim"], hdr["n_layers"]
    V, hs = hdr["vocab_size"], hdr["dim"] // hdr["n_heads"]
    kv = hdr["n_kv_heads"] * hs
    layout = [("token_embedding", [V, d]), ("rms_att", [L, d]), ("wq", [L, d, d]),
              ("wk", [L, kv, d]), ("wv", [L, kv, d]), ("wo", [L, d, d]),
              ("rms_ffn", [L, d]), ("w1", [L, hid, d]), ("w2", [L, d, hid]),
              ("w3", [L, hid, d]), ("rms_final", [d]),
              ("freq_cis", [hdr["seq_len"], hs])]  # unused RoPE tables (real + imag halves)
    if not shared:
        layout.append(("wcls", [V, d]))
    out, off = {}, 28
    for name, shape in layout:
        n = int(np.prod(shape))
        out[name] = np.frombuffer(buf, "<f4", n, off).astype(np.float64).reshape(shape)
        off += 4 * n
    if off != len(buf):
        raise ValueError(f"{path}: expected {off} bytes from the header, file has {len(buf)}")
    del out["freq_cis"]
    out["wcls"] = out.get("wcls", out["token_embedding"])
    return hdr, out


_ST_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}


def read_safetensors(path):
    """8-byte LE header length, JSON header {name: {dtype, shape, data_offsets}}, data."""
    with open(path, "rb") as f:
        buf = f.read()
    (n,) = struct.unpack_from("<Q", buf, 0)
    header = json.loads(buf[8:8 + n])
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = buf[base + begin:base + end]
        if info["dtype"] == "BF16":
            arr = bf16_to_f32(np.frombuffer(raw, "<u2"))
        elif info["dtype"] in _ST_DTYPES:
            arr = np.frombuffer(raw, _ST_DTYPES[info["dtype"]])
        else:
            raise NotImplementedError(f"safetensors dtype {info['dtype']} ({name})")
        out[name] = arr.astype(np.float64).reshape(info["shape"])
    return out


def write_safetensors(path, tensors, dtype="F32"):
    """Writes {name: numpy array} as safetensors (F32, F16, BF16 or F64; used by tests)."""
    header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        if dtype == "BF16":  # round to nearest even on the upper 16 bits of float32
            bits = np.ascontiguousarray(arr, dtype="<f4").view("<u4")
            data = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()
        else:
            data = np.ascontiguousarray(arr, dtype=_ST_DTYPES[dtype]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    hjson = json.dumps(header).encode()
    hjson += b" " * (-len(hjson) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)) + hjson + b"".join(blobs))
