"""GPT-2 family checks: the oracle's batched torch forward against an independent numpy
per-head forward on a tiny random model saved in HF format; file dtypes; the CLI; and,
when a trained model exists under models/*/, sanity of its logits and greedy output."""
import glob
import json
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from kvlens_oracle import forward, greedy, load_model, positions_per_document, read_container  # noqa: E402
from kvlens_oracle.checkpoints import read_safetensors, write_safetensors  # noqa: E402
from kvlens_oracle.gpt2_bpe import ByteBPE  # noqa: E402
import oracle_fixtures as fx  # noqa: E402

TOKENS = [3, 17, 42, 0, 49, 5, 5, 23, 11, 8, 30, 2]


class TinyGpt2Test(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.dir = os.path.join(cls.tmp.name, "tiny")
        cls.sd, cls.cfg = fx.tiny_gpt2(cls.dir)
        cls.model = load_model(cls.dir)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_forward_matches_numpy_per_head(self):
        ref_logits, ref_attn = fx.numpy_gpt2(self.sd, self.cfg, TOKENS)
        with torch.no_grad():
            logits, attn = forward(self.model, TOKENS)
        self.assertEqual(tuple(logits.shape), (len(TOKENS), self.cfg["vocab_size"]))
        self.assertEqual(tuple(attn.shape), (2, 4, len(TOKENS), len(TOKENS)))
        self.assertLessEqual(np.abs(logits.numpy() - ref_logits).max(), 1e-12)
        self.assertLessEqual(np.abs(attn.numpy() - ref_attn).max(), 1e-14)

    def test_conv1d_weights_are_transposed(self):
        d = self.cfg["n_embd"]
        lw = self.model.layers[1]
        self.assertEqual(tuple(lw["w_qkv"].shape), (3 * d, d))
        np.testing.assert_array_equal(lw["w_qkv"].numpy(), self.sd["h.1.attn.c_attn.weight"].T)
        np.testing.assert_array_equal(lw["w_fc"].numpy(), self.sd["h.1.mlp.c_fc.weight"].T)
        np.testing.assert_array_equal(lw["w_proj"].numpy(), self.sd["h.1.mlp.c_proj.weight"].T)
        x = np.random.default_rng(2).normal(size=d)  # Conv1D: y = x W + b == W^T x + b
        np.testing.assert_allclose(lw["w_o"].numpy() @ x, x @ self.sd["h.1.attn.c_proj.weight"], atol=1e-13)

    def test_unprefixed_names_and_sharded_index(self):
        with tempfile.TemporaryDirectory() as d:
            sd, cfg = fx.tiny_gpt2(d, seed=3, prefix=False)
            whole = read_safetensors(os.path.join(d, "model.safetensors"))
            os.remove(os.path.join(d, "model.safetensors"))
            names = sorted(whole)
            wm = {}
            for k, part in enumerate((names[::2], names[1::2])):
                fn = f"model-{k + 1:05d}-of-00002.safetensors"
                write_safetensors(os.path.join(d, fn), {n: whole[n] for n in part})
                wm.update({n: fn for n in part})
            with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
                json.dump({"weight_map": wm}, f)
            with torch.no_grad():
                got = forward(load_model(d), TOKENS)[0].numpy()
        self.assertLessEqual(np.abs(got - fx.numpy_gpt2(sd, cfg, TOKENS)[0]).max(), 1e-12)

    def test_half_precision_files(self):
        for dtype, tdt in (("F16", torch.float16), ("BF16", torch.bfloat16)):
            with tempfile.TemporaryDirectory() as d:
                fx.tiny_gpt2(d)
                write_safetensors(os.path.join(d, "model.safetensors"), self.sd_with_prefix(), dtype)
                m = load_model(d)
            want = torch.from_numpy(self.sd["wte.weight"]).to(tdt).to(torch.float64)  # torch's rounding
            self.assertTrue(torch.equal(m.w["wte"], want), dtype)
            want = torch.from_numpy(self.sd["h.0.attn.c_attn.weight"]).to(tdt).to(torch.float64).T
            self.assertTrue(torch.equal(m.layers[0]["w_qkv"], want), dtype)

    def sd_with_prefix(self):
        return {"transformer." + k: v for k, v in self.sd.items()}

    def test_packed_documents_with_restarted_positions(self):
        a, b = TOKENS[:5], TOKENS[5:]
        docs = [7] * len(a) + [9] * len(b)
        self.assertEqual(positions_per_document(docs), list(range(len(a))) + list(range(len(b))))
        with torch.no_grad():
            lp, pp = forward(self.model, a + b, doc_ids=docs, positions=positions_per_document(docs))
            la, lb = forward(self.model, a)[0], forward(self.model, b)[0]
        self.assertLessEqual(float((lp - torch.cat([la, lb])).abs().max()), 1e-12)
        self.assertEqual(float(pp[:, :, len(a):, :len(a)].abs().max()), 0.0)

    def test_cli_container_and_generate(self):
        out = os.path.join(self.tmp.name, "o.kvo")
        toks = " ".join(map(str, TOKENS))
        cli = [sys.executable, os.path.join(HERE, "oracle.py"), "--model", self.dir]
        subprocess.run(cli + ["--tokens", toks, "--out", out, "--attention"], check=True)
        c = read_container(out)
        self.assertEqual(list(c), ["logits", "attn.0", "attn.1"])
        ref_logits, ref_attn = fx.numpy_gpt2(self.sd, self.cfg, TOKENS)
        self.assertLessEqual(np.abs(c["logits"] - ref_logits).max(), 1e-12)
        self.assertLessEqual(np.abs(c["attn.1"] - ref_attn[1]).max(), 1e-14)
        gen = subprocess.run(cli + ["--generate", "5", "--prompt-tokens", toks], check=True,
                             capture_output=True, text=True).stdout.split()
        self.assertEqual([int(x) for x in gen], greedy(self.model, TOKENS, 5))


def trained_models():
    return sorted(os.path.dirname(p) for p in glob.glob(os.path.join(fx.repo_root(), "models", "*", "config.json"))
                  if glob.glob(os.path.join(os.path.dirname(p), "*.safetensors")))


@unittest.skipUnless(trained_models(), "no trained model under models/*/ yet")
class TrainedModelTest(unittest.TestCase):
    def test_logits_finite_and_greedy_not_degenerate(self):
        for d in trained_models():
            with self.subTest(model=d):
                m = load_model(d)
                tj = os.path.join(d, "tokenizer.json")
                tok = ByteBPE.from_tokenizer_json(tj) if os.path.exists(tj) else None
                prompt = tok.encode("And God said") if tok else [1, 2, 3]
                if tok:
                    self.assertEqual(tok.decode(prompt), "And God said")
                with torch.no_grad():
                    logits, attn = forward(m, prompt)
                self.assertTrue(bool(torch.isfinite(logits).all()))
                out = greedy(m, prompt, 24)
                self.assertGreaterEqual(len(set(out)), 5, out)
                if tok:
                    text = tok.decode(out)
                    self.assertGreaterEqual(sum(ch.isalpha() for ch in text), 20, text)


if __name__ == "__main__":
    unittest.main()
