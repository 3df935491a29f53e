"""Checks the oracle against the outside world: llama2.c's run.c reference text for
stories260K, the same model as GGUF and as a HF llama directory, and the file readers.

Run: /usr/bin/python3 -m unittest discover -s tests/oracle -p 'test_*.py'
"""
import contextlib
import copy
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

from kvlens_oracle import SpmTokenizer, forward, greedy, load_model, read_container, write_container  # noqa: E402
from kvlens_oracle.checkpoints import read_llama2c  # noqa: E402
from kvlens_oracle.gguf import GGUFFile  # noqa: E402
import oracle_fixtures as fx  # noqa: E402

TESTDATA = fx.shared_testdata()
REF_PROMPTED = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
                "the park. One day, she saw a big, red ball. She wanted to play with it, but it was "
                "too high.\nLily")
REF_BOS_ONLY = REF_PROMPTED + ("'s mom said, \"Lily, let's go to the park.\" Lily was sad and "
                               "didn't know what to do.")
PROBE = "Once upon a time, there was a little girl named Lily. She loved to play outside"


class ContainerTest(unittest.TestCase):
    def test_roundtrip_and_layout(self):
        arrays = {"logits": np.arange(6.0).reshape(2, 3) / 7, "attn.0": np.ones((1, 2, 2)), "s": np.array(3.5)}
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "x.kvo")
            write_container(p, arrays)
            back = read_container(p)
            with open(p, "rb") as f:
                raw = f.read()
        self.assertEqual(list(back), list(arrays))
        for k in arrays:
            np.testing.assert_array_equal(back[k], arrays[k])
        self.assertEqual(raw[:8], b"KVORACLE")
        self.assertEqual(raw[8:16], (1).to_bytes(4, "little") + (3).to_bytes(4, "little"))
        # first array: name length 6, "logits", ndim 2, dims 2 and 3, then 6 doubles
        self.assertEqual(raw[16:30], (6).to_bytes(4, "little") + b"logits" + (2).to_bytes(4, "little"))
        self.assertEqual(np.frombuffer(raw[30:46], "<i8").tolist(), [2, 3])
        self.assertEqual(np.frombuffer(raw[46:94], "<f8").tolist(), (np.arange(6.0) / 7).tolist())


@unittest.skipIf(TESTDATA is None, "shared testdata absent (set KVLENS_SHARED_DIR); skipping stories260K checks")
class Stories260KTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        d = os.path.join(TESTDATA, "stories260K")
        cls.bin_path, cls.gguf_path = os.path.join(d, "stories260K.bin"), os.path.join(d, "stories260K.gguf")
        cls.tok = SpmTokenizer.from_llama2c(os.path.join(d, "tok512.bin"))
        cls.model = load_model(cls.bin_path)
        cls.ids = cls.tok.encode(PROBE)

    def test_greedy_matches_run_c_with_prompt(self):
        prompt = self.tok.encode("Once upon a time")
        self.assertEqual(prompt, [1, 403, 407, 261, 378])
        # run.c, 64 steps: prints tokens 1..64 of the sequence (prompt tokens included)
        out = greedy(self.model, prompt, 64 - len(prompt) + 1, stop_ids={1})
        self.assertEqual(self.tok.decode(prompt[1:] + out), REF_PROMPTED)

    def test_greedy_matches_run_c_from_bos(self):
        n = len(self.tok.encode(REF_BOS_ONLY, bos=False)) + 2
        text = self.tok.decode(greedy(self.model, [1], n, stop_ids={1}))
        self.assertTrue(text.startswith(REF_BOS_ONLY), text)

    def test_gguf_equals_bin_adjacent_rope(self):
        g = load_model(self.gguf_path)
        self.assertEqual(g.cfg, self.model.cfg)
        with torch.no_grad():
            la, pa = forward(self.model, self.ids)
            lb, pb = forward(g, self.ids)
            self.assertLessEqual(float((la - lb).abs().max()), 1e-12)
            self.assertLessEqual(float((pa - pb).abs().max()), 1e-12)
            half = copy.copy(g)
            half.cfg = dict(g.cfg, rope_style="half")  # the other convention is far off
            self.assertGreater(float((forward(half, self.ids)[0] - la).abs().max()), 1.0)

    def test_gguf_tokenizer_equals_tok512(self):
        gt = SpmTokenizer.from_gguf_metadata(GGUFFile(self.gguf_path).metadata)
        self.assertEqual(gt.pieces[3:], self.tok.pieces[3:])  # specials are spelled differently
        self.assertEqual(gt.encode(PROBE), self.ids)

    def test_hf_llama_half_split_equals_bin(self):
        hdr, t = read_llama2c(self.bin_path)
        with tempfile.TemporaryDirectory() as d, torch.no_grad():
            ref = forward(self.model, self.ids)[0]
            for shards in (1, 3):
                sub = os.path.join(d, f"s{shards}")
                fx.write_hf_llama(sub, hdr, t, self.model.cfg["eps"], shards=shards)
                m = load_model(sub)
                self.assertEqual(m.cfg["rope_style"], "half")
                self.assertLessEqual(float((forward(m, self.ids)[0] - ref).abs().max()), 1e-12)

    def test_llama2c_untied_classifier(self):
        hdr, t = read_llama2c(self.bin_path)
        t["wcls"] = np.random.default_rng(1).normal(0, 0.1, t["token_embedding"].shape)
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "untied.bin")
            fx.write_llama2c(p, hdr, t, untied=True)
            m = load_model(p)
        np.testing.assert_array_equal(m.w["out"].numpy(), t["wcls"].astype(np.float32))
        np.testing.assert_array_equal(m.w["embed"].numpy(), t["token_embedding"])

    def test_gguf_quantized_types_v2(self):
        g = GGUFFile(self.gguf_path)
        # Every type whose blocks fit stories260K's 64-wide rows (the k-quants need 256);
        # its ffn_down rows are 172 wide, so those stay float.
        kinds = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F32"]
        float_kinds = ["F16", "BF16", "F32"]

        def kind_of(i, a):
            if a.ndim != 2:
                return "F32"
            k = kinds[i % len(kinds)]
            return k if a.shape[1] % 32 == 0 or k in float_kinds else float_kinds[i % 3]
        tensors = [(n, a, kind_of(i, a)) for i, (n, a) in enumerate(g.tensors.items())]
        md = {k: v for k, v in g.metadata.items() if not k.startswith("tokenizer.")}
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "mixed.gguf")
            expect = fx.write_gguf(p, md, tensors, version=2, alignment=64)
            q = GGUFFile(p)
            m = load_model(p)
        self.assertEqual(q.version, 2)
        self.assertEqual(set(q.tensor_types.values()), set(kinds))
        for name, want in expect.items():
            self.assertEqual(q.tensors[name].shape, g.tensors[name].shape, name)
            np.testing.assert_array_equal(q.tensors[name], want, err_msg=name)
        with torch.no_grad():
            ref = forward(self.model, self.ids)[0]
            diff = float((forward(m, self.ids)[0] - ref).abs().max())
        # Quantised weights: close, not equal. 4- and 5-bit weights move this model's logits
        # by a few units on a scale of ~20 (llama.cpp's own Q4_0 file of it: 3.8; Q8_0
        # alone: 0.24).
        self.assertGreater(diff, 0.0)
        self.assertLess(diff, 0.2 * float(ref.abs().max()))

    def test_packed_documents_equal_separate_runs(self):
        a, b = self.ids[:9], self.tok.encode("She wanted to play")
        with torch.no_grad():
            lp, pp = forward(self.model, a + b, doc_ids=[0] * len(a) + [1] * len(b))
            la, _ = forward(self.model, a)
            lb, _ = forward(self.model, b)
        # RoPE scores depend only on relative position, so absolute positions are fine here
        self.assertLessEqual(float((lp[:len(a)] - la).abs().max()), 1e-12)
        self.assertLessEqual(float((lp[len(a):] - lb).abs().max()), 1e-10)
        self.assertEqual(float(pp[:, :, len(a):, :len(a)].abs().max()), 0.0)

    def test_attention_rows_are_causal_distributions(self):
        with torch.no_grad():
            _, p = forward(self.model, self.ids)
        T = len(self.ids)
        self.assertEqual(tuple(p.shape), (5, 8, T, T))
        self.assertLessEqual(float((p.sum(-1) - 1).abs().max()), 1e-14)
        self.assertEqual(float(p[..., torch.triu(torch.ones(T, T, dtype=torch.bool), 1)].abs().max()), 0.0)

    def test_autograd_matches_finite_differences(self):
        ids = self.ids[:8]
        emb = self.model.w["embed"][ids].clone().requires_grad_(True)
        logp = lambda e: torch.log_softmax(forward(self.model, ids, inputs_embeds=e)[0][-1], -1)[ids[-1]]  # noqa: E731
        (grad,) = torch.autograd.grad(logp(emb), emb)
        h, worst = 1e-6, 0.0
        with torch.no_grad():
            for (i, j) in [(0, 0), (3, 17), (7, 63), (5, 5)]:
                e1, e2 = emb.detach().clone(), emb.detach().clone()
                e1[i, j] += h
                e2[i, j] -= h
                fd = (logp(e1) - logp(e2)) / (2 * h)
                worst = max(worst, abs(float(fd - grad[i, j])))
        self.assertLess(worst, 1e-7)

    def test_param_gradients_match_finite_differences(self):
        from kvlens_oracle.grad import gradients
        ids, layer = self.ids[:8], 2
        target = [(len(ids) - 1, ids[-1]), (3, ids[4])]
        g = gradients(self.model, ids, target, param_layer=layer)
        lw = self.model.layers[layer]
        self.assertFalse(lw["wq"].requires_grad)  # left as it was

        def j():
            with torch.no_grad():
                logp = torch.log_softmax(forward(self.model, ids)[0], -1)
                return float(sum(logp[r, t] for r, t in target))
        h, worst = 1e-6, 0.0
        for name, (r, c) in [("wq", (0, 0)), ("wk", (5, 17)), ("wv", (7, 3)), ("wo", (60, 9))]:
            w = lw[name]
            old = float(w[r, c])
            w[r, c] = old + h
            jp = j()
            w[r, c] = old - h
            jm = j()
            w[r, c] = old
            worst = max(worst, abs((jp - jm) / (2 * h) - g[f"grad.{name}"][r, c]))
        self.assertLess(worst, 1e-7)

    def test_cached_kv_leaves(self):
        from kvlens_oracle.grad import cached_kv_gradients, gradients
        ids, P = self.ids[:10], 6
        target = (len(ids) - 1, ids[-1])
        leaf = cached_kv_gradients(self.model, ids, target, P)
        full = gradients(self.model, ids, [target])
        self.assertAlmostEqual(float(leaf["objective"][0]), float(full["objective"][0]), places=12)
        L = len(self.model.layers)
        for name in ("k", "v"):
            for layer in range(L):
                g = full[f"grad.{name}.{layer}"]  # [KV, T, hd] -> prefix rows [P, KV*hd]
                prefix = np.transpose(g, (1, 0, 2)).reshape(len(ids), -1)[:P]
                diff = np.abs(leaf[f"grad.cached_{name}.{layer}"] - prefix).max()
                if layer == L - 1:  # nothing downstream of the last layer's K/V but attention
                    self.assertLess(diff, 1e-12)
                elif name == "k":  # earlier layers' K also reach J through later layers
                    self.assertGreater(diff, 1e-6)



class GgufAndHfTest(unittest.TestCase):
    """A random model from make_quantized_gguf.py ARGS as a GGUF (cls.gguf) and the same
    values as a Hugging Face directory (cls.hf), in a temporary folder for the class."""
    ARGS = None

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.gguf = os.path.join(cls.tmp.name, "m.gguf")
        cls.hf = os.path.join(cls.tmp.name, "hf")
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "make_quantized_gguf.py")
        rc = os.system(f"{sys.executable} {script} --out {cls.gguf} --hf {cls.hf} {cls.ARGS}")
        if rc != 0:
            raise RuntimeError("make_quantized_gguf.py failed")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()


class MistralWindowTest(GgufAndHfTest):
    """A random Llama from make_quantized_gguf.py --f32, and the same values as a Mistral
    directory whose sliding_window is 3: within 3 positions the window hides nothing, so both
    give the same logits; past it, each query sees only its last 3 keys."""

    ARGS = "--f32 --hf-type mistral --hf-config '{\"sliding_window\": 3}'"

    def test_window(self):
        full, windowed = load_model(self.gguf), load_model(self.hf)
        self.assertNotIn("sliding_window", full.cfg)
        self.assertEqual(windowed.cfg["sliding_window"], 3)
        ids = [1, 5, 300, 17, 42, 383]
        la, _ = forward(full, ids)
        lb, attn = forward(windowed, ids)
        # Rows 0..2 see the same keys either way (the GGUF's q/k rows came back from HF's
        # half-split order, so this also checks that conversion).
        self.assertLess(float((la[:3] - lb[:3]).abs().max()), 1e-12)
        self.assertGreater(float((la[3:] - lb[3:]).abs().max()), 1e-6)
        # Query 5 attends to keys 3, 4, 5 only, in every layer and head.
        self.assertEqual(float(attn[:, :, 5, :3].abs().max()), 0.0)
        self.assertLess(float((attn[:, :, 5, 3:].sum(-1) - 1).abs().max()), 1e-12)


class Phi3Test(GgufAndHfTest):
    """A random Phi-3 from make_quantized_gguf.py --phi3 --f32 (q, k, v fused in attn_qkv,
    gate and up in ffn_up) with a sliding window of 4, and the same values as a Hugging Face
    directory (qkv_proj, gate_up_proj): the oracle's two readers split them alike, and the
    window binds past 4 positions."""

    ARGS = ("--phi3 --f32 --set phi3.attention.sliding_window=4 "
            "--hf-config '{\"sliding_window\": 4}'")

    def test_gguf_equals_hf_and_the_window_binds(self):
        a, b = load_model(self.gguf), load_model(self.hf)
        self.assertEqual(a.cfg["sliding_window"], 4)
        self.assertEqual(b.cfg["sliding_window"], 4)
        ids = [1, 5, 300, 17, 42, 383, 0, 9]
        la, attn = forward(a, ids)
        lb, _ = forward(b, ids)
        self.assertLess(float((la - lb).abs().max()), 1e-12)
        self.assertEqual(float(attn[:, :, 7, :4].abs().max()), 0.0)
        unwindowed = copy.copy(a)
        unwindowed.cfg = dict(a.cfg, sliding_window=None)
        lu, _ = forward(unwindowed, ids)
        self.assertLess(float((la[:4] - lu[:4]).abs().max()), 1e-12)
        self.assertGreater(float((la[4:] - lu[4:]).abs().max()), 1e-6)
        # The fused rows split as q | k | v and gate | up: layer 0's q is the first 256 rows.
        g = GGUFFile(self.gguf)
        qkv = g.tensors["blk.0.attn_qkv.weight"]
        self.assertEqual(qkv.shape, (256 + 2 * 128, 256))
        self.assertTrue(np.array_equal(a.layers[0]["wq"].numpy(), qkv[:256]))
        self.assertTrue(np.array_equal(a.layers[0]["w3"].numpy(),
                                       g.tensors["blk.0.ffn_up.weight"][512:]))


class Qwen3Test(GgufAndHfTest):
    """A random Qwen3 from make_quantized_gguf.py --qwen3 --f32 --hf: the oracle's GGUF and
    Hugging Face readers give the same model, and its first layer's queries are, per head,
    RMSNorm(W_Q x) ⊙ q_norm rotated, written out here with numpy."""

    ARGS = "--qwen3 --f32"

    def test_gguf_equals_hf(self):
        ids = [1, 5, 300, 17, 42, 383, 0, 9]
        a, b = load_model(self.gguf), load_model(self.hf)
        self.assertEqual(a.cfg["head_dim"], 128)
        self.assertEqual(b.cfg["head_dim"], 128)
        la, lb = forward(a, ids)[0], forward(b, ids)[0]
        self.assertLess(float((la - lb).abs().max()), 1e-12)

    def test_first_layer_queries_by_hand(self):
        m = load_model(self.gguf)
        ids = [1, 5, 300]
        capture = {}
        forward(m, ids, capture=capture)
        q = capture["layers"][0]["q"].detach().numpy()  # [H, T, hd], after RoPE
        lw = {k: v.numpy() for k, v in m.layers[0].items()}
        x = m.w["embed"].numpy()[ids]
        xn = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * lw["attn_norm"]
        hd = 128
        for h in range(4):
            for t in range(3):
                v = xn[t] @ lw["wq"][h * hd:(h + 1) * hd].T
                v = v / np.sqrt((v * v).mean() + 1e-5) * lw["q_norm"]
                i = np.arange(hd // 2)
                ang = t * 10000.0 ** (-2 * i / hd)
                a, b = v[:hd // 2], v[hd // 2:]
                want = np.concatenate([a * np.cos(ang) - b * np.sin(ang),
                                       b * np.cos(ang) + a * np.sin(ang)])
                self.assertLess(np.abs(q[h, t] - want).max(), 1e-12)


class GemmaTest(GgufAndHfTest):
    """A random Gemma from make_quantized_gguf.py --gemma --f32: the GGUF's norms hold
    1 + weight, the Hugging Face directory's the weight alone, and both readers give the
    same model; one token through layer 0 (attention then returns the token's own value
    row) written out here with numpy: embeddings times sqrt(256) = 16, RMSNorm, W_V, W_O,
    and a GELU(tanh)-gated feed-forward."""

    ARGS = "--gemma --f32"

    def test_gguf_equals_hf(self):
        a, b = load_model(self.gguf), load_model(self.hf)
        for m in (a, b):
            self.assertEqual((m.cfg["head_dim"], m.cfg["gate"], m.cfg["embed_scale"]),
                             (256, "gelu_tanh", 16.0))
        ids = [1, 5, 300, 17, 42, 383, 0, 9]
        la, lb = forward(a, ids)[0], forward(b, ids)[0]
        self.assertLess(float((la - lb).abs().max()), 1e-12)
        silu = copy.copy(a)
        silu.cfg = dict(a.cfg, gate=None)
        self.assertGreater(float((forward(silu, ids)[0] - la).abs().max()), 1e-3)

    def test_first_layer_of_one_token_by_hand(self):
        m = load_model(self.gguf)
        capture = {}
        forward(m, [300], capture=capture)
        got = capture["layers"][0]["resid"].detach().numpy()[0]
        lw = {k: v.numpy() for k, v in m.layers[0].items()}
        x = m.w["embed"].numpy()[300] * 16.0

        def norm(v, w):
            return v / np.sqrt((v * v).mean() + 1e-5) * w

        v = norm(x, lw["attn_norm"]) @ lw["wv"].T  # [2 KV heads * 256]
        heads = np.concatenate([v[(h // 2) * 256:(h // 2 + 1) * 256] for h in range(4)])
        h = x + heads @ lw["wo"].T
        n2 = norm(h, lw["ffn_norm"])
        g = n2 @ lw["w1"].T
        gelu = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
        want = h + (gelu * (n2 @ lw["w3"].T)) @ lw["w2"].T
        self.assertLess(np.abs(got - want).max(), 1e-10 * np.abs(want).max())


GEMMA3_CONFIG = ('{"sliding_window": 3, "sliding_window_pattern": 2, "query_pre_attn_scalar": 100, '
                 '"rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, '
                 '"rope_scaling": {"rope_type": "linear", "factor": 8.0}}')


class Gemma3Test(GgufAndHfTest):
    """A random Gemma 3 text model (make_quantized_gguf.py --gemma3 --f32, its Hugging Face
    directory) whose layer 0 attends within 3 keys with RoPE base 1e4 and whose layer 1 sees
    every key with base 1e6 and linear scaling by 8: its scores for query 1 and key 0 in both
    layers, and one token through layer 0, written out here with numpy."""

    ARGS = "--gemma3 --f32 --hf-config '" + GEMMA3_CONFIG + "'"

    @staticmethod
    def norm(v, w):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + 1e-5) * w

    def test_window_binds_in_the_windowed_layer_only(self):
        m = load_model(self.hf)
        self.assertEqual(m.cfg["windowed_layers"], [True, False])
        _, attn = forward(m, [1, 5, 300, 17, 42, 383])
        self.assertEqual(float(attn[0, :, 5, :3].abs().max()), 0.0)
        self.assertGreater(float(attn[1, :, 5, :3].abs().min()), 0.0)

    def test_scores_by_hand(self):
        m = load_model(self.hf)
        ids = [300, 17]
        capture = {}
        forward(m, ids, capture=capture)
        x = m.w["embed"].numpy()[ids] * 16.0
        for layer, (base, factor) in enumerate(((1e4, 1.0), (1e6, 8.0))):
            lw = {k: v.numpy() for k, v in m.layers[layer].items()}
            xn = self.norm(x, lw["attn_norm"])
            i = np.arange(128)
            ang = base ** (-2 * i / 256) / factor  # position 1; position 0 is not turned
            for h in range(4):
                q = self.norm(xn[1] @ lw["wq"][h * 256:(h + 1) * 256].T, lw["q_norm"])
                kv = h // 2
                k = self.norm(xn[0] @ lw["wk"][kv * 256:(kv + 1) * 256].T, lw["k_norm"])
                a, b = q[:128], q[128:]
                q = np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)])
                want = q @ k / 10.0  # query_pre_attn_scalar 100
                got = float(capture["layers"][layer]["scores"][h, 1, 0])
                self.assertLess(abs(got - want), 1e-10 * max(1.0, abs(want)))
            x = capture["layers"][layer]["resid"].detach().numpy()

    def test_one_token_through_layer_0_by_hand(self):
        m = load_model(self.hf)
        capture = {}
        forward(m, [300], capture=capture)
        lw = {k: v.numpy() for k, v in m.layers[0].items()}
        x = m.w["embed"].numpy()[300] * 16.0
        v = self.norm(x, lw["attn_norm"]) @ lw["wv"].T
        heads = np.concatenate([v[(h // 2) * 256:(h // 2 + 1) * 256] for h in range(4)])
        h = x + self.norm(heads @ lw["wo"].T, lw["post_attn_norm"])
        n2 = self.norm(h, lw["ffn_norm"])
        g = n2 @ lw["w1"].T
        gelu = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
        want = h + self.norm((gelu * (n2 @ lw["w3"].T)) @ lw["w2"].T, lw["post_ffn_norm"])
        got = capture["layers"][0]["resid"].detach().numpy()[0]
        self.assertLess(np.abs(got - want).max(), 1e-10 * np.abs(want).max())
        # The stored norms are the weights alone: the oracle added the 1.
        from kvlens_oracle.checkpoints import read_safetensors
        raw = read_safetensors(os.path.join(self.hf, "model.safetensors"))
        stored = raw["model.layers.0.post_feedforward_layernorm.weight"]
        self.assertLess(np.abs(stored + 1 - lw["post_ffn_norm"]).max(), 1e-12)


class Gemma3GgufTest(GgufAndHfTest):
    """A random Gemma 3 of 6 layers as llama.cpp writes one (architecture gemma3, norms
    holding 1 + weight, attention.sliding_window 3, rope.scaling.type linear by 8) and as a
    Hugging Face directory (sliding_window_pattern's default 6): the two readers agree, and
    layer 5 alone sees every key."""

    ARGS = "--gemma3 --layers 6 --f32 --set gemma3.attention.sliding_window=3 --rope-scaling-linear 8"

    def test_gguf_equals_hf(self):
        a, b = load_model(self.gguf), load_model(self.hf)
        for m in (a, b):
            self.assertEqual(m.cfg["windowed_layers"], [True] * 5 + [False])
            self.assertEqual(float(m.cfg["rope_factors"][3]), 8.0)
        ids = [1, 5, 300, 17, 42, 383, 0, 9]
        la, attn = forward(a, ids)
        lb, _ = forward(b, ids)
        # (eps: the GGUF's float32(1e-5) against config.json's 1e-5, in 5 norms a layer)
        self.assertLess(float((la - lb).abs().max()), 1e-10)
        self.assertEqual(float(attn[:5, :, 7, :5].abs().max()), 0.0)
        self.assertGreater(float(attn[5, :, 7, :5].abs().min()), 0.0)


class Gemma2Test(GgufAndHfTest):
    """A random Gemma 2 (make_quantized_gguf.py --gemma2: every other layer windowed, here
    to 3 keys; scores soft-capped at 2 and logits at 3, small enough to bind) as llama.cpp
    writes it and as a Hugging Face directory: the two readers agree; layer 0's score for
    query 1 and key 0 is 2 tanh(q.k / 16 / 2), written out here with numpy; the logits are
    3 tanh(z / 3) of the uncapped ones."""

    ARGS = ("--gemma2 --f32 --set gemma2.attention.sliding_window=3 "
            "--set-float gemma2.attn_logit_softcapping=2 "
            "--set-float gemma2.final_logit_softcapping=3")

    def test_gguf_equals_hf_and_the_caps_bind(self):
        a, b = load_model(self.gguf), load_model(self.hf)
        for m in (a, b):
            self.assertEqual((m.cfg["attn_softcap"], m.cfg["final_softcap"]), (2.0, 3.0))
            self.assertEqual(m.cfg["windowed_layers"], [True, False])
        ids = [1, 5, 300, 17, 42, 383, 0, 9]
        capture = {}
        la, attn = forward(a, ids, capture=capture)
        lb, _ = forward(b, ids)
        self.assertLess(float((la - lb).abs().max()), 1e-10)
        self.assertEqual(float(attn[0, :, 7, :5].abs().max()), 0.0)
        self.assertGreater(float(attn[1, :, 7, :5].abs().min()), 0.0)
        scores = torch.cat([r["scores"][torch.isfinite(r["scores"])] for r in capture["layers"]])
        self.assertLessEqual(float(scores.abs().max()), 2.0)
        self.assertGreater(float(scores.abs().max()), 1.9)  # the cap binds
        self.assertLessEqual(float(la.abs().max()), 3.0)
        self.assertGreater(float(la.abs().max()), 2.5)
        uncapped = copy.copy(a)
        uncapped.cfg = dict(a.cfg, final_softcap=None)
        lu, _ = forward(uncapped, ids)
        self.assertLess(float((3 * torch.tanh(lu / 3) - la).abs().max()), 1e-12)

    def test_first_layer_score_by_hand(self):
        m = load_model(self.gguf)
        ids = [300, 17]
        capture = {}
        forward(m, ids, capture=capture)
        lw = {k: v.numpy() for k, v in m.layers[0].items()}
        x = m.w["embed"].numpy()[ids] * 16.0
        xn = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * lw["attn_norm"]
        ang = 1e4 ** (-2 * np.arange(128) / 256)  # position 1
        for h in range(4):
            q = xn[1] @ lw["wq"][h * 256:(h + 1) * 256].T
            k = xn[0] @ lw["wk"][(h // 2) * 256:(h // 2 + 1) * 256].T
            a, b = q[:128], q[128:]
            q = np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)])
            want = 2 * np.tanh(q @ k / 16 / 2)
            got = float(capture["layers"][0]["scores"][h, 1, 0])
            self.assertLess(abs(got - want), 1e-12)



KJV_GPT2 = os.path.join(fx.repo_root(), "models", "kjv-gpt2-4l")
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
        want = {"act.ln_final": (T, D)}
        for l in range(L):
            for name in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"):
                want[f"act.{name}.{l}"] = (T, D)
            want.update({f"act.z.{l}": (T, H, hd), f"act.result.{l}": (T, H, D),
                         f"act.mlp_pre.{l}": (T, F), f"act.mlp_post.{l}": (T, F),
                         f"act.q.{l}": (T, H, hd), f"act.k.{l}": (T, KV, hd), f"act.v.{l}": (T, KV, hd)})
        self.assertEqual({k: v.shape for k, v in act.items()}, want)
        self.assertTrue(all(v.dtype == np.float64 for v in act.values()))

        # (b) the stream: pre + attn = mid, mid + mlp = post = next layer's pre; heads sum to
        # what attention adds; ln_final times W_U is the logits.
        with torch.no_grad():
            logits = forward(m, ids)[0].numpy()
        emb = m.w["embed" if m.family == "llama" else "wte"].numpy()[ids] * m.cfg.get("embed_scale", 1.0)
        if m.family == "gpt2":
            emb = emb + m.w["wpe"].numpy()[:T]
        np.testing.assert_array_equal(act["act.resid_pre.0"], emb)
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
                o = o / np.sqrt((o * o).mean(-1, keepdims=True) + m.cfg["eps"]) * lw["post_attn_norm"]
            self.assertLess(np.abs(o - a("attn_out")).max(), 1e-12 * np.abs(o).max())
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
