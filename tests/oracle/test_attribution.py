"""Cached activations and direct logit attribution (kvlens_oracle/attribution.py).

Run: /usr/bin/python3 -m unittest discover -s tests/oracle -p 'test_*.py'
"""
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvlens_oracle import SpmTokenizer, forward, load_model, read_container  # noqa: E402
import oracle_fixtures as fx  # noqa: E402

TESTDATA = fx.shared_testdata()
PROBE = fx.STORIES_PROBE
KJV_GPT2 = fx.KJV_GPT2
GEMMA2_CAPPED = ("--gemma2 --f32 --set gemma2.attention.sliding_window=3 "
                 "--set-float gemma2.attn_logit_softcapping=2 "
                 "--set-float gemma2.final_logit_softcapping=3")


class AttributionTest(unittest.TestCase):
    """kvlens_oracle.attribution on stories260K (llama2.c), the trained GPT-2 under models/
    and a random Gemma 2 (norms on the block outputs, capped logits): the activations chain
    into each other and into the logits, the direct logit attributions add up (each
    identity to 1e-10 of the size of its terms), and a few values written out here with
    numpy straight from the weights, for the one row that attends only to itself (row 0)."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.gemma2_path = os.path.join(cls.tmp.name, "gemma2.gguf")
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "make_quantized_gguf.py")
        if os.system(f"{sys.executable} {script} --out {cls.gemma2_path} {GEMMA2_CAPPED}") != 0:
            raise RuntimeError("make_quantized_gguf.py failed")
        cls.gemma2 = load_model(cls.gemma2_path)
        cls.stories = cls.stories_ids = None
        if TESTDATA is not None:
            d = os.path.join(TESTDATA, "stories260K")
            cls.stories = load_model(os.path.join(d, "stories260K.bin"))
            cls.stories_ids = SpmTokenizer.from_llama2c(os.path.join(d, "tok512.bin")).encode(PROBE)[:12]
        cls.gpt2 = load_model(KJV_GPT2) if os.path.exists(os.path.join(KJV_GPT2, "config.json")) else None

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def need(self, name):
        m = getattr(self, name)
        if m is None:
            self.skipTest(f"{name} absent")
        return m

    def gpt2_ids(self):
        from kvlens_oracle.gpt2_bpe import ByteBPE
        tok = ByteBPE.from_tokenizer_json(os.path.join(KJV_GPT2, "tokenizer.json"))
        return tok.encode("And God said, Let there be light: and there was light.")[:12]

    @staticmethod
    def dims(m):
        c, lw = m.cfg, m.layers[0]
        ffn = (lw["w2"] if m.family == "llama" else lw["w_proj"]).shape[1]
        return c["n_layers"], c["dim"], c["n_heads"], c.get("n_kv_heads", c["n_heads"]), c["head_dim"], ffn

    def assertSums(self, terms, total, what):
        terms = np.concatenate([np.ravel(t) for t in terms])
        scale = max(np.abs(terms).sum(), abs(float(total)))
        self.assertGreater(scale, 0.0, what)
        self.assertLessEqual(abs(terms.sum() - float(total)), 1e-10 * scale, what)

    def check_model(self, m, ids):
        from kvlens_oracle.attribution import activations, logit_attribution
        L, D, H, KV, hd, F = self.dims(m)
        T = len(ids)
        act = activations(m, ids)
        want = {"act.ln_final": (T, D), "act.ln_final_scale": (T, 1),
                "act.ln_final_normalized": (T, D), "act.embed": (T, D)}
        if m.family == "gpt2":
            want["act.pos_embed"] = (T, D)
        for l in range(L):
            want.update({f"act.ln1_scale.{l}": (T, 1), f"act.ln1_normalized.{l}": (T, D),
                         f"act.ln2_scale.{l}": (T, 1), f"act.ln2_normalized.{l}": (T, D)})
            for name in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"):
                want[f"act.{name}.{l}"] = (T, D)
            want.update({f"act.z.{l}": (T, H, hd), f"act.result.{l}": (T, H, D),
                         f"act.mlp_pre.{l}": (T, F), f"act.mlp_post.{l}": (T, F),
                         f"act.q.{l}": (T, H, hd), f"act.k.{l}": (T, KV, hd), f"act.v.{l}": (T, KV, hd),
                         f"act.attn_scores.{l}": (H, T, T), f"act.pattern.{l}": (H, T, T)})
            if "post_attn_norm" in m.layers[l]:  # Gemma 2/3: norms on the blocks' outputs
                want.update({f"act.{ln}_{part}.{l}": (T, 1) if part == "scale" else (T, D)
                             for ln in ("ln1_post", "ln2_post") for part in ("scale", "normalized")})
            if m.family == "llama":  # rotary: q and k after RoPE too; a gated FFN
                want.update({f"act.rot_q.{l}": (T, H, hd), f"act.rot_k.{l}": (T, KV, hd),
                             f"act.mlp_pre_linear.{l}": (T, F)})
        self.assertEqual({k: v.shape for k, v in act.items()}, want)
        self.assertTrue(all(v.dtype == np.float64 for v in act.values()))

        # (a') the maps, head first: causal (-inf above the diagonal), and the pattern is the
        # softmax of the scores, computed here in numpy; z = pattern @ v per head.
        for l in range(L):
            s, p = act[f"act.attn_scores.{l}"], act[f"act.pattern.{l}"]
            upper = np.triu(np.ones((T, T), dtype=bool), 1)
            self.assertTrue(np.all(np.isneginf(s[:, upper])))
            e = np.exp(s - s.max(axis=-1, keepdims=True))
            np.testing.assert_allclose(p, e / e.sum(axis=-1, keepdims=True), rtol=0, atol=1e-14)
            v = act[f"act.v.{l}"][:, np.arange(H) // (H // KV)]  # [T, H, hd]
            z = np.einsum("htk,khd->thd", p, v)
            np.testing.assert_allclose(act[f"act.z.{l}"], z, rtol=0, atol=1e-12)
            # the visible scores are the scaled (and capped) products of the rotated q and k
            rot = "rot_" if m.family == "llama" else ""
            q, k = act[f"act.{rot}q.{l}"], act[f"act.{rot}k.{l}"][:, np.arange(H) // (H // KV)]
            want_s = np.einsum("thd,khd->htk", q, k) * (m.cfg.get("attn_scale") or hd ** -0.5)
            cap = m.cfg.get("attn_softcap")
            if cap:
                want_s = cap * np.tanh(want_s / cap)
            seen = np.isfinite(s)
            np.testing.assert_allclose(s[seen], want_s[seen], rtol=0,
                                       atol=1e-12 * np.abs(want_s).max())

        # (b) the stream: pre + attn = mid, mid + mlp = post = next layer's pre; heads sum to
        # what attention adds; ln_final times W_U is the logits.
        with torch.no_grad():
            logits = forward(m, ids)[0].numpy()
        emb = m.w["embed" if m.family == "llama" else "wte"].numpy()[ids] * m.cfg.get("embed_scale", 1.0)
        if m.family == "gpt2":
            emb = emb + m.w["wpe"].numpy()[:T]
        np.testing.assert_array_equal(act["act.resid_pre.0"], emb)
        np.testing.assert_array_equal(
            act["act.embed"] + (act["act.pos_embed"] if m.family == "gpt2" else 0), emb)
        for l in range(L):
            a = lambda n: act[f"act.{n}.{l}"]  # noqa: E731
            tol = 1e-12 * np.abs(a("resid_post")).max()
            self.assertLess(np.abs(a("resid_pre") + a("attn_out") - a("resid_mid")).max(), tol)
            self.assertLess(np.abs(a("resid_pre") + a("attn_out") + a("mlp_out") - a("resid_post")).max(), tol)
            if l + 1 < L:
                np.testing.assert_array_equal(a("resid_post"), act[f"act.resid_pre.{l + 1}"])
            o = a("result").sum(1)
            lw = {k: v.numpy() for k, v in m.layers[l].items()}
            if m.family == "gpt2":
                o = o + lw["b_o"]
            elif "post_attn_norm" in lw:
                # ln1_post reads the heads' sum; its normalized rows through its weight are
                # attn_out (ln2_post's: mlp_post through W_down, then mlp_out)
                f = a("mlp_post") @ lw["w2"].T
                for ln, x, w, block in (("ln1_post", o, lw["post_attn_norm"], "attn_out"),
                                        ("ln2_post", f, lw["post_ffn_norm"], "mlp_out")):
                    scale = np.sqrt((x * x).mean(-1, keepdims=True) + m.cfg["eps"])
                    np.testing.assert_allclose(a(f"{ln}_scale"), scale, rtol=1e-13, atol=0)
                    np.testing.assert_allclose(a(f"{ln}_normalized") * scale, x, rtol=0,
                                               atol=1e-12 * np.abs(x).max())
                    np.testing.assert_allclose(a(f"{ln}_normalized") * w, a(block), rtol=0,
                                               atol=1e-12 * np.abs(a(block)).max())
                o = o / np.sqrt((o * o).mean(-1, keepdims=True) + m.cfg["eps"]) * lw["post_attn_norm"]
            self.assertLess(np.abs(o - a("attn_out")).max(), 1e-12 * np.abs(o).max())
        # the final norm's normalized rows through its weight (and GPT-2's bias) are its
        # output, and times its scale they give back the stream (centred, for LayerNorm).
        w = m.w["final_norm" if m.family == "llama" else "lnf_w"].numpy()
        out = act["act.ln_final_normalized"] * w
        if m.family == "gpt2":
            out = out + m.w["lnf_b"].numpy()
        np.testing.assert_allclose(out, act["act.ln_final"], rtol=0, atol=1e-12 * np.abs(out).max())
        last = act[f"act.resid_post.{L - 1}"]
        if m.family == "gpt2":
            last = last - last.mean(-1, keepdims=True)
        np.testing.assert_allclose(act["act.ln_final_normalized"] * act["act.ln_final_scale"], last,
                                   rtol=0, atol=1e-12 * np.abs(last).max())
        z = act["act.ln_final"] @ m.w["out"].numpy().T
        cap = m.cfg.get("final_softcap")
        if cap:
            self.assertGreater(np.abs(z - logits).max(), 1e-3)  # the cap binds
            z = cap * np.tanh(z / cap)
        self.assertLess(np.abs(z - logits).max(), 1e-12 * np.abs(logits).max())

        # (a) the attributions add up, for a difference of the two likeliest tokens at the
        # last row and for one logit alone at a middle row; and they are linear in u.
        last = T - 1
        top2 = [int(i) for i in np.argsort(-logits[last])[:2]]
        mid, tok = T // 2, int(ids[T // 2 + 1])
        runs = {"diff": logit_attribution(m, ids, last, top2[0], top2[1]),
                "one": logit_attribution(m, ids, mid, tok),
                "top0": logit_attribution(m, ids, last, top2[0]),
                "top1": logit_attribution(m, ids, last, top2[1])}
        shapes = {"dla.logit": (1,), "dla.scale": (1,), "dla.embed": (1,), "dla.pos_embed": (1,),
                  "dla.attn": (L,), "dla.mlp": (L,), "dla.final_norm_bias": (1,), "dla.heads": (L, H),
                  "dla.attn_bias": (L,), "dla.neurons": (L, F), "dla.mlp_bias": (L,)}
        zpre = act["act.ln_final"] @ m.w["out"].numpy().T
        expect = {"diff": zpre[last, top2[0]] - zpre[last, top2[1]], "one": zpre[mid, tok]}
        for key, d in runs.items():
            self.assertEqual({k: v.shape for k, v in d.items()}, shapes)
            if key in expect:
                self.assertLess(abs(d["dla.logit"][0] - expect[key]), 1e-12 * np.abs(zpre).max())
            self.assertSums([d["dla.embed"], d["dla.pos_embed"], d["dla.attn"], d["dla.mlp"],
                             d["dla.final_norm_bias"]], d["dla.logit"][0], f"{key}: logit")
            for l in range(L):
                self.assertSums([d["dla.heads"][l], d["dla.attn_bias"][l]], d["dla.attn"][l], f"{key}: attn {l}")
                self.assertSums([d["dla.neurons"][l], d["dla.mlp_bias"][l]], d["dla.mlp"][l], f"{key}: mlp {l}")
            if m.family == "llama":
                for name in ("dla.pos_embed", "dla.final_norm_bias", "dla.attn_bias", "dla.mlp_bias"):
                    self.assertEqual(float(np.abs(d[name]).max()), 0.0, name)
        self.assertGreater(abs(runs["diff"]["dla.logit"][0]), 0.0)
        for k in shapes:
            if k == "dla.scale":
                self.assertEqual(runs["top0"][k][0], runs["diff"][k][0])
                continue
            lin = runs["top0"][k] - runs["top1"][k]
            self.assertLess(np.abs(lin - runs["diff"][k]).max(), 1e-12 * max(1.0, np.abs(lin).max()), k)
        return act, runs

    def test_stories260k(self):
        m, ids = self.need("stories"), self.stories_ids
        from kvlens_oracle.attribution import logit_attribution
        act, _ = self.check_model(m, ids)
        # (c) row 0 by hand from the weights: it attends only to itself, so each head's z is
        # its KV head's value row.
        W = {k: v.numpy() for k, v in m.w.items()}
        layers = [{k: v.numpy() for k, v in lw.items()} for lw in m.layers]
        eps, H, KV, hd = m.cfg["eps"], 8, 4, 8
        norm = lambda v, w: v / np.sqrt((v * v).mean() + eps) * w  # noqa: E731
        x = W["embed"][ids[0]]
        results = []
        for lw in layers:
            v = norm(x, lw["attn_norm"]) @ lw["wv"].T  # [KV * hd]
            z = [v[(h // (H // KV)) * hd:(h // (H // KV) + 1) * hd] for h in range(H)]
            results.append([z[h] @ lw["wo"][:, h * hd:(h + 1) * hd].T for h in range(H)])
            x = x + sum(results[-1])
            n2 = norm(x, lw["ffn_norm"])
            g = n2 @ lw["w1"].T
            x = x + (g / (1 + np.exp(-g)) * (n2 @ lw["w3"].T)) @ lw["w2"].T
        want = results[0][0]
        self.assertLess(np.abs(act["act.result.0"][0, 0] - want).max(), 1e-12 * np.abs(want).max())
        token = ids[1]
        s = 1 / np.sqrt((x * x).mean() + eps)
        a = s * W["final_norm"] * W["out"][token]
        d = logit_attribution(m, ids, 0, token)
        self.assertAlmostEqual(d["dla.scale"][0], s, delta=1e-12 * s)
        for name, want in (("dla.logit", x @ a), ("dla.embed", W["embed"][ids[0]] @ a)):
            self.assertLess(abs(d[name][0] - want), 1e-10 * abs(want), name)
        for l in range(len(layers)):
            for h in range(H):
                want = results[l][h] @ a
                self.assertLess(abs(d["dla.heads"][l, h] - want), 1e-10 * np.abs(a).sum() * np.abs(results[l][h]).max())

    def test_trained_gpt2(self):
        m = self.need("gpt2")
        from kvlens_oracle.attribution import logit_attribution
        ids = self.gpt2_ids()
        self.check_model(m, ids)
        # (c) by hand from the weights, row 0 (which attends only to itself): the final
        # LayerNorm's bias term b_f . u, and every bias term b . a with a = s w_f u centred.
        W = {k: v.numpy() for k, v in m.w.items()}
        layers = [{k: v.numpy() for k, v in lw.items()} for lw in m.layers]
        eps, D = m.cfg["eps"], m.cfg["dim"]

        def ln(v, w, b):
            c = v - v.mean()
            return c / np.sqrt((c * c).mean() + eps) * w + b
        x = W["wte"][ids[0]] + W["wpe"][0]
        for lw in layers:
            v = (ln(x, lw["ln1_w"], lw["ln1_b"]) @ lw["w_qkv"].T + lw["b_qkv"])[2 * D:]
            x = x + v @ lw["w_o"].T + lw["b_o"]
            u = ln(x, lw["ln2_w"], lw["ln2_b"]) @ lw["w_fc"].T + lw["b_fc"]
            g = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u ** 3)))
            x = x + g @ lw["w_proj"].T + lw["b_proj"]
        token, baseline = ids[1], ids[2]
        u = W["out"][token] - W["out"][baseline]
        c = x - x.mean()
        s = 1 / np.sqrt((c * c).mean() + eps)
        a = s * W["lnf_w"] * u
        a = a - a.mean()
        d = logit_attribution(m, ids, 0, token, baseline)
        want = {"dla.logit": ln(x, W["lnf_w"], W["lnf_b"]) @ u, "dla.scale": s,
                "dla.final_norm_bias": W["lnf_b"] @ u, "dla.embed": W["wte"][ids[0]] @ a,
                "dla.pos_embed": W["wpe"][0] @ a}
        for name, w in want.items():
            self.assertLess(abs(d[name][0] - w), 1e-10 * max(abs(w), 1e-3), name)
        for l, lw in enumerate(layers):
            for name, b in (("dla.attn_bias", lw["b_o"]), ("dla.mlp_bias", lw["b_proj"])):
                w = b @ a
                self.assertLess(abs(d[name][l] - w), 1e-10 * np.abs(b * a).sum(), f"{name} {l}")

    def test_gemma2_post_norms_and_capped_logits(self):
        self.check_model(self.gemma2, [1, 5, 300, 17, 42, 383, 0, 9])

    def test_cli(self):
        from kvlens_oracle.attribution import activations, logit_attribution
        ids = [1, 5, 300, 17, 42, 383]
        out = os.path.join(self.tmp.name, "a.kvo")
        cli = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "oracle.py"),
               "--model", self.gemma2_path, "--tokens", " ".join(map(str, ids)), "--out", out]
        subprocess.run(cli + ["--activations", "--logit-attribution", "5:7:9"], check=True)
        c = read_container(out)
        want = {"logits": forward(self.gemma2, ids)[0].detach().numpy(),
                **activations(self.gemma2, ids), **logit_attribution(self.gemma2, ids, 5, 7, 9)}
        self.assertEqual(sorted(c), sorted(want))
        for k, v in want.items():
            np.testing.assert_array_equal(c[k], v, err_msg=k)
        subprocess.run(cli + ["--logit-attribution", "2:300"], check=True)
        c = read_container(out)
        self.assertEqual(sorted(c), sorted(["logits", *logit_attribution(self.gemma2, ids, 2, 300)]))
        self.assertEqual(c["dla.logit"][0], logit_attribution(self.gemma2, ids, 2, 300)["dla.logit"][0])


if __name__ == "__main__":
    unittest.main()
