"""ggml's block quantisations in numpy: decoding (float64, exact) and a simple encoder.

Types: q8_0, q4_0, q4_1, q5_0, q5_1, the k-quants q2_K … q6_K, and the 4-bit non-linear
iq4_nl and iq4_xs.

Block layouts as ggml-common.h defines them; this module is written from those layouts,
independently of kvlens' C++ decoder (kernels/ggml_quants.h). `decode` returns each
element's exact value (every product here is exact in float64), which ggml's float
decoder rounds once: tests/oracle/test_ggml_quants.py checks float32(decode) against
ggml's own output (tests/kernels/testdata/ggml_quants.bin).

`encode` is a plain round-to-nearest quantiser (per sub-block scale and min, the scales
quantised against the super-block's), good enough to build test models; it is not ggml's
error-minimising search.
"""
import numpy as np

# name: (ggml type id, elements a block, bytes a block)
TYPES = {
    "Q8_0": (8, 32, 34),
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q2_K": (10, 256, 84),
    "Q3_K": (11, 256, 110),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
    "IQ4_NL": (20, 32, 18),
    "IQ4_XS": (23, 256, 136),
}
# The 16 values an IQ4_NL or IQ4_XS nibble selects (ggml-common.h's kvalues_iq4nl).
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10,
                       1, 13, 25, 38, 53, 69, 89, 113], np.int64)
BY_ID = {v[0]: k for k, v in TYPES.items()}


def _half(raw, at):
    return raw[:, at:at + 2].copy().view("<f2")[:, 0].astype(np.float64)


def _bits(byte_array, shift, width):
    return ((byte_array.astype(np.int64) >> shift) & ((1 << width) - 1))


def _unpack_k4_scales(s):
    """q4_K / q5_K: 12 bytes -> (scales [n, 8], mins [n, 8]), 6 bits each."""
    s = s.astype(np.int64)
    sc = np.empty((len(s), 8), np.int64)
    mn = np.empty((len(s), 8), np.int64)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def _pack_k4_scales(sc, mn):
    s = np.zeros((len(sc), 12), np.int64)
    s[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    s[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    return s.astype(np.uint8)


def _unpack_q3_scales(p):
    """q3_K: 12 bytes -> 16 signed scales (6 bits, biased by 32)."""
    p = p.astype(np.int64)
    j = np.arange(16)
    low = np.where(j < 8, p[:, j % 8] & 0xF, p[:, j % 8] >> 4)
    high = (p[:, 8 + j % 4] >> (2 * (j // 4))) & 3
    return (low | (high << 4)) - 32


def _pack_q3_scales(sc):
    u = (sc + 32).astype(np.int64)
    p = np.zeros((len(sc), 12), np.int64)
    p[:, 0:8] = (u[:, 0:8] & 0xF) | ((u[:, 8:16] & 0xF) << 4)
    for j in range(16):
        p[:, 8 + j % 4] |= ((u[:, j] >> 4) & 3) << (2 * (j // 4))
    return p.astype(np.uint8)


def _k_index():
    """For the 2-bit k-quant layout (q2_K, q3_K): element e of a super-block is bits
    2*shift of qs byte 32*half + 16*h + l, where e = 128*half + 32*shift + 16*h + l."""
    e = np.arange(256)
    half, shift, h, l = e // 128, (e // 32) % 4, (e // 16) % 2, e % 16
    return 32 * half + 16 * h + l, 2 * shift, 16 * h + l, 4 * half + shift


def _q6_index():
    """q6_K: element e = 128*n + 32*k + l -> (ql byte, ql shift, qh byte, qh shift)."""
    e = np.arange(256)
    n, k, l = e // 128, (e // 32) % 4, e % 32
    ql = 64 * n + l + 32 * (k % 2)
    return ql, 4 * (k // 2), 32 * n + l, 2 * k


def decode(raw, kind, count):
    """bytes -> float64 array of `count` elements (exact values)."""
    _, elems, nbytes = TYPES[kind]
    if count % elems:
        raise ValueError(f"{kind} tensor size {count} not a multiple of {elems}")
    b = np.frombuffer(raw, np.uint8, count // elems * nbytes).reshape(-1, nbytes)
    if kind == "Q8_0":
        return (_half(b, 0)[:, None] * b[:, 2:].view(np.int8)).reshape(-1)
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        has_min, five = kind.endswith("_1"), kind.startswith("Q5")
        d = _half(b, 0)
        m = _half(b, 2) if has_min else 0.0
        qs = b[:, (4 if has_min else 2) + (4 if five else 0):]
        q = np.concatenate([_bits(qs, 0, 4), _bits(qs, 4, 4)], axis=1)
        if five:
            qh = b[:, (4 if has_min else 2):][:, :4].copy().view("<u4")[:, 0].astype(np.int64)
            q |= ((qh[:, None] >> np.arange(32)) & 1) << 4
        if has_min:
            return (q * d[:, None] + m[:, None]).reshape(-1)
        return ((q - (16 if five else 8)) * d[:, None]).reshape(-1)
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _half(b, 0), _half(b, 2)
        sc, mn = _unpack_k4_scales(b[:, 4:16])
        qs = b[:, 48:] if kind == "Q5_K" else b[:, 16:]
        e = np.arange(256)
        q = _bits(qs[:, 32 * (e // 64) + e % 32], 4 * ((e // 32) % 2), 4)
        if kind == "Q5_K":
            q |= _bits(b[:, 16:48][:, e % 32], e // 32, 1) << 4
        j = e // 32
        return ((d[:, None] * sc[:, j]) * q - dmin[:, None] * mn[:, j]).reshape(-1)
    if kind in ("Q2_K", "Q3_K"):
        byte, shift, hbyte, hbit = _k_index()
        j = np.arange(256) // 16
        if kind == "Q2_K":
            s, qs = b[:, 0:16], b[:, 16:80]
            d, dmin = _half(b, 80), _half(b, 82)
            q = _bits(qs[:, byte], shift, 2)
            return ((d[:, None] * _bits(s[:, j], 0, 4)) * q
                    - dmin[:, None] * _bits(s[:, j], 4, 4)).reshape(-1)
        hm, qs, d = b[:, 0:32], b[:, 32:96], _half(b, 108)
        sc = _unpack_q3_scales(b[:, 96:108])
        q = _bits(qs[:, byte], shift, 2) - 4 * (1 - _bits(hm[:, hbyte], hbit, 1))
        return ((d[:, None] * sc[:, j]) * q).reshape(-1)
    if kind == "Q6_K":
        ql_at, ql_shift, qh_at, qh_shift = _q6_index()
        q = _bits(b[:, ql_at], ql_shift, 4) | (_bits(b[:, 128 + qh_at], qh_shift, 2) << 4)
        sc = b[:, 192:208].view(np.int8).astype(np.int64)
        d = _half(b, 208)
        return ((d[:, None] * sc[:, np.arange(256) // 16]) * (q - 32)).reshape(-1)
    if kind == "IQ4_NL":
        qs = b[:, 2:18]
        idx = np.concatenate([_bits(qs, 0, 4), _bits(qs, 4, 4)], axis=1)
        return (_half(b, 0)[:, None] * IQ4_VALUES[idx]).reshape(-1)
    if kind == "IQ4_XS":
        scales_h = b[:, 2].astype(np.int64) | (b[:, 3].astype(np.int64) << 8)
        j = np.arange(8)
        low = _bits(b[:, 4 + j // 2], 4 * (j % 2), 4)
        sc = (low | (((scales_h[:, None] >> (2 * j)) & 3) << 4)) - 32
        qs = b[:, 8:].reshape(-1, 8, 16)
        idx = np.concatenate([_bits(qs, 0, 4), _bits(qs, 4, 4)], axis=2)
        return ((_half(b, 0)[:, None] * sc)[:, :, None] * IQ4_VALUES[idx]).reshape(-1)
    raise ValueError(kind)


def _f16(x):
    return np.asarray(x, np.float64).astype(np.float16)


def _safe(x):
    return np.where(x == 0, 1.0, x)


def encode(values, kind):
    """float array (size a multiple of the block) -> bytes, by round to nearest."""
    _, elems, nbytes = TYPES[kind]
    x = np.asarray(values, np.float64).reshape(-1, elems)
    n = len(x)
    out = np.zeros((n, nbytes), np.uint8)

    def put_half(at, h):
        out[:, at:at + 2] = np.asarray(h, np.float16).reshape(-1, 1).view(np.uint8)

    if kind == "Q8_0":
        d = _f16(np.abs(x).max(1) / 127)
        q = np.clip(np.round(x / _safe(d.astype(np.float64))[:, None]), -127, 127)
        put_half(0, d)
        out[:, 2:] = q.astype(np.int8).view(np.uint8)
    elif kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        has_min, five = kind.endswith("_1"), kind.startswith("Q5")
        top = 31 if five else 15
        if has_min:
            lo, hi = x.min(1), x.max(1)
            d, m = _f16((hi - lo) / top), _f16(lo)
            q = np.round((x - m.astype(np.float64)[:, None]) / _safe(d.astype(np.float64))[:, None])
            put_half(2, m)
        else:
            d = _f16(np.abs(x).max(1) / (top // 2))
            q = np.round(x / _safe(d.astype(np.float64))[:, None]) + (top + 1) // 2
        q = np.clip(q, 0, top).astype(np.int64)
        put_half(0, d)
        qs_at = (4 if has_min else 2) + (4 if five else 0)
        out[:, qs_at:qs_at + 16] = (q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)
        if five:
            qh = ((q >> 4) << np.arange(32)).sum(1).astype("<u4")
            out[:, qs_at - 4:qs_at] = qh.reshape(-1, 1).view(np.uint8)
    elif kind in ("Q4_K", "Q5_K", "Q2_K"):
        sub = 16 if kind == "Q2_K" else 32
        top = {"Q2_K": 3, "Q4_K": 15, "Q5_K": 31}[kind]
        stop = 15 if kind == "Q2_K" else 63
        xs = x.reshape(n, -1, sub)
        lo = np.minimum(xs.min(2), 0)
        scale, mins = (xs.max(2) - lo) / top, -lo
        d, dmin = _f16(scale.max(1) / stop), _f16(mins.max(1) / stop)
        sc = np.clip(np.round(scale / _safe(d.astype(np.float64))[:, None]), 0, stop).astype(np.int64)
        mn = np.clip(np.round(mins / _safe(dmin.astype(np.float64))[:, None]), 0, stop).astype(np.int64)
        d1 = d.astype(np.float64)[:, None] * sc
        m1 = dmin.astype(np.float64)[:, None] * mn
        q = np.clip(np.round((xs + m1[:, :, None]) / _safe(d1)[:, :, None]), 0, top)
        q = q.astype(np.int64).reshape(n, 256)
        if kind == "Q2_K":
            out[:, 0:16] = sc | (mn << 4)
            byte, shift, _, _ = _k_index()
            for e in range(256):
                out[:, 16 + byte[e]] |= (q[:, e] << shift[e]).astype(np.uint8)
            put_half(80, d)
            put_half(82, dmin)
        else:
            put_half(0, d)
            put_half(2, dmin)
            out[:, 4:16] = _pack_k4_scales(sc, mn)
            qs_at = 48 if kind == "Q5_K" else 16
            e = np.arange(256)
            for p in range(4):
                lo_e, hi_e = 64 * p + np.arange(32), 64 * p + 32 + np.arange(32)
                out[:, qs_at + 32 * p:qs_at + 32 * p + 32] = (q[:, lo_e] & 0xF) | ((q[:, hi_e] & 0xF) << 4)
            if kind == "Q5_K":
                for j in range(8):
                    out[:, 16:48] |= (((q[:, 32 * j:32 * j + 32] >> 4) & 1) << j).astype(np.uint8)
    elif kind in ("Q3_K", "Q6_K"):
        qmax = 4 if kind == "Q3_K" else 32
        smax = 31 if kind == "Q3_K" else 127
        xs = x.reshape(n, 16, 16)
        # Signed, as ggml's: the sub-block's largest magnitude maps to −qmax, the far end
        # of the asymmetric range [−qmax, qmax − 1].
        peak = np.take_along_axis(xs, np.abs(xs).argmax(2)[:, :, None], 2)[:, :, 0]
        scale = -peak / qmax
        d = _f16(np.abs(scale).max(1) / smax)
        sc = np.clip(np.round(scale / _safe(d.astype(np.float64))[:, None]), -smax - 1, smax)
        sc = sc.astype(np.int64)
        d1 = d.astype(np.float64)[:, None] * sc
        q = np.clip(np.round(xs / _safe(d1)[:, :, None]), -qmax, qmax - 1).astype(np.int64)
        q = q.reshape(n, 256)
        if kind == "Q3_K":
            byte, shift, hbyte, hbit = _k_index()
            for e in range(256):
                out[:, 32 + byte[e]] |= ((q[:, e] & 3) << shift[e]).astype(np.uint8)
                out[:, hbyte[e]] |= ((q[:, e] >= 0).astype(np.int64) << hbit[e]).astype(np.uint8)
            out[:, 96:108] = _pack_q3_scales(sc)
            put_half(108, d)
        else:
            u = q + 32
            ql_at, ql_shift, qh_at, qh_shift = _q6_index()
            for e in range(256):
                out[:, ql_at[e]] |= ((u[:, e] & 0xF) << ql_shift[e]).astype(np.uint8)
                out[:, 128 + qh_at[e]] |= ((u[:, e] >> 4) << qh_shift[e]).astype(np.uint8)
            out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
            put_half(208, d)
    elif kind in ("IQ4_NL", "IQ4_XS"):
        # Per 32 elements, the scale that maps the largest magnitude onto the table's −127;
        # IQ4_XS stores those as 6-bit multiples (−31 … 31) of one f16 per super-block.
        xs = x.reshape(n, -1, 32)
        peak = np.take_along_axis(xs, np.abs(xs).argmax(2)[:, :, None], 2)[:, :, 0]
        if kind == "IQ4_NL":
            d = _f16(peak[:, 0] / -127)
            dl = d.astype(np.float64)[:, None]
            put_half(0, d)
        else:
            d = _f16(np.abs(peak / 127).max(1) / 31)
            sc = np.clip(np.round(-peak / 127 / _safe(d.astype(np.float64))[:, None]), -31, 31)
            sc = sc.astype(np.int64)
            dl = d.astype(np.float64)[:, None] * sc
            put_half(0, d)
            u = sc + 32
            h = ((u >> 4) << (2 * np.arange(8))).sum(1)
            out[:, 2], out[:, 3] = h & 0xFF, h >> 8
            out[:, 4:8] = (u[:, 0::2] & 0xF) | ((u[:, 1::2] & 0xF) << 4)
        t = xs / _safe(dl)[:, :, None]
        q = np.abs(t[..., None] - IQ4_VALUES).argmin(-1)  # the nearest table value
        packed = (q[:, :, :16] | (q[:, :, 16:] << 4)).astype(np.uint8).reshape(n, -1)
        at = 2 if kind == "IQ4_NL" else 8
        out[:, at:] = packed
    else:
        raise ValueError(kind)
    return out.tobytes()
