"""Checks the oracle against the outside world: llama2.c's run.c reference text for
stories260K, the same model as GGUF and as a HF llama directory, and the file readers.

Run: /usr/bin/python3 -m unittest discover -s tests/oracle -p 'test_*.py'
"""
import copy
import os
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
PROBE = fx.STORIES_PROBE


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

    def test_query_and_key_gradients_before_and_after_rope(self):
        # grad.q / grad.k (before RoPE, TransformerLens's hook_q / hook_k) are the centred
        # differences of J in a patched q or k row; grad.rot_q / grad.rot_k differ from them
        # (a rotation apart: the same norm per head and row).
        from kvlens_oracle.grad import gradients
        ids = self.ids[:8]
        target = [(len(ids) - 1, ids[-1]), (4, ids[5])]
        g = gradients(self.model, ids, target)
        capture = {}
        with torch.no_grad():
            forward(self.model, ids, capture=capture)

        def j(patch):
            with torch.no_grad():
                logp = torch.log_softmax(forward(self.model, ids, patch=patch)[0], -1)
                return float(sum(logp[r, t] for r, t in target))
        h, worst = 1e-6, 0.0
        for point, layer, head, row, col in [("q", 0, 1, 3, 0), ("q", 2, 4, 6, 5), ("k", 1, 0, 2, 1),
                                             ("k", 3, 3, 5, 7)]:
            base = capture["layers"][layer][f"{point}_unrotated"][head, row].clone()
            fd = []
            for sign in (1, -1):
                vec = base.clone()
                vec[col] += sign * h
                fd.append(j({(layer, point): [(row, head, vec)]}))
            worst = max(worst, abs((fd[0] - fd[1]) / (2 * h) - g[f"grad.{point}.{layer}"][head, row, col]))
        self.assertLess(worst, 1e-7)
        for point in ("q", "k"):
            pre, post = g[f"grad.{point}.1"], g[f"grad.rot_{point}.1"]
            self.assertGreater(np.abs(pre - post).max(), 1e-3 * np.abs(post).max())
            np.testing.assert_allclose(np.linalg.norm(pre, axis=-1), np.linalg.norm(post, axis=-1),
                                       rtol=1e-12, atol=1e-15)

    def test_neuron_ablation_is_a_patch_of_what_the_ffn_adds(self):
        # Zeroing neuron i of layer l (or setting it to its mean) is patching what the FFN adds
        # at each row by itself minus (act[row, i] - value) * W_down[:, i].
        ids, layer, neuron = self.ids[:9], 2, 17
        capture = {}
        with torch.no_grad():
            clean, _ = forward(self.model, ids, capture=capture)
            rec = capture["layers"][layer]
            act, f = rec["mlp_post"], rec["mlp_block"]
            w_down = self.model.layers[layer]["w2"][:, neuron]
            for mean, row in ((False, None), (True, 4)):
                value = act[:, neuron].mean() if mean else 0.0
                rows = range(len(ids)) if row is None else [row]
                patch = {(layer, "mlp"): [(r, f[r] - (act[r, neuron] - value) * w_down)
                                          for r in rows]}
                ablated, _ = forward(self.model, ids, ablate_neurons=[(layer, neuron, row, mean)])
                patched, _ = forward(self.model, ids, patch=patch)
                self.assertLess(float((ablated - patched).abs().max()), 1e-12)
                self.assertGreater(float((ablated - clean).abs().max()), 1e-6)

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
                # [KV, T, hd] -> prefix rows [P, KV*hd]; the cache holds K after RoPE
                g = full[f"grad.rot_k.{layer}" if name == "k" else f"grad.{name}.{layer}"]
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


if __name__ == "__main__":
    unittest.main()
