"""GGUF (v2/v3) reader: metadata and tensors, in pure Python + numpy.

Layout (little-endian): b"GGUF", uint32 version, uint64 n_tensors, uint64 n_kv,
then n_kv (key, type, value) records, then n_tensors tensor infos
(name, uint32 n_dims, n_dims x uint64 ne, uint32 ggml_type, uint64 offset),
then padding to `general.alignment` (default 32) and the tensor data.
ggml's `ne` lists dimensions innermost-first, so ne=[64, 512] is a numpy [512, 64].
"""
import struct

import numpy as np

from kvlens_oracle import ggml_quants

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f",
            7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

GGML_F32, GGML_F16, GGML_Q8_0, GGML_BF16 = 0, 1, 8, 30
_TYPE_NAMES = {GGML_F32: "F32", GGML_F16: "F16", GGML_BF16: "BF16", **ggml_quants.BY_ID}


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt):
        vals = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return vals[0] if len(vals) == 1 else vals

    def string(self):
        n = self.unpack("<Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="surrogateescape")
        self.pos += n
        return s

    def value(self, vtype):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.unpack("<I"), self.unpack("<Q")
            if etype in _SCALARS and etype != 7:
                dt = np.dtype(_SCALARS[etype])
                arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos)
                self.pos += n * dt.itemsize
                return arr.tolist()
            return [self.value(etype) for _ in range(n)]
        raise ValueError(f"unknown GGUF value type {vtype}")


def bf16_to_f32(raw_u16):
    return (raw_u16.astype(np.uint32) << 16).view(np.float32)


def _decode(buf, offset, ggml_type, count):
    if ggml_type == GGML_F32:
        return np.frombuffer(buf, "<f4", count, offset).astype(np.float64)
    if ggml_type == GGML_F16:
        return np.frombuffer(buf, "<f2", count, offset).astype(np.float64)
    if ggml_type == GGML_BF16:
        return bf16_to_f32(np.frombuffer(buf, "<u2", count, offset)).astype(np.float64)
    if ggml_type in ggml_quants.BY_ID:
        kind = ggml_quants.BY_ID[ggml_type]
        _, elems, nbytes = ggml_quants.TYPES[kind]
        return ggml_quants.decode(buf[offset:offset + count // elems * nbytes], kind, count)
    raise NotImplementedError(f"ggml tensor type {ggml_type} not supported by the oracle")


class GGUFFile:
    """metadata: dict key -> value; tensors: dict name -> float64 numpy array."""

    def __init__(self, path):
        with open(path, "rb") as f:
            buf = f.read()
        cur = _Cursor(buf)
        if cur.unpack("<4s") != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        self.version = cur.unpack("<I")
        if self.version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {self.version} not supported")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        self.metadata = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            ndim = cur.unpack("<I")
            ne = [cur.unpack("<Q") for _ in range(ndim)]
            infos.append((name, ne, cur.unpack("<I"), cur.unpack("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = (cur.pos + align - 1) // align * align
        self.tensors, self.tensor_types = {}, {}
        for name, ne, ggml_type, off in infos:
            count = int(np.prod(ne)) if ne else 1
            flat = _decode(buf, data_start + off, ggml_type, count)
            self.tensors[name] = flat.reshape(list(reversed(ne)))
            self.tensor_types[name] = _TYPE_NAMES.get(ggml_type, str(ggml_type))
