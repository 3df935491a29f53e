"""The oracle's numpy decoder of ggml's block types against ggml itself, and its encoder.

ggml's floats come from tests/kernels/testdata/ggml_quants.bin (written by
make_ggml_quants.py through libggml-base): per type, ggml's quantisation of normal data,
of data with outliers, and random blocks.
"""
import os
import struct
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvlens_oracle import ggml_quants  # noqa: E402
from oracle_fixtures import repo_root  # noqa: E402


def read_fixture():
    path = os.path.join(repo_root(), "tests", "kernels", "testdata", "ggml_quants.bin")
    with open(path, "rb") as f:
        buf = f.read()
    assert buf[:8] == b"KVGGMLQ1"
    (n,), pos, out = struct.unpack_from("<I", buf, 8), 12, []
    for _ in range(n):
        (ln,) = struct.unpack_from("<I", buf, pos)
        label = buf[pos + 4:pos + 4 + ln].decode()
        pos += 4 + ln
        type_id, count, nbytes = struct.unpack_from("<III", buf, pos)
        pos += 12
        blocks = buf[pos:pos + nbytes]
        pos += nbytes
        want = np.frombuffer(buf, "<f4", count, pos)
        pos += 4 * count
        out.append((label, type_id, count, blocks, want))
    assert pos == len(buf)
    return out


class GgmlQuantsTest(unittest.TestCase):
    def test_decode_gives_ggmls_floats(self):
        entries = read_fixture()
        self.assertEqual({ggml_quants.BY_ID[e[1]] for e in entries}, set(ggml_quants.TYPES))
        for label, type_id, count, blocks, want in entries:
            kind = ggml_quants.BY_ID[type_id]
            self.assertEqual(kind.lower(), label.split("/")[0].lower())
            got = ggml_quants.decode(blocks, kind, count)
            np.testing.assert_array_equal(got.astype(np.float32).view(np.uint32),
                                          want.view(np.uint32), err_msg=label)

    def test_encode_round_trips_within_a_quantisation_step(self):
        rng = np.random.default_rng(7)
        x = rng.normal(0, 0.05, 4096)
        # Largest error allowed, relative to the data's max: half a step, a step being the
        # block's (or sub-block's) span, at most twice the max, over the type's levels
        # (Q4_1: 2/15/2 = 0.067), plus room for the 6-bit sub-block scales; Q3_K and Q6_K
        # (signed levels −qmax … qmax − 1) may clip a full step at the far end (1/4, 1/32).
        # IQ4_NL and IQ4_XS: half the table's widest gap (24 of 127), or a value of the far
        # sign past its end (113 against 127), plus IQ4_XS's 6-bit scales.
        bound = {"Q8_0": 0.005, "Q4_0": 0.08, "Q4_1": 0.075, "Q5_0": 0.04, "Q5_1": 0.04,
                 "Q2_K": 0.35, "Q3_K": 0.28, "Q4_K": 0.08, "Q5_K": 0.05, "Q6_K": 0.035,
                 "IQ4_NL": 0.12, "IQ4_XS": 0.14}
        for kind, (_, elems, nbytes) in ggml_quants.TYPES.items():
            raw = ggml_quants.encode(x, kind)
            self.assertEqual(len(raw), x.size // elems * nbytes, kind)
            err = np.abs(ggml_quants.decode(raw, kind, x.size) - x).max() / np.abs(x).max()
            self.assertLess(err, bound[kind], kind)


if __name__ == "__main__":
    unittest.main()
