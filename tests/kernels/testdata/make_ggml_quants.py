#!/usr/bin/env python3
"""Writes ggml_quants.bin: blocks of every ggml block type kvlens decodes, and the floats
ggml itself decodes them to, for tests/kernels/ggml_quants_test.cc and the oracle's tests.

ggml is the oracle: its libggml-base.so quantises and dequantises (quantize_row_*_ref,
dequantize_row_*). Types are appended at the end of TYPES, so that the entries of the
older ones (and the random draws that made them) stay as they were. No Debian package carries it; the npm registry does, in node-llama-cpp's
prebuilt binaries (MIT):

    npm pack @node-llama-cpp/linux-x64@3.22.1 && tar xzf node-llama-cpp-linux-x64-3.22.1.tgz
    /usr/bin/python3 tests/kernels/testdata/make_ggml_quants.py \\
        --ggml package/bins/linux-x64/libggml-base.so --out tests/kernels/testdata/ggml_quants.bin

Per type, three cases of 1024 elements: ggml's quantisation of normal data, of data with
large outliers, and random bytes (every quant pattern; f16 scales of random sign and
exponent, subnormals included, never inf or NaN).

File (little-endian): magic b"KVGGMLQ1", uint32 entry count; per entry: uint32 name length,
name (e.g. "q4_K/normal"), uint32 ggml type id, uint32 element count, uint32 byte count,
the blocks, then element count float32 values.
"""
import argparse
import ctypes
import struct

import numpy as np

# name: (ggml type id, elements a block, bytes a block, offsets of the f16 fields)
TYPES = {
    "q8_0": (8, 32, 34, [0]),
    "q4_0": (2, 32, 18, [0]),
    "q4_1": (3, 32, 20, [0, 2]),
    "q5_0": (6, 32, 22, [0]),
    "q5_1": (7, 32, 24, [0, 2]),
    "q2_K": (10, 256, 84, [80, 82]),
    "q3_K": (11, 256, 110, [108]),
    "q4_K": (12, 256, 144, [0, 2]),
    "q5_K": (13, 256, 176, [0, 2]),
    "q6_K": (14, 256, 210, [208]),
    "iq4_nl": (20, 32, 18, [0]),
    "iq4_xs": (23, 256, 136, [0]),
}
N = 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ggml", required=True, help="path to libggml-base.so")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    lib = ctypes.CDLL(args.ggml)
    rng = np.random.default_rng(20261130)
    entries = []
    for name, (type_id, elems, nbytes, halves) in TYPES.items():
        assert lib.ggml_blck_size(type_id) == elems, name
        lib.ggml_type_size.restype = ctypes.c_size_t
        assert lib.ggml_type_size(type_id) == nbytes, name
        quantize = getattr(lib, f"quantize_row_{name}_ref")
        dequantize = getattr(lib, f"dequantize_row_{name}")
        size = N // elems * nbytes
        cases = []
        normal = rng.normal(0, 0.05, N).astype(np.float32)
        outliers = normal.copy()
        outliers[rng.choice(N, 12, replace=False)] *= 40
        for case, data in (("normal", normal), ("outliers", outliers)):
            buf = ctypes.create_string_buffer(size)
            quantize(data.ctypes.data_as(ctypes.c_void_p), buf, ctypes.c_int64(N))
            cases.append((case, bytearray(buf.raw)))
        raw = bytearray(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        for b in range(N // elems):
            for at in halves:
                exp = int(rng.integers(0, 24))  # 0: subnormal; never 31 (inf, NaN)
                h = (int(rng.integers(0, 2)) << 15) | (exp << 10) | int(rng.integers(0, 1024))
                struct.pack_into("<H", raw, b * nbytes + at, h)
        cases.append(("random", raw))
        for case, blocks in cases:
            out = np.empty(N, np.float32)
            src = ctypes.create_string_buffer(bytes(blocks), size)
            dequantize(src, out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(N))
            assert np.all(np.isfinite(out)), (name, case)
            entries.append((f"{name}/{case}", type_id, bytes(blocks), out))
    with open(args.out, "wb") as f:
        f.write(b"KVGGMLQ1" + struct.pack("<I", len(entries)))
        for label, type_id, blocks, out in entries:
            lb = label.encode()
            f.write(struct.pack("<I", len(lb)) + lb)
            f.write(struct.pack("<III", type_id, N, len(blocks)) + blocks)
            f.write(out.astype("<f4").tobytes())
    print(f"wrote {len(entries)} entries to {args.out}")


if __name__ == "__main__":
    main()
