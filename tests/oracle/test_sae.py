"""Sparse autoencoders (kvlens_oracle/sae.py) and their files (make_sae.py).

Run: /usr/bin/python3 -m unittest discover -s tests/oracle -p 'test_*.py'
"""
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvlens_oracle import SpmTokenizer, load_model, read_container  # noqa: E402
import oracle_fixtures as fx  # noqa: E402

TESTDATA = fx.shared_testdata()
PROBE = fx.STORIES_PROBE
KJV_GPT2 = fx.KJV_GPT2


class SaeTest(unittest.TestCase):
    """Sparse autoencoders (kvlens_oracle/sae.py, files from make_sae.py): (a) a hand-written
    3-feature SAE's features and reconstructions in each architecture, worked out below;
    (b) a SAELens file and its --same-as Gemma Scope copy (and back) give identical
    features on a model's residual stream; (c) f16 / bf16 files hold the f32 values rounded
    as they declare (rounded here with numpy, and by torch); (d) topk keeps exactly k
    features per row, the k largest; (e) oracle.py --sae; (f) every --corrupt kind is
    refused by load_sae."""

    @classmethod
    def setUpClass(cls):
        from kvlens_oracle.attribution import activations
        cls.tmp = tempfile.TemporaryDirectory()
        cls.rows = {}  # model -> resid_post.2 rows
        if os.path.exists(os.path.join(KJV_GPT2, "config.json")):
            from kvlens_oracle.gpt2_bpe import ByteBPE
            tok = ByteBPE.from_tokenizer_json(os.path.join(KJV_GPT2, "tokenizer.json"))
            cls.gpt2_ids = tok.encode("And God said, Let there be light: and there was light.")[:12]
            cls.gpt2_acts = activations(load_model(KJV_GPT2), cls.gpt2_ids)
            cls.rows["kjv-gpt2-4l"] = cls.gpt2_acts["act.resid_post.2"]
        if TESTDATA is not None:
            d = os.path.join(TESTDATA, "stories260K")
            ids = SpmTokenizer.from_llama2c(os.path.join(d, "tok512.bin")).encode(PROBE)[:16]
            cls.rows["stories260K"] = activations(load_model(os.path.join(d, "stories260K.bin")), ids)["act.resid_post.2"]

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def path(self, name):
        return os.path.join(self.tmp.name, f"{self._testMethodName}.{name}")

    def make(self, *args):
        import make_sae
        self.assertEqual(make_sae.main([str(a) for a in args]), 0)

    def need_rows(self):
        if not self.rows:
            self.skipTest("neither models/kjv-gpt2-4l nor stories260K present")
        return self.rows

    def test_hand_written_three_features(self):
        import make_sae
        from kvlens_oracle.sae import decode, encode, load_sae
        # pre = x' @ W_enc + b_enc: pre0 = x0 + x1/2 - 1/4, pre1 = -x0 + x1 + 1/2,
        # pre2 = x0/2 - 2 x1 + 1/8, with x' = x - b_dec = (x0 - 1/2, x1 + 1/4) when b_dec is
        # subtracted. Decoder rows: feature 0 -> (1, 0), 1 -> (0, 1), 2 -> (1, 1); + b_dec.
        t = {"W_enc": np.array([[1, -1, 0.5], [0.5, 1, -2]], np.float32),
             "b_enc": np.array([-0.25, 0.5, 0.125], np.float32),
             "W_dec": np.array([[1, 0], [0, 1], [1, 1]], np.float32),
             "b_dec": np.array([0.5, -0.25], np.float32),
             "threshold": np.array([0.5, 0.75, 0.25], np.float32)}
        cases = {
            # standard, b_dec subtracted: (1.5, 0.75) -> x' (1, 1) -> pre (1.25, 0.5, -1.375);
            # (0.5, -1.25) -> x' (0, -1) -> pre (-0.75, -0.5, 2.125)
            ("standard", True, None): ([[1.5, 0.75], [0.5, -1.25]],
                                       [[1.25, 0.5, 0], [0, 0, 2.125]],
                                       [[1.75, 0.25], [2.625, 1.875]]),
            # standard, x as is: (1, 0.25) -> pre (0.875, -0.25, 0.125)
            ("standard", False, None): ([[1, 0.25]], [[0.875, 0, 0.125]], [[1.5, -0.125]]),
            # jumprelu (thresholds 0.5, 0.75, 0.25), x as is: (0.75, 0) -> pre (0.5, -0.25,
            # 0.5): feature 0 sits exactly on its threshold, off; (0, 0.5) -> (0, 1, -0.875);
            # (1, 0.25) -> (0.875, -0.25, 0.125): feature 2 positive but under its threshold
            ("jumprelu", False, None): ([[0.75, 0], [0, 0.5], [1, 0.25]],
                                        [[0, 0, 0.5], [0, 1, 0], [0.875, 0, 0]],
                                        [[1, 0.25], [0.5, 0.75], [1.375, -0.25]]),
            # jumprelu, b_dec subtracted: (1.5, 0.75) -> pre (1.25, 0.5, -1.375): 0.5 < 0.75
            ("jumprelu", True, None): ([[1.5, 0.75]], [[1.25, 0, 0]], [[1.75, -0.25]]),
            # topk k = 2, x as is: (0.5, 0.125) -> pre (0.3125, 0.125, 0.125): the tie for
            # second place goes to feature 1; (0.5, -1.25) -> (-0.375, -1.25, 2.875): the
            # second largest is negative, so relu leaves one feature
            ("topk", False, 2): ([[0.5, 0.125], [0.5, -1.25]],
                                 [[0.3125, 0.125, 0], [0, 0, 2.875]],
                                 [[0.8125, -0.125], [3.375, 2.625]]),
            # topk k = 1, b_dec subtracted: (1.5, 0.75) -> pre (1.25, 0.5, -1.375)
            ("topk", True, 1): ([[1.5, 0.75]], [[1.25, 0, 0]], [[1.75, -0.25]]),
        }
        for (arch, apply, k), (x, f_want, xhat_want) in cases.items():
            d = self.path(f"{arch}{int(apply)}")
            tensors = t if arch == "jumprelu" else {n: v for n, v in t.items() if n != "threshold"}
            make_sae.write_saelens(d, tensors, make_sae.saelens_cfg(
                arch, 2, 3, "blocks.0.hook_resid_post", apply, "f32", k))
            sae = load_sae(d)
            self.assertEqual((sae.architecture, sae.apply_b_dec_to_input, sae.k), (arch, apply, k))
            f = encode(sae, np.array(x))
            np.testing.assert_array_equal(f.numpy(), np.array(f_want), err_msg=f"{arch} {apply}")
            np.testing.assert_array_equal(decode(sae, f).numpy(), np.array(xhat_want), err_msg=f"{arch} {apply}")
        # the same weights as a Gemma Scope npz: the jumprelu without b_dec subtracted
        npz = self.path("params.npz")
        make_sae.write_npz(npz, t)
        with np.load(npz) as z:
            self.assertEqual(sorted(z.files), sorted(t))
            self.assertTrue(all(z[n].dtype == np.float32 for n in z.files))
        sae = load_sae(npz)
        self.assertEqual((sae.architecture, sae.apply_b_dec_to_input, sae.hook_name), ("jumprelu", False, None))
        x, f_want, _ = cases[("jumprelu", False, None)]
        np.testing.assert_array_equal(encode(sae, np.array(x)).numpy(), np.array(f_want))

    def test_safetensors_layout(self):
        import make_sae
        p = self.path("st")
        a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1.5], np.float32)
        make_sae.write_safetensors(p, {"a": a, "b": b})
        with open(p, "rb") as f:
            raw = f.read()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        self.assertEqual(header, {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
                                  "b": {"dtype": "F32", "shape": [1], "data_offsets": [24, 28]},
                                  "__metadata__": {"format": "pt"}})
        self.assertEqual(raw[8 + n:], a.tobytes() + b.tobytes())
        # bf16: round to nearest even on the upper 16 bits
        bits = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0xBF80C000], "<u4")
        self.assertEqual(make_sae.f32_to_bf16_bits(bits.view("<f4")).tolist(),
                         [0x3F80, 0x3F82, 0x3F81, 0x3F80, 0xBF81])

    def test_same_as_gives_identical_features(self):
        from kvlens_oracle.sae import decode, encode, load_sae
        for model, rows in self.need_rows().items():
            D = rows.shape[1]
            st, npz, back = self.path(f"{model}.st"), self.path(f"{model}.npz"), self.path(f"{model}.back")
            self.make("--format", "saelens", "--out", st, "--d-in", D, "--d-sae", 4 * D,
                      "--hook", "blocks.2.hook_resid_post", "--architecture", "jumprelu", "--seed", 5)
            self.make("--format", "npz", "--out", npz, "--same-as", st)
            self.make("--format", "saelens", "--out", back, "--same-as", npz,
                      "--hook", "blocks.2.hook_resid_post")
            a, b, c = load_sae(st), load_sae(npz), load_sae(back)
            self.assertEqual((a.apply_b_dec_to_input, b.format, c.architecture, c.apply_b_dec_to_input),
                             (False, "npz", "jumprelu", False))
            fa, fb, fc = encode(a, rows), encode(b, rows), encode(c, rows)
            np.testing.assert_array_equal(fa.numpy(), fb.numpy(), err_msg=model)
            np.testing.assert_array_equal(fa.numpy(), fc.numpy(), err_msg=model)
            np.testing.assert_array_equal(decode(a, fa).numpy(), decode(b, fb).numpy(), err_msg=model)
            active = float((fa > 0).double().mean())
            self.assertTrue(0.2 <= active <= 0.6, f"{model}: {active:.3f} of features active")
            # thresholds bind: a plain relu on the same pre-activations keeps more
            self.assertGreater(int((torch.relu(fa.new_tensor(rows) @ a.W_enc + a.b_enc) > 0).sum()),
                               int((fa > 0).sum()))
            # a standard SAE without b_dec subtraction is the npz with thresholds 0
            std, npz0 = self.path(f"{model}.std"), self.path(f"{model}.0.npz")
            self.make("--format", "saelens", "--out", std, "--d-in", D, "--hook",
                      "blocks.2.hook_resid_post", "--apply-b-dec-to-input", 0, "--seed", 6)
            self.make("--format", "npz", "--out", npz0, "--same-as", std)
            s, z = load_sae(std), load_sae(npz0)
            self.assertEqual(float(z.threshold.abs().max()), 0.0)
            np.testing.assert_array_equal(encode(s, rows).numpy(), encode(z, rows).numpy())
            self.assertTrue(0.2 <= float((encode(s, rows) > 0).double().mean()) <= 0.6)
        # what an npz cannot say is refused
        sub = self.path("sub")
        self.make("--format", "saelens", "--out", sub, "--d-in", 8, "--hook", "blocks.0.hook_resid_pre")
        with self.assertRaises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            self.make("--format", "npz", "--out", self.path("x.npz"), "--same-as", sub)

    def test_half_precision_files_round_as_declared(self):
        from kvlens_oracle.sae import load_sae
        saes = {}
        for dtype in ("f32", "f16", "bf16"):
            d = self.path(dtype)
            self.make("--format", "saelens", "--out", d, "--d-in", 24, "--d-sae", 40, "--hook",
                      "blocks.1.hook_mlp_out", "--architecture", "jumprelu", "--dtype", dtype, "--seed", 3)
            with open(os.path.join(d, "cfg.json")) as f:
                self.assertEqual(json.load(f)["dtype"], {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dtype])
            saes[dtype] = load_sae(d)
            self.assertEqual(saes[dtype].dtype, dtype.upper())

        def bf16_by_hand(v):
            # the two bf16 neighbours of each float32 (truncated, and one unit up); the nearer,
            # ties to the even one (bit 16 clear)
            bits = v.astype(np.float32).view(np.uint32).astype(np.int64)
            lo = bits & ~0xFFFF
            hi = lo + 0x10000
            flo = lo.astype(np.uint32).view(np.float32).astype(np.float64)
            fhi = hi.astype(np.uint32).view(np.float32).astype(np.float64)
            dlo, dhi = np.abs(v - flo), np.abs(fhi - v)
            pick_hi = (dhi < dlo) | ((dhi == dlo) & ((lo >> 16) & 1 == 1))
            return np.where(pick_hi, fhi, flo)
        for name in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold"):
            v = getattr(saes["f32"], name).numpy()
            h, b = getattr(saes["f16"], name).numpy(), getattr(saes["bf16"], name).numpy()
            np.testing.assert_array_equal(h, v.astype(np.float16).astype(np.float64), err_msg=name)
            np.testing.assert_array_equal(b, bf16_by_hand(v), err_msg=name)
            np.testing.assert_array_equal(
                b, torch.from_numpy(v.astype(np.float32)).to(torch.bfloat16).double().numpy(), err_msg=name)
            self.assertGreater(np.abs(h - v).max(), 0.0, name)
            self.assertGreater(np.abs(b - v).max(), np.abs(h - v).max(), name)

    def test_topk_keeps_exactly_k(self):
        from kvlens_oracle.sae import encode, load_sae, pre_activations
        for model, rows in self.need_rows().items():
            D = rows.shape[1]
            for k in (1, 5, 17):
                d = self.path(f"{model}.{k}")
                self.make("--format", "saelens", "--out", d, "--d-in", D, "--d-sae", 3 * D,
                          "--hook", "blocks.2.hook_resid_post", "--architecture", "topk", "--k", k)
                sae = load_sae(d)
                self.assertEqual((sae.k, sae.apply_b_dec_to_input), (k, True))
                f, pre = encode(sae, rows).numpy(), pre_activations(sae, rows).numpy()
                self.assertEqual((f > 0).sum(1).tolist(), [k] * len(rows), f"{model} k={k}")
                for r in range(len(rows)):
                    kept = np.flatnonzero(f[r])
                    np.testing.assert_array_equal(f[r, kept], pre[r, kept])
                    self.assertGreater(pre[r, kept].min(), np.delete(pre[r], kept).max())

    def test_oracle_cli(self):
        from kvlens_oracle.checkpoints import read_safetensors
        from kvlens_oracle.sae import encode, load_sae
        if not hasattr(self, "gpt2_acts"):
            self.skipTest("models/kjv-gpt2-4l absent")
        st, npz = self.path("st"), self.path("z.npz")
        self.make("--format", "saelens", "--out", st, "--d-in", 192, "--d-sae", 384,
                  "--hook", "blocks.2.hook_resid_post", "--seed", 9)
        self.make("--format", "npz", "--out", npz, "--d-in", 192, "--d-sae", 256, "--seed", 10)
        out = self.path("out.kvo")
        cli = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "oracle.py"),
               "--model", KJV_GPT2, "--tokens", " ".join(map(str, self.gpt2_ids)), "--out", out]
        subprocess.run(cli + ["--activations", "--sae", st], check=True)
        c = read_container(out)
        T = len(self.gpt2_ids)
        self.assertEqual({k: c[k].shape for k in c if k.startswith("sae.")},
                         {"sae.input": (T, 192), "sae.acts": (T, 384), "sae.recon": (T, 192)})
        np.testing.assert_array_equal(c["sae.input"], c["act.resid_post.2"])
        w = read_safetensors(os.path.join(st, "sae_weights.safetensors"))
        x = c["act.resid_post.2"]
        f_want = np.maximum((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"], 0)  # standard, b_dec subtracted
        self.assertLess(np.abs(c["sae.acts"] - f_want).max(), 1e-12 * np.abs(f_want).max())
        self.assertTrue(0.2 <= (c["sae.acts"] > 0).mean() <= 0.6)
        recon = c["sae.acts"] @ w["W_dec"] + w["b_dec"]
        self.assertLess(np.abs(c["sae.recon"] - recon).max(), 1e-12 * np.abs(recon).max())
        # @HOOK supplies the npz's hook (attn.hook_z: heads side by side) and overrides a cfg's
        subprocess.run(cli + ["--sae", npz + "@blocks.1.attn.hook_z"], check=True)
        c = read_container(out)
        z = self.gpt2_acts["act.z.1"]
        np.testing.assert_array_equal(c["sae.input"], z.reshape(T, -1))
        np.testing.assert_array_equal(c["sae.input"][:, 32:64], z[:, 1])
        np.testing.assert_array_equal(c["sae.acts"], encode(load_sae(npz), z.reshape(T, -1)).numpy())
        subprocess.run(cli + ["--sae", st + "@blocks.0.hook_mlp_out"], check=True)
        np.testing.assert_array_equal(read_container(out)["sae.input"], self.gpt2_acts["act.mlp_out.0"])
        for bad in (npz, st + "@blocks.9.hook_resid_post", st + "@blocks.1.hook_nothing"):
            r = subprocess.run(cli + ["--sae", bad], capture_output=True, text=True)
            self.assertEqual(r.returncode, 2, bad)
            self.assertIn("--sae", r.stderr)

    def test_corrupt_kinds_are_refused(self):
        import make_sae
        from kvlens_oracle.sae import load_sae
        ok = self.path("ok")
        self.make("--format", "saelens", "--out", ok, "--d-in", 16, "--d-sae", 32,
                  "--hook", "blocks.1.hook_resid_pre")
        load_sae(ok)
        why = {"missing-tensor": r"missing \['W_dec'\]", "wrong-shape": r"W_enc has shape \[16, 33\]",
               "truncated": "truncated", "bad-architecture": "'gated'",
               "bad-normalize": "expected_average_only_in", "no-hook": "no hook_name"}
        self.assertEqual(sorted(why), sorted(make_sae.CORRUPTIONS))
        for kind in make_sae.CORRUPTIONS:
            d = self.path(kind)
            self.make("--format", "saelens", "--out", d, "--d-in", 16, "--d-sae", 32,
                      "--hook", "blocks.1.hook_resid_pre", "--corrupt", kind)
            with self.assertRaisesRegex(ValueError, why[kind], msg=kind):
                load_sae(d)
        # each breaks only what it says
        size = lambda d: os.path.getsize(os.path.join(d, "sae_weights.safetensors"))  # noqa: E731
        self.assertLess(size(self.path("truncated")), size(ok))
        load_sae(self.path("no-hook"), hook="blocks.1.hook_resid_pre")  # a hook supplied: fine


if __name__ == "__main__":
    unittest.main()
