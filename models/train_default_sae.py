#!/usr/bin/python3
"""Train the default model's sparse autoencoder: a TopK SAE (Gao et al. 2024, "Scaling and
evaluating sparse autoencoders") on kjv-gpt2-4l's residual stream after block 2
(TransformerLens `blocks.2.hook_resid_post`: the third block's output, before ln_f).

Runs with Debian's python3-torch and python3-numpy (use /usr/bin/python3), needs no
downloads: the text comes from the `bible` program as for the model (train_default_model.py,
whose data split, tokenizer class, GPT2 module and safetensors writer it imports).

Writes, into --out (default models/kjv-gpt2-4l-sae), a SAELens directory kvlens loads
(`kvlens-server --sae models/kjv-gpt2-4l-sae`):
  cfg.json                 SAELens config: architecture topk, k 32, d_in 192, d_sae 1536,
                           hook_name blocks.2.hook_resid_post, apply_b_dec_to_input true
  sae_weights.safetensors  float32 W_enc [192, 1536], b_enc [1536], W_dec [1536, 192], b_dec [192]
  training_log.json        training settings and curve; held-out MSE, FVU, L0, dead features,
                           CE loss recovered; a float64 `check` sequence for kvlens' tests;
                           the documented features with their top held-out examples

Steps:
  1. loads models/kjv-gpt2-4l (model.safetensors into train_default_model.GPT2, the inverse
     of its hf_state_dict; the tokenizer from tokenizer.json into its BPETokenizer) and checks
     it: the tensors round-trip bit for bit, the held-out stream tokenizes to the model log's
     probe ids, its logits match models/.kjv-probe-logits.npy when present, and its held-out
     loss is the model log's heldout_loss;
  2. tokenizes the train / held-out chapters exactly as the model's training did (one
     <|endoftext|>-separated stream each) and runs the model over non-overlapping windows of
     256 tokens, keeping every position's block-2 output;
  3. trains the SAE: pre = (x - b_dec) W_enc + b_enc, f = relu of the k largest pre, the
     rest 0, x^ = f W_dec + b_dec; decoder rows unit norm (the gradient's component along
     each row removed before the step, rows renormalised after it); b_dec initialised to the
     geometric median of a sample, W_enc to W_dec^T; loss = MSE + AuxK (dead latents
     reconstruct the residual, coefficient 1/32); Adam; seeded;
  4. evaluates on the held-out windows and writes the files.

  /usr/bin/python3 -u models/train_default_sae.py                # train, evaluate, write
  /usr/bin/python3 -u models/train_default_sae.py --eval-only    # re-evaluate the shipped SAE
  /usr/bin/python3 -u models/train_default_sae.py --dump-features /tmp/f.json
                                              # also the top held-out examples of every feature

--eval-only keeps the weights and the "training" part of the existing training_log.json and
rewrites the rest (held-out metrics, check, features). The documented features (FEATURES
below: ids and readings) were chosen by reading the dump of the shipped SAE; the readings
belong to those weights (a retrain with other BLAS builds or thread counts may number its
features differently).
"""
import argparse
import json
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from train_default_model import (EOT, GPT2, BPETokenizer, hf_state_dict,  # noqa: E402
                                 load_kjv_chapters, split_chapters, token_stream,
                                 write_safetensors)

HOOK_LAYER = 2
HOOK_NAME = f"blocks.{HOOK_LAYER}.hook_resid_post"

# The features documented in models/README.md: id -> one-line reading of its top held-out
# examples (training_log.json "features" has the examples themselves).
FEATURES = {
    12: "the comma after 'it came to pass' (and its time phrase: 'on the morrow', 'after this'), "
        "before 'when' / 'that'",
    6: "the comma that opens direct speech after 'said' / 'said unto him' / 'saying'",
    347: "'saith' (every one in the held-out text), strongest in the prophets' formula "
         "'Thus saith the Lord GOD' / '..., saith the LORD'",
    1376: "the colon ending the first half of a proverb, before the contrast 'but ...' "
          "(Proverbs, Job, Psalms)",
    1338: "the full stop after a number that ends a census line ('six hundred fifty and five.', "
          "Nehemiah 7)",
    501: "'Jesus' (every one in the held-out text), strongest in the epistles' titles "
         "'Christ Jesus', 'Lord Jesus Christ'",
    1233: "the subject of a Gospel narrative clause: 'Jesus' ('Then Jesus answering said'), "
          "'he' ('And he went into')",
    1497: "<|endoftext|>, the chapter separator (every one; weakly the newline between verses)",
}

# --------------------------------------------------------------------------- model


def read_safetensors(path):
    """{name: float32 numpy array} of an F32 safetensors file."""
    with open(path, "rb") as f:
        buf = f.read()
    (n,) = struct.unpack_from("<Q", buf, 0)
    header = json.loads(buf[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32", (name, info["dtype"])
        s, e = info["data_offsets"]
        out[name] = np.frombuffer(buf[8 + n + s:8 + n + e], "<f4").reshape(info["shape"]).copy()
    return out


def load_hf_state_dict(model, sd):
    """The inverse of train_default_model.hf_state_dict: HF GPT2LMHeadModel tensors (Conv1D
    weights [in, out]) into our GPT2 (nn.Linear weights [out, in])."""
    def put(param, name, transpose=False):
        t = torch.from_numpy(sd[name])
        param.data.copy_(t.t() if transpose else t)

    put(model.wte.weight, "transformer.wte.weight")
    put(model.wpe.weight, "transformer.wpe.weight")
    put(model.ln_f.weight, "transformer.ln_f.weight")
    put(model.ln_f.bias, "transformer.ln_f.bias")
    for i, b in enumerate(model.h):
        p = f"transformer.h.{i}."
        for ln, name in ((b.ln_1, "ln_1"), (b.ln_2, "ln_2")):
            put(ln.weight, p + name + ".weight")
            put(ln.bias, p + name + ".bias")
        for name, lin in (("attn.c_attn", b.c_attn), ("attn.c_proj", b.attn_proj),
                          ("mlp.c_fc", b.c_fc), ("mlp.c_proj", b.mlp_proj)):
            put(lin.weight, p + name + ".weight", transpose=True)
            put(lin.bias, p + name + ".bias")


def load_model(model_dir):
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    model = GPT2(cfg["vocab_size"], cfg["n_positions"], cfg["n_embd"], cfg["n_layer"], cfg["n_head"],
                 cfg["layer_norm_epsilon"])
    sd = read_safetensors(os.path.join(model_dir, "model.safetensors"))
    load_hf_state_dict(model, sd)
    model.eval()
    back = hf_state_dict(model)  # the inversion is exact: every tensor round-trips bit for bit
    assert sorted(back) == sorted(sd), set(back) ^ set(sd)
    for k in sd:
        assert np.array_equal(back[k], sd[k]), k
    return model, cfg


def load_tokenizer(model_dir):
    tj = json.load(open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8"))
    vocab = tj["model"]["vocab"]
    merges = [tuple(m.split(" ")) for m in tj["model"]["merges"]]
    for t in tj["added_tokens"]:
        vocab[t["content"]] = t["id"]
    tok = BPETokenizer(vocab, merges)
    assert tok.eot == len(vocab) - 1 and tok.inv[tok.eot] == EOT
    return tok


def resid_after(model, idx, layer=HOOK_LAYER):
    """blocks.{layer}.hook_resid_post: the residual stream after block `layer`."""
    x = model.wte(idx) + model.wpe(torch.arange(idx.shape[1]))
    for b in model.h[:layer + 1]:
        x = b(x, model.mask)
    return x


def logits_from(model, x, layer=HOOK_LAYER):
    """The rest of the forward from blocks.{layer}.hook_resid_post (tied lm_head)."""
    for b in model.h[layer + 1:]:
        x = b(x, model.mask)
    return model.ln_f(x) @ model.wte.weight.t()


@torch.no_grad()
def collect(model, windows, bs=32):
    """[n_windows * T, d] float32: the hook's rows of every position of every window."""
    out = []
    for i in range(0, len(windows), bs):
        out.append(resid_after(model, windows[i:i + bs]).reshape(-1, model.wte.weight.shape[1]))
    return torch.cat(out)


# ----------------------------------------------------------------------------- SAE


def encode_exact(x, W_enc, b_enc, b_dec, k):
    """kvlens' / the oracle's TopK encoder (any dtype): pre = (x - b_dec) W_enc + b_enc; the k
    largest pre (ties: the lower index, by a stable descending sort) keep relu(pre)."""
    pre = (x - b_dec) @ W_enc + b_enc
    idx = torch.sort(pre, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.zeros_like(pre).scatter(-1, idx, torch.relu(pre.gather(-1, idx)))


class TopKSAE(torch.nn.Module):
    def __init__(self, d_in, d_sae, k, gen):
        super().__init__()
        self.k = k
        w = torch.randn(d_sae, d_in, generator=gen)
        w /= w.norm(dim=1, keepdim=True)  # unit-norm decoder rows (random directions)
        self.W_dec = torch.nn.Parameter(w)
        self.W_enc = torch.nn.Parameter(w.t().clone())  # W_enc = W_dec^T
        self.b_enc = torch.nn.Parameter(torch.zeros(d_sae))
        self.b_dec = torch.nn.Parameter(torch.zeros(d_in))

    def pre(self, x):
        return (x - self.b_dec) @ self.W_enc + self.b_enc

    def decode_sparse(self, vals, idx, bias=True):
        """sum_j vals[:, j] W_dec[idx[:, j]] (+ b_dec), without a dense [B, d_sae] product."""
        y = F.embedding_bag(idx, self.W_dec, per_sample_weights=vals, mode="sum")
        return y + self.b_dec if bias else y

    def forward(self, x):
        pre = self.pre(x)
        vals, idx = pre.topk(self.k, dim=-1)
        vals = torch.relu(vals)
        return self.decode_sparse(vals, idx), pre, vals, idx

    @torch.no_grad()
    def project_decoder_grad(self):
        """Remove the gradient's component parallel to each (unit-norm) decoder row."""
        g, w = self.W_dec.grad, self.W_dec.data
        g -= (g * w).sum(dim=1, keepdim=True) * w

    @torch.no_grad()
    def normalize_decoder(self):
        self.W_dec.data /= self.W_dec.data.norm(dim=1, keepdim=True)

    def tensors(self):
        return {n: getattr(self, n).detach().to(torch.float32).contiguous().numpy()
                for n in ("W_enc", "b_enc", "W_dec", "b_dec")}


def geometric_median(x, iters=200, tol=1e-7):
    """Weiszfeld's algorithm, float64."""
    x = x.to(torch.float64)
    m = x.mean(0)
    for _ in range(iters):
        w = 1.0 / (x - m).norm(dim=1).clamp_min(1e-8)
        new = (w[:, None] * x).sum(0) / w.sum()
        if (new - m).norm() <= tol * m.norm().clamp_min(1e-12):
            m = new
            break
        m = new
    return m.to(torch.float32)


def train_sae(acts, a, log):
    gen = torch.Generator().manual_seed(a.seed)
    sae = TopKSAE(acts.shape[1], a.d_sae, a.k, gen)
    sample = acts[torch.randperm(len(acts), generator=gen)[:a.median_sample]]
    with torch.no_grad():
        sae.b_dec.copy_(geometric_median(sample))
    n, B = len(acts), a.batch
    steps_per_epoch = n // B
    total = steps_per_epoch * a.epochs
    opt = torch.optim.Adam(sae.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=a.adam_eps)
    decay_from = int(total * (1 - a.decay_frac))

    def lr_at(s):
        if s < a.warmup:
            return a.lr * (s + 1) / a.warmup
        if s >= decay_from:
            return a.lr * (total - s) / max(1, total - decay_from)
        return a.lr

    # variance of the data around its mean (per element), to report batch FVU
    var = ((sample - sample.mean(0)) ** 2).mean().item()
    last_fired = torch.zeros(a.d_sae, dtype=torch.long)  # tokens seen when each latent last fired
    seen, step, history = 0, 0, []
    k_aux = a.k_aux
    t0 = time.time()
    acc = {"mse": 0.0, "aux": 0.0, "l0": 0.0, "n": 0}
    for epoch in range(a.epochs):
        perm = torch.randperm(n, generator=gen)
        for s in range(steps_per_epoch):
            x = acts[perm[s * B:(s + 1) * B]]
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            x_hat, pre, vals, idx = sae(x)
            mse = ((x_hat - x) ** 2).mean()
            loss = mse
            fired = idx[vals > 0].unique()
            seen += B
            last_fired[fired] = seen
            dead = (seen - last_fired) > a.dead_tokens
            n_dead = int(dead.sum())
            aux = torch.zeros(())
            if a.auxk_coef > 0 and n_dead > 0:
                # AuxK: the k_aux largest pre-activations among dead latents reconstruct the
                # residual e = x - x^ (no bias); pushes gradient into dead latents.
                ka = min(k_aux, n_dead)
                masked = pre.masked_fill(~dead, float("-inf"))
                av, ai = masked.topk(ka, dim=-1)
                e_hat = sae.decode_sparse(torch.relu(av), ai, bias=False)
                e = (x - x_hat).detach()
                aux = ((e_hat - e) ** 2).mean()
                loss = loss + a.auxk_coef * min(1.0, n_dead / k_aux) * aux
            opt.zero_grad(set_to_none=True)
            loss.backward()
            sae.project_decoder_grad()
            opt.step()
            sae.normalize_decoder()
            step += 1
            acc["mse"] += mse.item()
            acc["aux"] += aux.item()
            acc["l0"] += (vals > 0).sum().item() / B
            acc["n"] += 1
            if step % a.log_every == 0 or step == total:
                m = acc["mse"] / acc["n"]
                h = {"step": step, "epoch": epoch + (s + 1) / steps_per_epoch, "lr": lr_at(step - 1),
                     "mse": m, "fvu": m / var, "auxk_mse": acc["aux"] / acc["n"],
                     "l0": acc["l0"] / acc["n"], "dead": n_dead,
                     "seconds": time.time() - t0}
                history.append(h)
                log(f"step {step}/{total} ep {h['epoch']:.2f} mse {m:.5f} fvu {h['fvu']:.4f} "
                    f"aux {h['auxk_mse']:.4f} L0 {h['l0']:.2f} dead {n_dead} lr {h['lr']:.2e} "
                    f"{B * acc['n'] / (time.time() - acc.get('t', t0)):.0f} rows/s")
                acc = {"mse": 0.0, "aux": 0.0, "l0": 0.0, "n": 0, "t": time.time()}
    info = {"steps": total, "steps_per_epoch": steps_per_epoch, "rows_seen": seen,
            "seconds": time.time() - t0, "history": history,
            "dead_at_end_training": int(((seen - last_fired) > a.dead_tokens).sum()),
            "never_fired_in_last_epoch": int((last_fired <= seen - steps_per_epoch * B).sum())}
    return sae, info


# ------------------------------------------------------------------------ evaluation


@torch.no_grad()
def evaluate(model, sae_t, k, held_windows, bs=16):
    """Held-out metrics over every position of the windows' inputs (the first T of T + 1):
    reconstruction, sparsity, dead features and next-token cross-entropy with the hook clean,
    replaced by x^ (spliced) and zero-ablated. Also returns every row's active features
    (values and ids, k per row, descending) for the feature examples."""
    W_enc, b_enc, W_dec, b_dec = (torch.from_numpy(sae_t[n]) for n in ("W_enc", "b_enc", "W_dec", "b_dec"))
    d_in, d_sae = W_enc.shape
    # sums over all rows ("all") and over the windows' position 0 ("pos0"), in float64
    acc = {g: {"n": 0, "se": 0.0, "sx": torch.zeros(d_in, dtype=torch.float64), "sx2": 0.0,
               "norm": 0.0} for g in ("all", "pos0")}
    l0 = 0
    fired = torch.zeros(d_sae, dtype=torch.long)
    ce = {"clean": 0.0, "spliced": 0.0, "zero": 0.0}
    n_pred = 0
    top_vals, top_idx = [], []
    for i in range(0, len(held_windows), bs):
        w = held_windows[i:i + bs]
        inp, tgt = w[:, :-1], w[:, 1:].reshape(-1)
        x = resid_after(model, inp)
        f = encode_exact(x, W_enc, b_enc, b_dec, k)
        x_hat = f @ W_dec + b_dec
        for g, sl in (("all", slice(None)), ("pos0", slice(0, 1))):
            xd, xh = x[:, sl].double().reshape(-1, d_in), x_hat[:, sl].double().reshape(-1, d_in)
            a = acc[g]
            a["n"] += xd.shape[0]
            a["se"] += ((xd - xh) ** 2).sum().item()
            a["sx"] += xd.sum(0)
            a["sx2"] += (xd ** 2).sum().item()
            a["norm"] += xd.norm(dim=1).sum().item()
        active = (f > 0).reshape(-1, d_sae)
        l0 += int(active.sum())
        fired += active.sum(0)
        v, ix = f.reshape(-1, d_sae).topk(k, dim=-1)
        top_vals.append(v)
        top_idx.append(ix)
        for name, h in (("clean", x), ("spliced", x_hat), ("zero", torch.zeros_like(x))):
            lg = logits_from(model, h)
            ce[name] += F.cross_entropy(lg.reshape(-1, lg.shape[-1]), tgt, reduction="sum").item()
        n_pred += tgt.numel()

    def fvu(n, se, sx, sx2):  # sum ||x - x^||^2 / sum ||x - mean(x)||^2
        return se / (sx2 - (sx * sx).sum().item() / n)

    A, P = acc["all"], acc["pos0"]
    rest = {key: A[key] - P[key] for key in ("n", "se", "sx", "sx2", "norm")}
    ce = {n: v / n_pred for n, v in ce.items()}
    res = {
        "rows": A["n"],
        "mse": A["se"] / (A["n"] * d_in),
        "fvu": fvu(A["n"], A["se"], A["sx"], A["sx2"]),
        "l0": l0 / A["n"],
        "dead": int((fired == 0).sum()),
        "ce_clean": ce["clean"], "ce_spliced": ce["spliced"], "ce_zero": ce["zero"],
        "ce_recovered": (ce["zero"] - ce["spliced"]) / (ce["zero"] - ce["clean"]),
        "predicted_tokens": n_pred,
        "mse_note": "mean over rows and the d_in dimensions of (x - x^)^2; fvu over all rows "
                    "with their mean; ce in nats/token over every window's 256 predictions",
        "position0": {"rows": P["n"], "mean_norm": P["norm"] / P["n"], "mse": P["se"] / (P["n"] * d_in),
                      "fvu": fvu(P["n"], P["se"], P["sx"], P["sx2"])},
        "positions_1_to_255": {"rows": rest["n"], "mean_norm": rest["norm"] / rest["n"],
                               "mse": rest["se"] / (rest["n"] * d_in),
                               "fvu": fvu(rest["n"], rest["se"], rest["sx"], rest["sx2"])},
        "feature_firing_rows": {"min": int(fired.min()), "median": float(fired.double().median()),
                                "max": int(fired.max())},
    }
    return res, torch.cat(top_vals), torch.cat(top_idx), fired


@torch.no_grad()
def check_entry(model, sae_t, k, tokens, tok, top_n=5):
    """float64 reference numbers on one sequence, a fresh forward from position 0."""
    m64 = GPT2(model.wte.weight.shape[0], model.wpe.weight.shape[0], model.wte.weight.shape[1],
               len(model.h), model.h[0].h, model.ln_f.eps)
    m64.load_state_dict(model.state_dict())
    m64 = m64.double().eval()
    W_enc, b_enc, W_dec, b_dec = (torch.from_numpy(sae_t[n].astype(np.float64))
                                  for n in ("W_enc", "b_enc", "W_dec", "b_dec"))
    x = resid_after(m64, torch.tensor([tokens]))[0]
    f = encode_exact(x, W_enc, b_enc, b_dec, k)
    x_hat = f @ W_dec + b_dec
    order = torch.sort(f, dim=-1, descending=True, stable=True).indices  # ties: lower index
    pre = torch.sort((x - b_dec) @ W_enc + b_enc, dim=-1, descending=True).values
    fs = torch.sort(f, dim=-1, descending=True).values
    out = {"hook_name": HOOK_NAME, "precision": "float64 (model and SAE weights widened from float32)",
           "tokens": list(tokens), "token_strings": [tok.decode([t]) for t in tokens],
           "top_n": top_n,
           # how far this sequence is from a tie, for a lower-precision implementation:
           # smallest gap between the k-th and (k+1)-th pre-activation (which features are
           # active), and between the top_n-th and (top_n+1)-th activation (the top list)
           "min_gap_kth_pre": float((pre[:, k - 1] - pre[:, k]).min()),
           "min_gap_top_n": float((fs[:, top_n - 1] - fs[:, top_n]).min()),
           "l0": [], "top_features": [], "top_activations": [],
           "rel_error": [], "mse": [], "x_norm": []}
    for p in range(len(tokens)):
        n_act = int((f[p] > 0).sum())
        ids = order[p, :min(top_n, n_act)]
        out["l0"].append(n_act)
        out["top_features"].append([int(i) for i in ids])
        out["top_activations"].append([float(f[p, i]) for i in ids])
        out["rel_error"].append(float((x[p] - x_hat[p]).norm() / x[p].norm()))
        out["mse"].append(float(((x[p] - x_hat[p]) ** 2).mean()))
        out["x_norm"].append(float(x[p].norm()))
    return out


def feature_examples(top_vals, top_idx, held_inputs, tok, n_ex=10, before=8, after=3):
    """{feature: [(activation, row), ...]} the n_ex strongest held-out rows of each feature,
    and a function rendering a row's context (the firing token in [[ ]])."""
    v = top_vals.reshape(-1).numpy()
    fidx = top_idx.reshape(-1).numpy()
    rows = np.repeat(np.arange(top_vals.shape[0]), top_vals.shape[1])
    keep = v > 0
    v, fidx, rows = v[keep], fidx[keep], rows[keep]
    order = np.lexsort((rows, -v, fidx))  # by feature, then activation descending, then row
    v, fidx, rows = v[order], fidx[order], rows[order]
    starts = np.searchsorted(fidx, np.arange(top_idx.max().item() + 2))
    ex = {}
    for f in range(len(starts) - 1):
        s, e = starts[f], min(starts[f + 1], starts[f] + n_ex)
        if e > s:
            ex[f] = [(float(v[j]), int(rows[j])) for j in range(s, e)]
    flat = held_inputs.reshape(-1).tolist()

    def context(r):
        pre = tok.decode(flat[max(0, r - before):r])
        post = tok.decode(flat[r + 1:r + 1 + after])
        return (pre + "[[" + tok.decode([flat[r]]) + "]]" + post).replace("\n", " / ")

    return ex, context, flat


def describe(f, ex, context, flat, books, fired_rows, tok, reading=None, n_show=10):
    """A feature's top held-out examples, and which tokens / books all of its firings are
    on (fired_rows: {feature: (rows, activations)} over every held-out row)."""
    e = ex.get(f, [])
    rows, acts = fired_rows.get(f, (np.zeros(0, np.int64), np.zeros(0, np.float32)))

    def top(items, n=6):
        c = {}
        for it in items:
            c[it] = c.get(it, 0) + 1
        return sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))[:n]

    strong = rows[acts > acts.max() / 2] if len(rows) else rows
    d = {"id": int(f)}
    if reading is not None:
        d["reading"] = reading
    d.update({"fired_rows": int(len(rows)), "fired_fraction": len(rows) / len(flat),
              "max_activation": float(acts.max()) if len(rows) else 0.0,
              "tokens": top(tok.decode([flat[r]]) for r in rows),
              "books": top(books[r] for r in rows),
              "strong_rows": int(len(strong)),
              "strong_books": top(books[r] for r in strong),
              "strong_note": "strong: activation above half the feature's held-out maximum",
              "examples": [{"activation": round(a, 4), "stream_position": r, "context": context(r)}
                           for a, r in e[:n_show]]})
    return d


def firing_rows(top_vals, top_idx):
    """{feature: (rows, activations)} of every held-out row where the feature is active."""
    v = top_vals.reshape(-1).numpy()
    fidx = top_idx.reshape(-1).numpy()
    rows = np.repeat(np.arange(top_vals.shape[0]), top_vals.shape[1])
    keep = v > 0
    v, fidx, rows = v[keep], fidx[keep], rows[keep]
    order = np.argsort(fidx, kind="stable")
    v, fidx, rows = v[order], fidx[order], rows[order]
    bounds = np.flatnonzero(np.diff(fidx)) + 1
    return {int(fs[0]): (rs, vs) for fs, rs, vs in
            zip(np.split(fidx, bounds), np.split(rows, bounds), np.split(v, bounds))}


# ------------------------------------------------------------------------------ main


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(HERE, "kjv-gpt2-4l"))
    ap.add_argument("--out", default=os.path.join(HERE, "kjv-gpt2-4l-sae"))
    ap.add_argument("--d-sae", type=int, default=1536)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1024, help="rows per step")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--decay-frac", type=float, default=0.2, help="linear decay to 0 over the last part")
    ap.add_argument("--adam-eps", type=float, default=6.25e-10)
    ap.add_argument("--k-aux", type=int, default=96, help="AuxK latents (d_in / 2)")
    ap.add_argument("--auxk-coef", type=float, default=1 / 32)
    ap.add_argument("--dead-tokens", type=int, default=250_000,
                    help="a latent that has not fired in this many rows counts as dead (AuxK)")
    ap.add_argument("--median-sample", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--eval-only", action="store_true",
                    help="re-evaluate the SAE in --out (keeps the log's training part)")
    ap.add_argument("--dump-features", metavar="PATH",
                    help="also write the top held-out examples of every feature (JSON)")
    a = ap.parse_args()

    t_start = time.time()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    np.random.seed(a.seed)

    def log(*s):
        print(f"[{time.time() - t_start:7.1f}s]", *s, flush=True)

    model, cfg = load_model(a.model)
    tok = load_tokenizer(a.model)
    mlog = json.load(open(os.path.join(a.model, "training_log.json")))
    T, d_in = cfg["n_positions"], cfg["n_embd"]
    log(f"model {a.model}: {cfg['n_layer']} layers, d {d_in}, vocab {cfg['vocab_size']}; "
        f"tensors round-trip through hf_state_dict bit for bit")

    train_docs, held_docs, held_refs = split_chapters(load_kjv_chapters())
    train_ids, held_ids = token_stream(tok, train_docs), token_stream(tok, held_docs)
    nw = (len(held_ids) - 1) // T
    held_windows = torch.stack([held_ids[i * T:i * T + T + 1] for i in range(nw)])
    ntw = len(train_ids) // T
    train_windows = train_ids[:ntw * T].reshape(ntw, T)
    log(f"tokens: train {len(train_ids)} ({ntw} windows of {T}), held-out {len(held_ids)} "
        f"({nw} windows of {T} + 1)")

    # sanity: the same tokens and the same logits as when the model was trained
    sanity = {"tensors_round_trip": True}
    assert len(train_ids) == mlog["train_tokens"], (len(train_ids), mlog["train_tokens"])
    assert held_refs == mlog["heldout_chapters"]
    probe = held_windows[0, :T]
    assert probe.tolist() == mlog["probe_ids"], "held-out tokens differ from the model's training"
    sanity["probe_ids_match_model_log"] = True
    with torch.no_grad():
        full = model(probe[None])[0]
        split = logits_from(model, resid_after(model, probe[None]))[0]
    sanity["split_forward_max_abs_diff"] = float((full - split).abs().max())
    assert sanity["split_forward_max_abs_diff"] == 0.0
    probe_path = os.path.join(HERE, ".kjv-probe-logits.npy")
    if os.path.exists(probe_path):
        ref = torch.from_numpy(np.load(probe_path))
        sanity["probe_logits_max_abs_diff"] = float((full - ref).abs().max())
        assert sanity["probe_logits_max_abs_diff"] < 1e-4, sanity
    else:
        sanity["probe_logits_max_abs_diff"] = None  # training-time scratch file not present
    log(f"sanity: {sanity}")

    os.makedirs(a.out, exist_ok=True)
    wpath = os.path.join(a.out, "sae_weights.safetensors")
    lpath = os.path.join(a.out, "training_log.json")
    if a.eval_only:
        sae_t = read_safetensors(wpath)
        old = json.load(open(lpath))
        training, targs = old["training"], old["args"]
        log(f"--eval-only: {wpath}")
    else:
        t0 = time.time()
        acts = collect(model, train_windows)
        collect_s = time.time() - t0
        norms = acts.norm(dim=1)
        log(f"collected {tuple(acts.shape)} activations of {HOOK_NAME} in {collect_s:.1f}s; "
            f"row norm mean {norms.mean():.2f}, position 0 {norms.reshape(ntw, T)[:, 0].mean():.2f}")
        sae, training = train_sae(acts, a, log)
        training["collect_seconds"] = collect_s
        training["rows"] = len(acts)
        training["b_dec_init"] = f"geometric median (Weiszfeld) of {a.median_sample} random training rows"
        del acts
        sae_t = sae.tensors()
        targs = {k: v for k, v in vars(a).items() if k not in ("eval_only", "dump_features")}
        log(f"trained in {training['seconds']:.1f}s")
        sae_cfg = {
            "architecture": "topk",
            "d_in": d_in,
            "d_sae": a.d_sae,
            "hook_name": HOOK_NAME,
            "hook_layer": HOOK_LAYER,
            "hook_head_index": None,
            "apply_b_dec_to_input": True,
            "normalize_activations": "none",
            "activation_fn_str": "topk",
            "activation_fn_kwargs": {"k": a.k},
            "finetuning_scaling_factor": False,
            "dtype": "float32",
            "model_name": "kjv-gpt2-4l",
            "context_size": T,
            "prepend_bos": False,
        }
        with open(os.path.join(a.out, "cfg.json"), "w") as f:
            json.dump(sae_cfg, f, indent=2)
            f.write("\n")
        write_safetensors(wpath, {n: sae_t[n] for n in ("W_enc", "b_enc", "W_dec", "b_dec")},
                          {"format": "pt"})
    k = targs["k"]

    t0 = time.time()
    held, top_vals, top_idx, fired = evaluate(model, sae_t, k, held_windows)
    held["seconds"] = time.time() - t0
    log("held-out: " + ", ".join(f"{n} {held[n]:.6g}" for n in
                                 ("mse", "fvu", "l0", "dead", "ce_clean", "ce_spliced", "ce_zero", "ce_recovered")))
    sanity["heldout_loss_model_log"] = mlog["heldout_loss"]
    sanity["ce_clean_minus_model_log"] = held["ce_clean"] - mlog["heldout_loss"]
    assert abs(sanity["ce_clean_minus_model_log"]) < 1e-5, sanity

    check = check_entry(model, sae_t, k, held_ids[:48].tolist(), tok)
    assert check["tokens"][0] == tok.eot

    ex, context, flat = feature_examples(top_vals, top_idx, held_windows[:, :T], tok)
    fired_rows = firing_rows(top_vals, top_idx)
    # the book of every held-out row: chapter j of held_refs starts at its <|endoftext|>
    chapter = np.cumsum(np.asarray(flat) == tok.eot) - 1
    books = [held_refs[c].rstrip("0123456789") for c in chapter]
    features = [describe(f, ex, context, flat, books, fired_rows, tok, reading)
                for f, reading in FEATURES.items()]
    for d in features:
        log(f"feature {d['id']} ({d['reading']}): {d['fired_rows']} rows, tokens {d['tokens'][:3]}; "
            + " | ".join(e["context"] for e in d["examples"][:3]))
    if a.dump_features:
        with open(a.dump_features, "w") as f:
            json.dump([describe(i, ex, context, flat, books, fired_rows, tok, n_show=20)
                       for i in range(a.d_sae)], f, indent=1)
        log(f"wrote {a.dump_features}")

    out = {"sae": {"architecture": "topk", "d_in": d_in, "d_sae": targs["d_sae"], "k": k,
                   "hook_name": HOOK_NAME, "model": "kjv-gpt2-4l"},
           "args": targs,
           "data": {"train_tokens": len(train_ids), "train_windows": ntw, "window": T,
                    "train_rows": ntw * T, "heldout_tokens": len(held_ids), "heldout_windows": nw,
                    "heldout_rows": nw * T},
           "sanity": sanity, "training": training, "heldout": held, "check": check,
           "features": features, "torch": torch.__version__, "threads": a.threads,
           "wall_seconds": time.time() - t_start}
    if a.eval_only:
        out["eval_only_wall_seconds"] = out.pop("wall_seconds")
        out["wall_seconds"] = old.get("wall_seconds")
    with open(lpath, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    log(f"wrote {a.out}")


if __name__ == "__main__":
    main()
