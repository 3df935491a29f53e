"""Activation steering (forward / greedy's steer=, oracle.py --steer): a vector added to every
row of the residual stream at blocks.L.hook_resid_pre / hook_resid_mid / hook_resid_post.

Run: /usr/bin/python3 -m unittest discover -s tests/oracle -p 'test_*.py'
"""
import contextlib
import io
import math
import os
import sys
import tempfile
import unittest

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvlens_oracle import forward, greedy, read_container  # noqa: E402
from kvlens_oracle.loader import OracleModel  # noqa: E402
from kvlens_oracle.model import steer_hook  # noqa: E402
import oracle_fixtures as fx  # noqa: E402

# name -> make_quantized_gguf.py arguments (None: the tiny GPT-2 of oracle_fixtures)
MODELS = {
    "llama": "--f32 --layers 3",
    "gemma2": ("--gemma2 --f32 --set gemma2.attention.sliding_window=3 "
               "--set-float gemma2.attn_logit_softcapping=2 "
               "--set-float gemma2.final_logit_softcapping=3"),
    "gemma3": "--gemma3 --f32",
    "gpt2": None,
}
# What each is, as built above (not read back from the loaded config): its width, the scale
# of its embeddings (Gemma's sqrt(d)), its gate, its final soft-cap, its norms on block outputs.
DIM = {"llama": 256, "gemma2": 256, "gemma3": 256, "gpt2": 32}
EMBED_SCALE = {"llama": 1.0, "gemma2": 16.0, "gemma3": 16.0, "gpt2": 1.0}
GATE = {"llama": "silu", "gemma2": "gelu_tanh", "gemma3": "gelu_tanh"}
FINAL_CAP = {"gemma2": 3.0}
SANDWICH = {"gemma2", "gemma3"}
TOKENS = {"llama": [1, 5, 300, 17, 42, 383, 0, 9], "gemma2": [1, 5, 300, 17, 42, 383, 0, 9],
          "gemma3": [1, 5, 300, 17, 42, 383, 0, 9], "gpt2": [3, 14, 15, 9, 26, 5, 35, 8]}


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def ln(x, w, b, eps):
    c = x - x.mean(-1, keepdims=True)
    return c / np.sqrt((c * c).mean(-1, keepdims=True) + eps) * w + b


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def silu(x):
    return x / (1 + np.exp(-x))


def logits_of(m, tokens, steer=None, capture=None):
    with torch.no_grad():
        logits, attn = forward(m, tokens, steer=steer, capture=capture)
    return logits.numpy(), attn.numpy()


class SteeringTest(unittest.TestCase):
    """Steering in kvlens_oracle/model.py on a random Llama (3 layers), Gemma 2 (norms on the
    block outputs, a window, capped scores and logits), Gemma 3 (those norms, q/k head norms)
    and GPT-2: (a) a zero vector changes nothing; (b) resid_post of L and resid_pre of L + 1
    are one point; (c) one token a steered at resid_pre 0 by (E[b] - E[a]) times the embedding
    scale is the token b; (d) the last resid_post and (e) resid_mid, written out with numpy
    from the weights and the unsteered run's captured activations; (f) on every row: GPT-2's
    biases and the embedding table, shifted by v, equal steering by v; (g) earlier layers are
    untouched; (h) oracle.py --steer, with --generate, and its refusals."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.paths, cls.models = fx.build_models(cls.tmp.name, MODELS)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def each(self):
        for name, m in self.models.items():
            self.assertEqual(m.cfg["dim"], DIM[name])
        return list(self.models.items())

    def vector(self, name, seed, stream):
        """A random direction as large as the stream's rows (root mean square)."""
        rng = np.random.default_rng(seed)
        return rng.normal(size=DIM[name]) * float(np.sqrt((stream ** 2).mean()))

    def assertClose(self, got, want, rel=1e-11, what=""):
        scale = np.abs(want).max()
        self.assertLessEqual(np.abs(got - want).max(), rel * scale, what)

    def test_zero_vector_changes_nothing(self):
        for name, m in self.each():
            with self.subTest(model=name):
                ids = TOKENS[name]
                want, want_attn = logits_of(m, ids)
                zero = torch.zeros(DIM[name], dtype=torch.float64)
                every = [(l, p, zero) for l in range(m.cfg["n_layers"])
                         for p in ("pre", "mid", "post")]
                for steer in ([], every):
                    got, got_attn = logits_of(m, ids, steer)
                    np.testing.assert_array_equal(got, want)
                    np.testing.assert_array_equal(got_attn, want_attn)
                self.assertEqual(greedy(m, ids[:3], 4, steer=[(0, "mid", np.zeros(DIM[name]))]),
                                 greedy(m, ids[:3], 4))

    def test_resid_post_is_next_resid_pre(self):
        for name, m in self.each():
            with self.subTest(model=name):
                ids, cap = TOKENS[name], {}
                base, _ = logits_of(m, ids, capture=cap)
                for layer in range(m.cfg["n_layers"] - 1):
                    resid = cap["layers"][layer]["resid"].numpy()
                    v = torch.from_numpy(self.vector(name, layer, resid))
                    post, post_attn = logits_of(m, ids, [(layer, "post", v)])
                    pre, pre_attn = logits_of(m, ids, [(layer + 1, "pre", v)])
                    np.testing.assert_array_equal(post, pre)
                    np.testing.assert_array_equal(post_attn, pre_attn)
                    self.assertGreater(np.abs(post - base).max(), 1e-3 * np.abs(base).max())
                    # the TransformerLens names say the same
                    n = m.cfg["n_layers"]
                    self.assertEqual(steer_hook(f"blocks.{layer}.hook_resid_post", n),
                                     (layer, "post"))
                    self.assertEqual(steer_hook(f"blocks.{layer + 1}.hook_resid_pre", n),
                                     (layer + 1, "pre"))

    def test_embedding_swap_at_resid_pre_0(self):
        for name, m in self.each():
            with self.subTest(model=name):
                E = m.w["embed" if name != "gpt2" else "wte"].numpy()
                a, b = TOKENS[name][2], TOKENS[name][4]
                v = (E[b] - E[a]) * EMBED_SCALE[name]
                got, _ = logits_of(m, [a], [(0, "pre", v)])
                want, _ = logits_of(m, [b])
                self.assertClose(got, want, 1e-12)
                plain, _ = logits_of(m, [a])
                self.assertGreater(np.abs(plain - want).max(), 1e-2 * np.abs(want).max())
                # the scale matters where there is one
                if EMBED_SCALE[name] != 1.0:
                    off, _ = logits_of(m, [a], [(0, "pre", E[b] - E[a])])
                    self.assertGreater(np.abs(off - want).max(), 1e-3 * np.abs(want).max())

    def test_start_row_steers_only_the_rows_from_it(self):
        # The last row alone steered at resid_pre 0 by (E[b] - E[a]) times the scale, its token
        # a: the earlier rows are the unsteered pass's (bit for bit), the last row's logits
        # those of the sequence ending in b instead (its keys and values reach no other row).
        # A start past the last row changes nothing.
        for name, m in self.each():
            with self.subTest(model=name):
                E = m.w["embed" if name != "gpt2" else "wte"].numpy()
                ids = list(TOKENS[name])
                a, b = ids[-1], TOKENS[name][4] if TOKENS[name][4] != ids[-1] else TOKENS[name][2]
                v = (E[b] - E[a]) * EMBED_SCALE[name]
                T = len(ids)
                plain, _ = logits_of(m, ids)
                got, _ = logits_of(m, ids, [(0, "pre", v, T - 1)])
                np.testing.assert_array_equal(got[:T - 1], plain[:T - 1])
                want, _ = logits_of(m, ids[:-1] + [b])
                self.assertClose(got[T - 1], want[T - 1], 1e-12)
                self.assertGreater(np.abs(plain[T - 1] - want[T - 1]).max(), 1e-3)
                past, _ = logits_of(m, ids, [(0, "pre", v, T)])
                np.testing.assert_array_equal(past, plain)

    def final_logits(self, name, m, x):
        """Logits from the stream entering the final norm, by hand."""
        W = {k: t.numpy() for k, t in m.w.items()}
        if name == "gpt2":
            return ln(x, W["lnf_w"], W["lnf_b"], 1e-5) @ W["out"].T
        z = rms(x, W["final_norm"], m.cfg["eps"]) @ W["out"].T
        cap = FINAL_CAP.get(name)
        return z if cap is None else cap * np.tanh(z / cap)

    def test_last_resid_post_by_hand(self):
        for name, m in self.each():
            with self.subTest(model=name):
                ids, cap, L = TOKENS[name], {}, m.cfg["n_layers"]
                logits_of(m, ids, capture=cap)
                x = cap["resid_final"].numpy()
                v1, v2 = self.vector(name, 1, x), self.vector(name, 2, x)
                got, _ = logits_of(m, ids, [(L - 1, "post", v1)])
                self.assertClose(got, self.final_logits(name, m, x + v1))
                # two entries at one point add up
                got, _ = logits_of(m, ids, [(L - 1, "post", v1), (L - 1, "post", v2)])
                self.assertClose(got, self.final_logits(name, m, x + v1 + v2))
                both, _ = logits_of(m, ids, [(L - 1, "post", v1 + v2)])
                np.testing.assert_array_equal(got, both)

    def test_resid_mid_by_hand(self):
        # The last layer's resid_mid: its attention (already run, captured unsteered) plus v,
        # then its feed-forward and the final norm written out here.
        for name, m in self.each():
            with self.subTest(model=name):
                ids, cap, L = TOKENS[name], {}, m.cfg["n_layers"]
                base, base_attn = logits_of(m, ids, capture=cap)
                rec = cap["layers"][L - 1]
                lw = {k: t.numpy() for k, t in m.layers[L - 1].items()}
                pre, o_proj, eps = rec["resid_pre"].numpy(), rec["o_proj"].numpy(), m.cfg["eps"]
                if name == "gpt2":
                    h = pre + o_proj + lw["b_o"]
                elif name in SANDWICH:  # Gemma 2/3: resid_pre + post_attn_norm(attention)
                    h = pre + rms(o_proj, lw["post_attn_norm"], eps)
                else:
                    h = pre + o_proj
                v = self.vector(name, 3, h)
                hv = h + v
                if name == "gpt2":
                    u = ln(hv, lw["ln2_w"], lw["ln2_b"], 1e-5) @ lw["w_fc"].T + lw["b_fc"]
                    f = gelu_tanh(u) @ lw["w_proj"].T + lw["b_proj"]
                else:
                    n2 = rms(hv, lw["ffn_norm"], eps)
                    gate = gelu_tanh if GATE[name] == "gelu_tanh" else silu
                    f = (gate(n2 @ lw["w1"].T) * (n2 @ lw["w3"].T)) @ lw["w2"].T
                    if name in SANDWICH:
                        f = rms(f, lw["post_ffn_norm"], eps)
                steered = {}
                got, got_attn = logits_of(m, ids, [(L - 1, "mid", v)], capture=steered)
                self.assertClose(got, self.final_logits(name, m, hv + f))
                self.assertGreater(np.abs(got - base).max(), 1e-3 * np.abs(base).max())
                # the layer's own attention does not see it
                np.testing.assert_array_equal(got_attn, base_attn)
                self.assertClose(steered["layers"][L - 1]["resid_mid"].numpy(), hv, 1e-14)

    def test_every_row_like_a_bias(self):
        # GPT-2's position table, b_O and b_proj add one vector to every row: shifted by v, they
        # steer by v at resid_pre 0, resid_mid L and resid_post L (= resid_pre L + 1). And the
        # embedding table shifted by v / scale steers every row at resid_pre 0 in each family.
        def shifted(m, where, key, v):
            w, layers = dict(m.w), [dict(lw) for lw in m.layers]
            target = w if where is None else layers[where]
            target[key] = target[key] + torch.as_tensor(v)
            return OracleModel(m.family, m.cfg, w, layers, m.source)
        m, ids = self.models["gpt2"], TOKENS["gpt2"]
        cap = {}
        base, _ = logits_of(m, ids, capture=cap)
        for L in range(m.cfg["n_layers"]):
            v = self.vector("gpt2", 10 + L, cap["layers"][L]["resid"].numpy())
            cases = [(f"blocks.{L}.hook_resid_mid", shifted(m, L, "b_o", v)),
                     (f"blocks.{L}.hook_resid_post", shifted(m, L, "b_proj", v))]
            cases.append((f"blocks.{L}.hook_resid_pre",
                          shifted(m, None, "wpe", v) if L == 0 else shifted(m, L - 1, "b_proj", v)))
            for hook, biased in cases:
                layer, point = steer_hook(hook, m.cfg["n_layers"])
                got, _ = logits_of(m, ids, [(layer, point, v)])
                want, _ = logits_of(biased, ids)
                self.assertClose(got, want, 1e-12, hook)
                self.assertGreater(np.abs(got - base).max(), 1e-3 * np.abs(base).max(), hook)
                if hook.endswith("mid"):
                    self.assertEqual(greedy(m, ids[:4], 5, steer=[(layer, point, v)]),
                                     greedy(biased, ids[:4], 5))
        for name, m in self.each():
            with self.subTest(model=name):
                ids, key = TOKENS[name], "embed" if name != "gpt2" else "wte"
                v = self.vector(name, 20, m.w[key].numpy()) * EMBED_SCALE[name]
                got, _ = logits_of(m, ids, [(0, "pre", v)])
                want, _ = logits_of(shifted(m, None, key, v / EMBED_SCALE[name]), ids)
                self.assertClose(got, want, 1e-12)

    def test_earlier_layers_untouched(self):
        for name, m in self.each():
            with self.subTest(model=name):
                ids, cap = TOKENS[name], {}
                logits_of(m, ids, capture=cap)
                L = m.cfg["n_layers"] - 1
                v = self.vector(name, 30, cap["layers"][L]["resid_pre"].numpy())
                steered = {}
                logits_of(m, ids, [(L, "pre", v)], capture=steered)
                for layer in range(L):
                    for k, t in cap["layers"][layer].items():
                        got = steered["layers"][layer][k].numpy()
                        np.testing.assert_array_equal(got, t.numpy(), f"layer {layer} {k}")
                # every row of the stream entering layer L moved by v
                diff = (steered["layers"][L]["resid_pre"] - cap["layers"][L]["resid_pre"]).numpy()
                self.assertClose(diff, np.tile(v, (len(ids), 1)), 1e-14)

    def test_bad_steering_entries(self):
        m = self.models["llama"]
        d = DIM["llama"]
        for steer, why in (([(3, "pre", np.zeros(d))], "out of range"),
                           ([(0, "out", np.zeros(d))], "not one of"),
                           ([(0, "pre", np.zeros(d + 1))], r"shape \[257\]"),
                           ([(0, "pre")], r"\(layer, point, vector\[, start\]\)"),
                           ([(0, "pre", np.zeros(d), -1)], "negative")):
            with self.assertRaisesRegex(ValueError, why):
                forward(m, [1, 2], steer=steer)
        for hook, why in (("blocks.3.hook_resid_pre", r"layer 3 out of range \[0, 3\)"),
                          ("blocks.0.hook_attn_out", "unknown hook"),
                          ("blocks.x.hook_resid_pre", "unknown hook")):
            with self.assertRaisesRegex(ValueError, why):
                steer_hook(hook, 3)

    # ---------------------------------------------------------------- oracle.py --steer
    def write_vector(self, name, v):
        path = os.path.join(self.tmp.name, f"{self._testMethodName}.{name}.txt")
        with open(path, "w") as f:
            rows = (" ".join(repr(float(x)) for x in v[i:i + 8]) for i in range(0, len(v), 8))
            f.write("\n".join(rows) + "\n")
        return path

    def cli(self, *args):
        import oracle
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = oracle.main([str(a) for a in args])
            except SystemExit as e:
                rc = e.code
        return rc, out.getvalue(), err.getvalue()

    def test_cli_logits_and_generate(self):
        for name in ("llama", "gpt2", "gemma2"):
            with self.subTest(model=name):
                m, ids, cap = self.models[name], TOKENS[name], {}
                logits_of(m, ids, capture=cap)
                v1 = self.vector(name, 40, cap["layers"][1]["resid_mid"].numpy())
                v2 = self.vector(name, 41, cap["layers"][0]["resid_pre"].numpy())
                f1, f2 = self.write_vector("v1", v1), self.write_vector("v2", v2)
                out = os.path.join(self.tmp.name, f"{name}.kvo")
                steer_args = ["--steer", f"blocks.1.hook_resid_mid:{f1}:2.5",
                              "--steer", f"blocks.0.hook_resid_pre:{f2}",
                              "--steer", f"blocks.1.hook_resid_mid:{f2}:-0.5"]
                rc, _, err = self.cli("--model", self.paths[name], "--tokens",
                                      " ".join(map(str, ids)), "--out", out, "--attention",
                                      *steer_args)
                self.assertEqual(rc, 0, err)
                c = read_container(out)
                steer = [(1, "mid", 2.5 * torch.tensor(v1)), (0, "pre", torch.tensor(v2)),
                         (1, "mid", -0.5 * torch.tensor(v2))]
                want, want_attn = logits_of(m, ids, steer)
                names = ["logits"] + [f"attn.{l}" for l in range(len(want_attn))]
                self.assertEqual(sorted(c), sorted(names))
                np.testing.assert_array_equal(c["logits"], want)
                np.testing.assert_array_equal(c["attn.1"], want_attn[1])
                self.assertGreater(np.abs(want - logits_of(m, ids)[0]).max(), 1e-3)

                # --generate under steering: the argmax chain of the steered logits
                prompt, n = ids[:3], 6
                rc, text, err = self.cli("--model", self.paths[name], "--generate", n,
                                         "--prompt-tokens", " ".join(map(str, prompt)), *steer_args)
                self.assertEqual(rc, 0, err)
                got = [int(t) for t in text.split()]
                seq = list(prompt)
                for _ in range(n):
                    seq.append(int(np.argmax(logits_of(m, seq, steer)[0][-1])))
                self.assertEqual(got, seq[len(prompt):])
                self.assertNotEqual(got, greedy(m, prompt, n), "steering should change the text")

    def test_cli_refusals(self):
        name, d = "gpt2", DIM["gpt2"]
        ok = self.write_vector("ok", np.ones(d))
        short = self.write_vector("short", np.ones(d - 1))
        junk = os.path.join(self.tmp.name, "junk.txt")
        with open(junk, "w") as f:
            f.write("1.0 2.0 x3\n")
        base = ["--model", self.paths[name], "--tokens", "1 2 3", "--out",
                os.path.join(self.tmp.name, "r.kvo")]
        cases = {
            "blocks.0.hook_attn_out:" + ok: "unknown hook",
            "blocks.3.hook_resid_post:" + ok: r"layer 3 out of range \[0, 3\)",
            "blocks.0.hook_resid_pre:" + short: "holds 31 values, the model's d_model is 32",
            "blocks.0.hook_resid_pre:" + ok + ".missing": "cannot read vector file",
            "blocks.0.hook_resid_pre:" + junk: "x3",
            "blocks.0.hook_resid_pre:" + ok + ":abc": "coefficient 'abc' is not a number",
            "blocks.0.hook_resid_pre:" + ok + ":inf": "not finite",
            "blocks.0.hook_resid_pre": "expected HOOK:FILE",
        }
        for spec, why in cases.items():
            rc, _, err = self.cli(*base, "--steer", spec)
            self.assertEqual(rc, 2, spec)
            self.assertIn("--steer", err, spec)
            self.assertRegex(err, why, spec)
        good = "blocks.0.hook_resid_pre:" + ok
        for extra, flags in ((["--activations"], "--activations"),
                             (["--logit-attribution", "2:7"], "--logit-attribution"),
                             (["--grad-logprob", "2:7"], "--grad-logprob"),
                             (["--activations", "--sae", ok], "--activations, --sae")):
            rc, _, err = self.cli(*base, "--steer", good, *extra)
            self.assertEqual(rc, 2, extra)
            self.assertIn(f"--steer does not combine with {flags}", err)
        # a file name holding ':' is read whole when it exists
        colon = os.path.join(self.tmp.name, "a:2")
        with open(colon, "w") as f:
            f.write(" ".join(["0.5"] * d))
        rc, _, err = self.cli(*base, "--steer", "blocks.0.hook_resid_pre:" + colon)
        self.assertEqual(rc, 0, err)
        got = read_container(base[-1])["logits"]
        want, _ = logits_of(self.models[name], [1, 2, 3], [(0, "pre", np.full(d, 0.5))])
        np.testing.assert_array_equal(got, want)


if __name__ == "__main__":
    unittest.main()
