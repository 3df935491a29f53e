#!/usr/bin/python3
"""Train kvlens' embedded default model: a small GPT-2 on the King James Bible.

Runs with Debian's python3-torch and python3-numpy (use /usr/bin/python3), needs no
downloads: the text comes from the Debian packages bible-kjv-text (the data) and
bible-kjv (the `bible` program that prints it). Everything is seeded.

Writes, into --out (default models/kjv-gpt2-4l):
  model.safetensors        float32, Hugging Face GPT2LMHeadModel tensor names and layout
  config.json              as transformers' GPT2Config writes it
  generation_config.json   BOS/EOS ids and the serving default repetition_penalty
  tokenizer.json           Hugging Face `tokenizers` format, byte-level BPE
  training_log.json        measured losses, throughput, steps, held-out metrics

Data: every chapter is one document (its verses, one per line), documents are separated
by <|endoftext|> (which is also BOS and EOS). Every 20th chapter (chapter index % 20 == 19
in canonical order) is held out and never trained on, nor used to learn the tokenizer.

Typical use (what produced the shipped model; see models/README.md):
  /usr/bin/python3 models/train_default_model.py --steps 450 --extend-to 1000,2000,4000
(it resumes from models/.kjv-train-ckpt.pt when that checkpoint's settings match; a run
whose checkpoint is already at the last stage only re-evaluates and rewrites the files).
"""
import argparse
import collections
import json
import math
import os
import random
import re
import struct
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

EOT = "<|endoftext|>"
HELDOUT_EVERY = 20

# --------------------------------------------------------------------------- data


def load_kjv_chapters():
    """Returns a list of (chapter_ref, text) in canonical order, verses joined by '\\n'."""
    out = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], check=True,
                         capture_output=True, text=True).stdout
    chapters = collections.OrderedDict()
    for line in out.splitlines():
        if not line.strip():
            continue
        ref, _, verse = line.partition(" ")
        chap = ref.rsplit(":", 1)[0]
        chapters.setdefault(chap, []).append(verse.strip())
    return [(k, "\n".join(v)) for k, v in chapters.items()]


def split_chapters(chapters):
    """(train_docs, held_docs, held_refs): every HELDOUT_EVERY-th chapter (index % 20 == 19)
    is held out."""
    train = [t for i, (_, t) in enumerate(chapters) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    held = [t for i, (_, t) in enumerate(chapters) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    refs = [r for i, (r, _) in enumerate(chapters) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    return train, held, refs


def token_stream(tok, docs):
    """One long tensor of ids: <|endoftext|> before every document and after the last."""
    ids = []
    for d in docs:
        ids.append(tok.eot)
        ids.extend(tok.encode(d))
    ids.append(tok.eot)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------- tokenizer


def bytes_to_unicode():
    """GPT-2's reversible byte -> printable unicode character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) \
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


# GPT-2's pattern  's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
# written for Python's `re`: \p{L} -> [^\W\d_], \p{N} -> \d, [^\s\p{L}\p{N}] -> [^\s\w]|_ .
# (Exact for the ASCII text this model is trained on.)
PRETOKENIZE = re.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")


def train_bpe(texts, vocab_size):
    """Byte-level BPE, merges learned by pair frequency over pre-tokenized words.
    Returns (vocab: token->id, merges: list of (a, b)). Ids 0..255 are the bytes (in
    byte order, as their GPT-2 unicode characters), then merges, then <|endoftext|>."""
    b2u = bytes_to_unicode()
    word_freq = collections.Counter()
    for t in texts:
        for w in PRETOKENIZE.findall(t):
            word_freq["".join(b2u[b] for b in w.encode("utf-8"))] += 1
    words = [list(w) for w in word_freq]
    freqs = [word_freq[w] for w in word_freq]
    vocab = {b2u[b]: b for b in range(256)}
    pair_counts = collections.Counter()
    where = collections.defaultdict(set)
    for i, w in enumerate(words):
        for a, b in zip(w, w[1:]):
            pair_counts[(a, b)] += freqs[i]
            where[(a, b)].add(i)
    merges = []
    n_merges = vocab_size - 256 - 1
    while len(merges) < n_merges and pair_counts:
        # most frequent pair; ties broken deterministically by the pair itself
        best = max(pair_counts.items(), key=lambda kv: (kv[1], kv[0]))[0]
        if pair_counts[best] < 2:
            break
        a, b = best
        ab = a + b
        merges.append(best)
        vocab[ab] = len(vocab)
        for i in list(where[best]):
            w = words[i]
            f = freqs[i]
            for x, y in zip(w, w[1:]):
                pair_counts[(x, y)] -= f
                if pair_counts[(x, y)] <= 0:
                    del pair_counts[(x, y)]
            nw, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == a and w[j + 1] == b:
                    nw.append(ab)
                    j += 2
                else:
                    nw.append(w[j])
                    j += 1
            words[i] = nw
            for x, y in zip(nw, nw[1:]):
                pair_counts[(x, y)] += f
                where[(x, y)].add(i)
        del where[best]
        pair_counts.pop(best, None)
    vocab[EOT] = len(vocab)
    return vocab, merges


class BPETokenizer:
    def __init__(self, vocab, merges):
        self.vocab = vocab
        self.inv = {i: t for t, i in vocab.items()}
        self.ranks = {tuple(m): r for r, m in enumerate(merges)}
        self.b2u = bytes_to_unicode()
        self.u2b = {u: b for b, u in self.b2u.items()}
        self.cache = {}
        self.eot = vocab[EOT]

    def _bpe(self, word):
        if word in self.cache:
            return self.cache[word]
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get((x, y), 1 << 30), k) for k, (x, y) in enumerate(zip(parts, parts[1:]))]
            r, k = min(pairs)
            if r == 1 << 30:
                break
            parts = parts[:k] + [parts[k] + parts[k + 1]] + parts[k + 2:]
        ids = [self.vocab[p] for p in parts]
        self.cache[word] = ids
        return ids

    def encode(self, text):
        ids = []
        for w in PRETOKENIZE.findall(text):
            ids.extend(self._bpe("".join(self.b2u[b] for b in w.encode("utf-8"))))
        return ids

    def decode(self, ids):
        out = bytearray()
        for i in ids:
            t = self.inv[int(i)]
            if t == EOT:
                out.extend(t.encode())
            else:
                out.extend(self.u2b[c] for c in t)
        return out.decode("utf-8", errors="replace")


def tokenizer_json(vocab, merges):
    eot = vocab[EOT]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{
            "id": eot, "content": EOT, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": True, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                          "trim_offsets": True, "use_regex": True},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True,
                           "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True,
                    "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None,
            "continuing_subword_prefix": "", "end_of_word_suffix": "",
            "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab,
            "merges": [f"{a} {b}" for a, b in merges],
        },
    }


# --------------------------------------------------------------------------- model


class Block(nn.Module):
    def __init__(self, d, h, eps):
        super().__init__()
        self.h = h
        self.ln_1 = nn.LayerNorm(d, eps=eps)
        self.c_attn = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d, eps=eps)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x, mask):
        B, T, D = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(D, dim=2)
        q = q.view(B, T, self.h, D // self.h).transpose(1, 2)
        k = k.view(B, T, self.h, D // self.h).transpose(1, 2)
        v = v.view(B, T, self.h, D // self.h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D // self.h)
        att = att.masked_fill(mask[:T, :T], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, D)
        x = x + self.attn_proj(y)
        x = x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))
        return x


class GPT2(nn.Module):
    def __init__(self, vocab, n_pos, d, n_layer, n_head, eps=1e-5):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(n_pos, d)
        self.h = nn.ModuleList([Block(d, n_head, eps) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d, eps=eps)
        self.register_buffer("mask", torch.triu(torch.ones(n_pos, n_pos, dtype=torch.bool), 1),
                             persistent=False)
        # GPT-2 initialisation
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)
        for b in self.h:
            for p in (b.attn_proj.weight, b.mlp_proj.weight):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.h:
            x = b(x, self.mask)
        return self.ln_f(x) @ self.wte.weight.t()  # tied lm_head


def hf_state_dict(model):
    """HF GPT2LMHeadModel names; Conv1D weights stored [in, out] (our Linear is [out, in])."""
    sd = {"transformer.wte.weight": model.wte.weight, "transformer.wpe.weight": model.wpe.weight,
          "transformer.ln_f.weight": model.ln_f.weight, "transformer.ln_f.bias": model.ln_f.bias}
    for i, b in enumerate(model.h):
        p = f"transformer.h.{i}."
        sd[p + "ln_1.weight"], sd[p + "ln_1.bias"] = b.ln_1.weight, b.ln_1.bias
        sd[p + "ln_2.weight"], sd[p + "ln_2.bias"] = b.ln_2.weight, b.ln_2.bias
        for name, lin in (("attn.c_attn", b.c_attn), ("attn.c_proj", b.attn_proj),
                          ("mlp.c_fc", b.c_fc), ("mlp.c_proj", b.mlp_proj)):
            sd[p + name + ".weight"] = lin.weight.t()
            sd[p + name + ".bias"] = lin.bias
    return {k: v.detach().to(torch.float32).contiguous().cpu().numpy() for k, v in sd.items()}


def write_safetensors(path, tensors, metadata=None):
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype="<f4")
        raw = a.tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for raw in blobs:
            f.write(raw)
    os.replace(tmp, path)


def hf_config(a, vocab_size, eot):
    return {
        "_name_or_path": "kvlens/kjv-gpt2-4l",
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.0,
        "bos_token_id": eot,
        "embd_pdrop": 0.0,
        "eos_token_id": eot,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05,
        "model_type": "gpt2",
        "n_ctx": a.n_positions,
        "n_embd": a.n_embd,
        "n_head": a.n_head,
        "n_inner": None,
        "n_layer": a.n_layer,
        "n_positions": a.n_positions,
        "reorder_and_upcast_attn": False,
        "resid_pdrop": 0.0,
        "scale_attn_by_inverse_layer_idx": False,
        "scale_attn_weights": True,
        "summary_activation": None,
        "summary_first_dropout": 0.0,
        "summary_proj_to_labels": True,
        "summary_type": "cls_index",
        "summary_use_proj": True,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "transformers_version": "4.40.0",
        "use_cache": True,
        "vocab_size": vocab_size,
    }


# ------------------------------------------------------------------------ training


@torch.no_grad()
def evaluate(model, windows, bs=16):
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, len(windows), bs):
        w = windows[i:i + bs]
        logits = model(w[:, :-1])
        tot += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1),
                               reduction="sum").item()
        n += w[:, 1:].numel()
    model.train()
    return tot / n


@torch.no_grad()
def generate(model, tok, prompt, n, temperature=0.0, top_k=0, seed=0, repetition_penalty=1.0,
             bos=False):
    """With bos, <|endoftext|> comes first (as kvlens-cli generate does by default).
    repetition_penalty: CTRL-style, on every token of the context so far (BOS included):
    logit / θ where positive, logit · θ where negative."""
    g = torch.Generator().manual_seed(seed)
    model.eval()
    ids = ([tok.eot] if bos else []) + tok.encode(prompt)
    start = 1 if bos else 0
    for _ in range(n):
        logits = model(torch.tensor([ids[-model.wpe.weight.shape[0]:]]))[0, -1]
        if repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(ids)))
            lv = logits[seen]
            logits[seen] = torch.where(lv > 0, lv / repetition_penalty, lv * repetition_penalty)
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                v, _ = torch.topk(logits, top_k)
                logits[logits < v[-1]] = float("-inf")
            nxt = int(torch.multinomial(logits.softmax(-1), 1, generator=g))
        if nxt == tok.eot:
            break
        ids.append(nxt)
    model.train()
    return tok.decode(ids[start:])


# Arguments that do not change the trained weights (a checkpoint made with other values of
# these still resumes).
_NOT_TRAINING = ("extend_to", "extend_lr", "threads", "repetition_penalty")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "kjv-gpt2-4l"))
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--n-embd", type=int, default=192)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=6)
    ap.add_argument("--n-positions", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=0, help="total optimizer steps (fixes the LR schedule)")
    ap.add_argument("--budget-minutes", type=float, default=0,
                    help="if --steps is 0: measure step time over the first 30 s and pick steps to fit")
    ap.add_argument("--extend-to", default="",
                    help="continue a finished --steps run in stages, e.g. 1000,2000: each stage "
                         "is a cosine schedule from --extend-lr down to --min-lr (warm restart)")
    ap.add_argument("--extend-lr", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--ckpt-every", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repetition-penalty", type=float, default=1.3,
                    help="serving default written to generation_config.json (not a training "
                         "setting): greedy text of a model this small loops without it")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    if not a.steps and not a.budget_minutes:
        ap.error("give --steps or --budget-minutes")

    t_start = time.time()
    torch.set_num_threads(a.threads)
    random.seed(a.seed)
    np.random.seed(a.seed)
    torch.manual_seed(a.seed)
    os.makedirs(a.out, exist_ok=True)
    ckpt_path = os.path.join(a.out, "..", ".kjv-train-ckpt.pt")

    def log(*s):
        print(f"[{time.time() - t_start:7.1f}s]", *s, flush=True)

    chapters = load_kjv_chapters()
    train_docs, held_docs, held_refs = split_chapters(chapters)
    log(f"{len(chapters)} chapters: {len(train_docs)} train, {len(held_docs)} held out ({held_refs[0]}, {held_refs[1]}, ...)")

    vocab, merges = train_bpe(train_docs, a.vocab_size)
    tok = BPETokenizer(vocab, merges)
    with open(os.path.join(a.out, "tokenizer.json"), "w") as f:
        json.dump(tokenizer_json(vocab, merges), f, ensure_ascii=False, indent=1)
    log(f"tokenizer: {len(vocab)} tokens, {len(merges)} merges, {EOT}={tok.eot}")

    train_ids, held_ids = token_stream(tok, train_docs), token_stream(tok, held_docs)
    assert tok.decode(tok.encode(held_docs[0])) == held_docs[0]
    T = a.n_positions
    nw = (len(held_ids) - 1) // T
    held_windows = torch.stack([held_ids[i * T:i * T + T + 1] for i in range(nw)])
    log(f"tokens: train {len(train_ids)}, held-out {len(held_ids)} ({nw} windows of {T}); "
        f"{sum(len(d) for d in train_docs) / len(train_ids):.2f} chars/token")

    model = GPT2(len(vocab), T, a.n_embd, a.n_layer, a.n_head)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params} parameters")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    data_gen = torch.Generator().manual_seed(a.seed + 1)
    step, total, history, train_time = 0, a.steps, [], 0.0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path)
        base_args = {k: v for k, v in vars(a).items() if k not in _NOT_TRAINING}
        ck_args = {k: v for k, v in ck["args"].items() if k not in _NOT_TRAINING}
        if ck_args == base_args or (not a.steps and ck["args"]["budget_minutes"] == a.budget_minutes):
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            data_gen.set_state(ck["data_gen"])
            torch.set_rng_state(ck["torch_rng"])
            step, total, history, train_time = ck["step"], ck["total"], ck["history"], ck["train_time"]
            log(f"resumed from checkpoint at step {step}/{total}")
    base_total = a.steps or total
    stages = [a.steps] + [int(x) for x in a.extend_to.split(",") if x]
    if len(stages) > 1:
        if not a.steps or any(b <= a_ for a_, b in zip(stages, stages[1:])):
            raise SystemExit("--extend-to needs --steps S (the first run) and increasing totals")
        total = stages[-1]
        log(f"extending the {a.steps}-step run in stages {stages[1:]} (restart lr {a.extend_lr:.1e})")

    def lr_at(s):
        if len(stages) > 1 and s >= base_total:  # later stages: cosine extend_lr → min_lr
            k = max(i for i in range(len(stages) - 1) if stages[i] <= s)
            frac = (s - stages[k]) / max(1, stages[k + 1] - stages[k])
            return a.min_lr + 0.5 * (a.extend_lr - a.min_lr) * (1 + math.cos(math.pi * frac))
        if s < a.warmup:
            return a.lr * (s + 1) / a.warmup
        frac = min(1.0, (s - a.warmup) / max(1, (base_total or total) - a.warmup))
        return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + math.cos(math.pi * frac))

    def save_ckpt():
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "data_gen": data_gen.get_state(),
                    "torch_rng": torch.get_rng_state(), "step": step, "total": total,
                    "history": history, "train_time": train_time, "args": vars(a)}, ckpt_path + ".tmp")
        os.replace(ckpt_path + ".tmp", ckpt_path)

    n_tok = len(train_ids)
    t_loop = time.time()
    t_measure_start, steps_measured = None, 0
    ema = None
    while True:
        if total and step >= total:
            break
        if not total and a.warmup <= step:
            raise SystemExit("warmup ended before the step count was chosen; raise --warmup")
        lr = lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, n_tok - T - 1, (a.batch,), generator=data_gen)
        x = torch.stack([train_ids[s:s + T + 1] for s in starts.tolist()])
        t0 = time.time()
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        dt = time.time() - t0
        train_time += dt
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if not total:
            if step == 3:
                t_measure_start = time.time()
            elif t_measure_start and (time.time() - t_measure_start >= 30 or step >= a.warmup - 1):
                steps_measured = step - 3
                sec_per_step = (time.time() - t_measure_start) / steps_measured
                remaining = a.budget_minutes * 60 - (time.time() - t_start) - 150  # final eval, samples
                # a periodic eval runs forward only (~1/3 of a step's cost per token) on 1/4 of held-out
                eval_sec = len(held_windows[::4]) / a.batch / 3 * sec_per_step
                total = step + int(remaining / (sec_per_step + eval_sec / a.eval_every))
                log(f"measured {sec_per_step:.3f} s/step = {a.batch * T / sec_per_step:.0f} tokens/s; "
                    f"total steps set to {total} (retrain with --steps {total})")
        if step % 5 == 0 or step == 1:
            log(f"step {step}/{total or '?'} loss {loss.item():.4f} (ema {ema:.4f}) lr {lr:.2e} "
                f"{a.batch * T / dt:.0f} tok/s")
        if step % a.eval_every == 0 and total:
            # periodic eval on a quarter of the held-out windows (the final eval uses all)
            hl = evaluate(model, held_windows[::4])
            history.append({"step": step, "train_loss_ema": ema, "heldout_loss_subset": hl})
            log(f"eval step {step}: held-out(1/4) loss {hl:.4f} ppl {math.exp(hl):.2f}")
        if step % a.ckpt_every == 0 and total:
            save_ckpt()

    save_ckpt()
    log("final evaluation on all held-out windows")
    held_loss = evaluate(model, held_windows)
    train_sub = torch.stack([train_ids[i * T:i * T + T + 1] for i in range(0, (n_tok - 1) // T, 64)])
    train_loss = evaluate(model, train_sub)
    log(f"held-out loss {held_loss:.4f} ppl {math.exp(held_loss):.2f}; train(1/64) loss {train_loss:.4f}")

    meta = {"format": "pt", "model": "kjv-gpt2-4l", "steps": str(total)}
    write_safetensors(os.path.join(a.out, "model.safetensors"), hf_state_dict(model), meta)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(hf_config(a, len(vocab), tok.eot), f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(a.out, "generation_config.json"), "w") as f:
        json.dump({"_from_model_config": True, "bos_token_id": tok.eot, "eos_token_id": tok.eot,
                   "repetition_penalty": a.repetition_penalty, "transformers_version": "4.40.0"},
                  f, indent=2)
        f.write("\n")

    samples = {}
    for p in ["And God said", "In the beginning", "The LORD is"]:
        rp = a.repetition_penalty
        samples[p] = {"greedy": generate(model, tok, p, 60),
                      "t0.8_k40_seed0": generate(model, tok, p, 60, 0.8, 40, seed=0),
                      f"bos_greedy_rp{rp:g}": generate(model, tok, p, 40, repetition_penalty=rp,
                                                       bos=True)}
        log(f"greedy  {p!r}: {samples[p]['greedy']!r}")
        log(f"sampled {p!r}: {samples[p]['t0.8_k40_seed0']!r}")
        log(f"BOS + greedy, repetition penalty {rp:g} {p!r}: {samples[p][f'bos_greedy_rp{rp:g}']!r}")
    # a held-out sequence and the training model's logits on it, for verify_default_model.py
    probe = held_windows[0, :T].tolist()
    with torch.no_grad():
        model.eval()
        probe_logits = model(torch.tensor([probe]))[0]
    np.save(os.path.join(a.out, "..", ".kjv-probe-logits.npy"), probe_logits.numpy())
    with open(os.path.join(a.out, "training_log.json"), "w") as f:
        json.dump({"args": vars(a), "parameters": n_params, "steps": total,
                   "tokens_seen": total * a.batch * T, "train_tokens": n_tok,
                   "heldout_tokens_evaluated": int(held_windows[:, 1:].numel()),
                   "heldout_chapters": held_refs, "heldout_loss": held_loss,
                   "heldout_ppl": math.exp(held_loss), "train_loss_subset": train_loss,
                   "train_step_seconds": train_time, "wall_seconds": time.time() - t_start,
                   "tokens_per_second": total * a.batch * T / train_time,
                   "history": history, "samples": samples, "probe_ids": probe,
                   "torch": torch.__version__, "threads": a.threads}, f, indent=1)
    log("done")


if __name__ == "__main__":
    main()
