"""Activation patching in the oracle (forward's patch=, kvlens_oracle/patching.py, oracle.py
--patch-sweep) against what each cell must be, on a random Llama (3 layers), Gemma 2 (norms
on the block outputs, capped logits) and GPT-2 (biases, learned positions):
(a) patching a run with its own activations changes no cell (sweep of the prompt into
    itself: every cell is the clean score, exactly);
(b) layer 0's resid_pre at row i is that row's embedding: the cell is the run with token i
    swapped for the source's;
(c) the last layer's resid_post at the scored row is the stream the final norm reads: the
    cell is the source's score, and at other rows the clean one;
(d) cells past the scored row are the clean score (causal attention), at every site;
(e) a z patch of a head with the value it had, plus an attn_out patch equal to what a
    mid-layer adds, change nothing, while (f) patching z moves attn_out by
    (z_src - z) @ W_O[:, head] for models without a block-output norm (numpy from weights);
(g) oracle.py --patch-sweep writes the same arrays, and refuses what it cannot do;
(h) a q patch (before RoPE) equals a z patch by the output numpy computes from the source's
    rotated query and the clean keys and values;
(i) all_positions: every row of a stream site from the source scores the source's run, and
    in the last layer every row of a head's q or z scores as its row at the scored row;
(j) attribution patching: each cell's change is the directional derivative of the exact
    patch toward the source (central finite differences of patched forwards);
(k) the QK fix (q, k): a prompt patched from itself is clean in every cell; in the last
    layer a query's cells away from the scored row are clean and at it differ from first
    order's; other hooks are refused.

Run: /usr/bin/python3 -m unittest discover -s tests/oracle -p 'test_*.py'
"""
import contextlib
import io
import os
import sys
import tempfile
import unittest

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvlens_oracle import forward, read_container  # noqa: E402
from kvlens_oracle.patching import (  # noqa: E402
    _check, _recorded, attribution_patch_sweep, patch_sweep, qk_fixed_patch_sweep)
import oracle_fixtures as fx  # noqa: E402

MODELS = {
    "llama": "--f32 --layers 3",
    "gemma2": "--gemma2 --f32 --set-float gemma2.final_logit_softcapping=3",
    "gpt2": None,
}
TOKENS = {"llama": [1, 5, 300, 17, 42, 383], "gemma2": [1, 5, 300, 17, 42, 383],
          "gpt2": [3, 14, 15, 9, 26, 5]}
SOURCE = {"llama": [1, 9, 77, 17, 250, 4], "gemma2": [1, 9, 77, 17, 250, 4],
          "gpt2": [3, 7, 22, 9, 30, 2]}
HOOKS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "q", "k", "v", "z",
         "pattern")


class PatchingTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.paths, cls.models = fx.build_models(cls.tmp.name, MODELS)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def score(self, m, tokens, row, a, b, **kw):
        with torch.no_grad():
            logits, _ = forward(m, tokens, **kw)
        return float(logits[row, a] - logits[row, b])

    def test_cells_are_the_runs_they_must_be(self):
        row, a, b = 3, 5, 9
        for name, m in self.models.items():
            ids, src = TOKENS[name], SOURCE[name]
            L, T = m.cfg["n_layers"], len(ids)
            clean = self.score(m, ids, row, a, b)
            source = self.score(m, src, row, a, b)
            self.assertNotEqual(clean, source)
            for hook in HOOKS:
                with self.subTest(model=name, hook=hook):
                    own = patch_sweep(m, ids, ids, hook, row, a, b)  # (a)
                    self.assertTrue(np.all(own["sweep.metric"] == clean))
                    r = patch_sweep(m, ids, src, hook, row, a, b)
                    metric = r["sweep.metric"]
                    heads = {"z": m.cfg["n_heads"], "pattern": m.cfg["n_heads"],
                             "q": m.cfg["n_heads"], "k": m.cfg.get("n_kv_heads", m.cfg["n_heads"]),
                             "v": m.cfg.get("n_kv_heads", m.cfg["n_heads"])}.get(hook, 1)
                    self.assertEqual(metric.shape, (L, heads, T))
                    self.assertEqual(r["sweep.clean"][0], clean)
                    self.assertEqual(r["sweep.source"][0], source)
                    self.assertTrue(np.all(metric[:, :, row + 1:] == clean))  # (d)
                    self.assertTrue(np.any(metric[:, :, :row + 1] != clean))
                    if hook == "resid_pre":  # (b)
                        for i in range(T):
                            swapped = list(ids)
                            swapped[i] = src[i]
                            self.assertEqual(metric[0, 0, i], self.score(m, swapped, row, a, b))
                    if hook == "resid_post":  # (c)
                        want = [source if i == row else clean for i in range(T)]
                        np.testing.assert_array_equal(metric[L - 1, 0], want)

    def test_z_moves_attn_out_through_w_o(self):
        m = self.models["gpt2"]  # no block-output norm: attn_out = merged z @ W_O^T + b_O
        ids, src = TOKENS["gpt2"], SOURCE["gpt2"]
        layer, head, i = 1, 1, 4
        clean_cap, src_cap, cap = {}, {}, {}
        with torch.no_grad():
            forward(m, ids, capture=clean_cap)
            forward(m, src, capture=src_cap)
            z_src = src_cap["layers"][layer]["attn_out"][head, i]
            forward(m, ids, capture=cap, patch={(layer, "z"): [(i, head, z_src)]})
        hd = m.cfg["head_dim"]
        w_o = m.layers[layer]["w_o"].numpy()[:, head * hd:(head + 1) * hd]
        z = clean_cap["layers"][layer]["attn_out"][head, i].numpy()
        moved = (cap["layers"][layer]["attn_block"] - clean_cap["layers"][layer]["attn_block"])
        np.testing.assert_allclose(moved[i].numpy(), w_o @ (z_src.numpy() - z), rtol=0,
                                   atol=1e-12)
        self.assertTrue(np.all(moved[:i].numpy() == 0))
        # (e) its own values, at two sites at once, change nothing
        with torch.no_grad():
            same = forward(m, ids, patch={
                (layer, "z"): [(i, head, clean_cap["layers"][layer]["attn_out"][head, i])],
                (0, "attn"): [(2, clean_cap["layers"][0]["attn_block"][2])]})[0]
            want = forward(m, ids)[0]
        self.assertTrue(torch.equal(same, want))

    def test_q_patch_is_the_z_of_the_source_query(self):
        # (h) a query patched before RoPE (TransformerLens's hook_q) is the source's rotated
        # query at that row: the head's output becomes softmax(q_src k^T / sqrt(hd)) v over
        # the clean keys and values of its KV head (GQA: 4 heads on 2), in numpy
        m = self.models["llama"]
        ids, src = TOKENS["llama"], SOURCE["llama"]
        layer, i = m.cfg["n_layers"] - 1, 4
        hd, group = m.cfg["head_dim"], m.cfg["n_heads"] // m.cfg["n_kv_heads"]
        clean_cap, src_cap = {}, {}
        with torch.no_grad():
            forward(m, ids, capture=clean_cap)
            forward(m, src, capture=src_cap)
            for head in range(m.cfg["n_heads"]):
                q_src = src_cap["layers"][layer]["q"][head, i].numpy()
                k = clean_cap["layers"][layer]["k"][head // group, :i + 1].numpy()
                v = clean_cap["layers"][layer]["v"][head // group, :i + 1].numpy()
                s = k @ q_src / np.sqrt(hd)
                p = np.exp(s - s.max())
                z = (p / p.sum()) @ v
                via_q = forward(m, ids, patch={(layer, "q"): [
                    (i, head, src_cap["layers"][layer]["q_unrotated"][head, i])]})[0]
                via_z = forward(m, ids, patch={(layer, "z"): [(i, head, z)]})[0]
                np.testing.assert_allclose(via_q.numpy(), via_z.numpy(), rtol=0, atol=1e-12)
                self.assertFalse(torch.equal(via_q, forward(m, ids)[0]))

    def test_all_positions(self):
        # (i) every row of the stream entering (or leaving, or in the middle of) a layer from
        # the source is the source's run from there on: each cell is the source's score; in
        # the last layer, every row of a head's q or z is just its row at the scored row
        row, a, b = 3, 5, 9
        for name, m in self.models.items():
            ids, src = TOKENS[name], SOURCE[name]
            L = m.cfg["n_layers"]
            source = self.score(m, src, row, a, b)
            for hook in ("resid_pre", "resid_mid", "resid_post"):
                with self.subTest(model=name, hook=hook):
                    r = patch_sweep(m, ids, src, hook, row, a, b, all_positions=True)
                    self.assertEqual(r["sweep.metric"].shape, (L, 1, 1))
                    np.testing.assert_array_equal(r["sweep.metric"], source)
            for hook in ("q", "z"):
                with self.subTest(model=name, hook=hook):
                    every = patch_sweep(m, ids, src, hook, row, a, b, all_positions=True)
                    one = patch_sweep(m, ids, src, hook, row, a, b)["sweep.metric"]
                    np.testing.assert_array_equal(every["sweep.metric"][L - 1, :, 0],
                                                  one[L - 1, :, row])

    def test_attribution_is_the_derivative_of_the_exact_patch(self):
        # (j) attribution patching's cell minus the clean score is the directional derivative
        # of the exact patch: central differences of forwards with the value
        # clean + eps * (source - clean) patched in (eps 1e-4: error ~1e-8 of the score's
        # scale), at the last scored row and another, per head for q / k / v / z / pattern;
        # and with every row at once, the sum of the rows' derivatives
        row, a, b, eps = 3, 5, 9, 1e-4
        for name, m in self.models.items():
            ids, src = TOKENS[name], SOURCE[name]
            cap, src_cap = {}, {}
            with torch.no_grad():
                forward(m, ids, capture=cap)
                forward(m, src, capture=src_cap)
            for hook in HOOKS:
                with self.subTest(model=name, hook=hook):
                    atp = attribution_patch_sweep(m, ids, src, hook, row, a, b)
                    every = attribution_patch_sweep(m, ids, src, hook, row, a, b,
                                                    all_positions=True)["sweep.metric"]
                    clean = atp["sweep.clean"][0]
                    point, record, shift, per_head, heads = _check(m, ids, src, hook)
                    layer, head = 1, heads - 1
                    value = _recorded(cap, layer, record)
                    delta = _recorded(src_cap, layer, record) - value
                    total = 0.0
                    for i in range(len(ids)):
                        def at(e, i=i):
                            if per_head:
                                v = value[head, i] + e * delta[head, i]
                                return self.score(m, ids, row, a, b,
                                                  patch={(layer, point): [(i, head, v)]})
                            v = value[i] + e * delta[i]
                            return self.score(m, ids, row, a, b,
                                              patch={(layer + shift, point): [(i, v)]})
                        derivative = (at(eps) - at(-eps)) / (2 * eps)
                        scale = max(1.0, abs(derivative))
                        h = head if per_head else 0
                        self.assertAlmostEqual(atp["sweep.metric"][layer, h, i] - clean,
                                               derivative, delta=1e-6 * scale)
                        total += derivative
                    self.assertAlmostEqual(every[layer, head if per_head else 0, 0] - clean,
                                           total, delta=1e-6 * max(1.0, abs(total)))

    def test_qk_fix(self):
        # (k) the QK fix: from the input itself every cell is clean (the patched pattern is
        # the clean one); the last layer's pattern reaches only its own row's logits, so
        # there the q cells of other rows are clean, and the scored row's differ from first
        # order's (the softmax bends); other hooks are refused
        row, a, b = 3, 5, 9
        for name, m in self.models.items():
            ids, src = TOKENS[name], SOURCE[name]
            last = m.cfg["n_layers"] - 1
            for hook in ("q", "k"):
                with self.subTest(model=name, hook=hook):
                    same = qk_fixed_patch_sweep(m, ids, ids, hook, row, a, b)
                    np.testing.assert_allclose(same["sweep.metric"], same["sweep.clean"][0],
                                               rtol=0, atol=1e-12)
            with self.subTest(model=name, hook="q, last layer"):
                fixed = qk_fixed_patch_sweep(m, ids, src, "q", row, a, b)["sweep.metric"]
                first = attribution_patch_sweep(m, ids, src, "q", row, a, b)["sweep.metric"]
                clean = qk_fixed_patch_sweep(m, ids, ids, "q", row, a, b)["sweep.clean"][0]
                others = [i for i in range(len(ids)) if i != row]
                np.testing.assert_allclose(fixed[last][:, others], clean, rtol=0, atol=1e-12)
                self.assertTrue((np.abs(fixed[last][:, row] - first[last][:, row]) > 1e-9).all())
        with self.assertRaisesRegex(ValueError, "hook q or k"):
            qk_fixed_patch_sweep(self.models["gpt2"], TOKENS["gpt2"], SOURCE["gpt2"], "v", 3, 5, 9)

    def test_cli(self):
        import oracle
        m, path = self.models["llama"], self.paths["llama"]
        ids, src = TOKENS["llama"], SOURCE["llama"]
        out = os.path.join(self.tmp.name, "sweep.kvo")
        argv = ["--model", path, "--tokens", " ".join(map(str, ids)), "--out", out,
                "--patch-sweep", "mlp_out:3:5:9", "--source-tokens", " ".join(map(str, src))]
        self.assertEqual(oracle.main(argv), 0)
        got = read_container(out)
        want = patch_sweep(m, ids, src, "mlp_out", 3, 5, 9)
        for k, v in want.items():
            np.testing.assert_array_equal(got[k].reshape(v.shape), v)
        self.assertEqual(oracle.main(argv[:-4] + ["--patch-sweep", "v:3:5:9", "--source-tokens",
                                                  " ".join(map(str, src)),
                                                  "--patch-all-positions"]), 0)
        want = patch_sweep(m, ids, src, "v", 3, 5, 9, all_positions=True)["sweep.metric"]
        np.testing.assert_array_equal(read_container(out)["sweep.metric"].reshape(want.shape),
                                      want)
        s = " ".join(map(str, src))
        for sweep, source, message in (("hook_z:3:5:9", s, "unknown hook"),
                                       ("z:3:5", s, "HOOK:ROW:A:B"),
                                       ("z:3:5:9", "1 2", "as many tokens")):
            args = ["--model", path, "--tokens", " ".join(map(str, ids)), "--out", out,
                    "--patch-sweep", sweep, "--source-tokens", source]
            err = io.StringIO()
            with self.assertRaises(SystemExit), contextlib.redirect_stderr(err):
                oracle.main(args)
            self.assertIn(message, err.getvalue())


if __name__ == "__main__":
    unittest.main()
