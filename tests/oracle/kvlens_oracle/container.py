"""The KVORACLE binary container (little-endian):
b"KVORACLE", uint32 version (1), uint32 n_arrays, then per array: uint32 name length,
name (utf-8), uint32 ndim, ndim x int64 dims, float64 data in row-major order."""
import struct

import numpy as np

MAGIC, VERSION = b"KVORACLE", 1


def write_container(path, arrays):
    """arrays: ordered mapping name -> array-like (converted to float64)."""
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<II", VERSION, len(arrays)))
        for name, arr in arrays.items():
            a = np.ascontiguousarray(np.asarray(arr, dtype="<f8"))
            nb = name.encode("utf-8")
            f.write(struct.pack("<I", len(nb)) + nb + struct.pack("<I", a.ndim))
            f.write(struct.pack(f"<{a.ndim}q", *a.shape))
            f.write(a.tobytes())


def read_container(path):
    with open(path, "rb") as f:
        buf = f.read()
    if buf[:8] != MAGIC:
        raise ValueError(f"{path}: bad magic")
    version, n = struct.unpack_from("<II", buf, 8)
    if version != VERSION:
        raise ValueError(f"{path}: container version {version}")
    off, out = 16, {}
    for _ in range(n):
        (ln,) = struct.unpack_from("<I", buf, off)
        name = buf[off + 4:off + 4 + ln].decode("utf-8")
        off += 4 + ln
        (ndim,) = struct.unpack_from("<I", buf, off)
        dims = struct.unpack_from(f"<{ndim}q", buf, off + 4)
        off += 4 + 8 * ndim
        count = int(np.prod(dims)) if ndim else 1
        out[name] = np.frombuffer(buf, "<f8", count, off).reshape(dims).copy()
        off += 8 * count
    if off != len(buf):
        raise ValueError(f"{path}: {len(buf) - off} trailing bytes")
    return out
