"""Activation patching sweeps in float64, as TransformerLens's patching module computes them
(get_act_patch_resid_pre, …_resid_mid, …_attn_out, …_mlp_out, …_attn_head_out_by_pos,
…_attn_head_q_by_pos, …_k_by_pos, …_v_by_pos, …_attn_head_pattern_by_pos):
for every layer, (head,) and row, a full forward of `tokens` with that one activation
replaced by the source run's at the same row (model.forward's `patch`), scored by the logit
difference logits[row, a] - logits[row, b] (after any final soft-cap).

patch_sweep(model, tokens, source, hook, row, a, b, all_positions=False) -> dict:
attribution_patch_sweep(...) -> the same dict, each cell estimated to first order (AtP)
qk_fixed_patch_sweep(...) -> the same dict for hook q or k, AtP*'s QK fix: each cell's pattern
  at its layer exact (from the patched forward), the rest to first order
  sweep.clean [1], sweep.source [1]  the score of each prompt's own run
  sweep.metric [L, heads, T]         hook "resid_pre", "resid_mid", "resid_post", "attn_out",
                                     "mlp_out" (heads 1), or per head "q", "z" (its query,
                                     output) or "pattern" (its attention row), or per KV head
                                     "k", "v" (before RoPE, as TransformerLens hooks them);
                                     all_positions: [L, heads, 1], every row patched at once
                                     (TransformerLens's …_all_pos)
"""
import numpy as np
import torch

from .model import forward

# hook -> (the forward's patch point, the capture that holds the source's value, layer shift)
_SITES = {"resid_pre": ("pre", "resid_pre", 0), "resid_mid": ("mid", "resid_mid", 0),
          "resid_post": ("pre", "resid", 1), "attn_out": ("attn", "attn_block", 0),
          "mlp_out": ("mlp", "mlp_block", 0), "z": ("z", "attn_out", 0),
          "pattern": ("pattern", "probs", 0), "q": ("q", "q_unrotated", 0),
          "k": ("k", "k_unrotated", 0), "v": ("v", "v", 0)}
_PER_HEAD = ("q", "k", "v", "z", "pattern")


def _check(m, tokens, source, hook):
    """(point, record, shift, per_head, heads) of `hook`; ValueError when it cannot run."""
    if hook not in _SITES:
        raise ValueError(f"unknown hook {hook!r}; one of {', '.join(_SITES)}")
    if len(source) != len(tokens):
        raise ValueError("the source must have as many tokens as the input")
    point, record, shift = _SITES[hook]
    H = m.cfg["n_heads"]
    per_head = hook in _PER_HEAD
    heads = m.cfg.get("n_kv_heads", H) if hook in ("k", "v") else H if per_head else 1
    return point, record, shift, per_head, heads


def _recorded(cap, l, record):
    layer = cap["layers"][l]
    # (GPT-2 has no RoPE: its q and k are the unrotated ones)
    return layer[record] if record in layer else layer[record.replace("_unrotated", "")]


def patch_sweep(m, tokens, source, hook, row, a, b, all_positions=False):
    point, record, shift, per_head, heads = _check(m, tokens, source, hook)
    L, T = m.cfg["n_layers"], len(tokens)

    def score(**kw):
        logits, _ = forward(m, tokens, **kw)
        return float(logits[row, a] - logits[row, b])

    with torch.no_grad():
        cap = {}
        src_logits, _ = forward(m, source, capture=cap)
        cells = _cells(T, all_positions)
        metric = np.zeros((L, heads, len(cells)))
        for l in range(L):
            value = _recorded(cap, l, record)
            for h in range(heads):
                for j, rows in enumerate(cells):
                    if per_head:
                        patch = {(l, point): [(i, h, value[h, i]) for i in rows]}
                    else:
                        patch = {(l + shift, point): [(i, value[i]) for i in rows]}
                    metric[l, h, j] = score(patch=patch)
        return {"sweep.clean": np.array([score()]),
                "sweep.source": np.array([float(src_logits[row, a] - src_logits[row, b])]),
                "sweep.metric": metric}


def _cells(T, all_positions):
    """The rows of each cell: one each, or with all_positions every row in one."""
    return [range(T)] if all_positions else [[i] for i in range(T)]


def _estimate_start(m, tokens, source, row, a, b, heads, all_positions):
    """What both estimates start from: the two runs' captures, the input's probabilities
    [L, H, T, T] and score, and the result dict with clean, source and a zero metric."""
    cap, src_cap = {}, {}
    with torch.no_grad():
        logits, probs = forward(m, tokens, capture=cap)
        src_logits, _ = forward(m, source, capture=src_cap)
    clean = float(logits[row, a] - logits[row, b])
    result = {"sweep.clean": np.array([clean]),
              "sweep.source": np.array([float(src_logits[row, a] - src_logits[row, b])]),
              "sweep.metric": np.zeros((m.cfg["n_layers"], heads,
                                        len(_cells(len(tokens), all_positions))))}
    return cap, src_cap, probs, clean, result


def attribution_patch_sweep(m, tokens, source, hook, row, a, b, all_positions=False):
    """The same grid by attribution patching: each cell clean + sum over the patched values
    of (source - clean) * d score / d value, the gradient by torch.autograd through the
    forward with the layer's whole tensor at `hook` made a leaf (patched with its own clean
    values), one backward per layer."""
    point, record, shift, per_head, heads = _check(m, tokens, source, hook)
    L, T = m.cfg["n_layers"], len(tokens)
    cap, src_cap, _, clean, result = _estimate_start(m, tokens, source, row, a, b, heads,
                                                     all_positions)
    cells, metric = _cells(T, all_positions), result["sweep.metric"]
    for l in range(L):
        value = _recorded(cap, l, record)
        leaf = value.detach().clone().requires_grad_(True)
        if per_head:
            patch = {(l, point): [(i, h, leaf[h, i]) for h in range(heads) for i in range(T)]}
        else:
            patch = {(l + shift, point): [(i, leaf[i]) for i in range(T)]}
        out, _ = forward(m, tokens, patch=patch)
        (out[row, a] - out[row, b]).backward()
        # per (head,) row: the sum over the vector of (source - clean) * gradient
        moved = ((_recorded(src_cap, l, record) - value) * leaf.grad).sum(-1).numpy()
        moved = moved.reshape(heads, T)
        for j, rows in enumerate(cells):
            metric[l, :, j] = clean + moved[:, list(rows)].sum(-1)
    return result


def qk_fixed_patch_sweep(m, tokens, source, hook, row, a, b, all_positions=False):
    """AtP*'s QK fix (Kramar et al. 2024) for a q or k sweep: each cell clean + the sum over
    its layer's pattern of (A' - A) * d score / d A, A' the pattern of the forward with the
    cell's query or key patched from the source (as patch_sweep runs it), the gradient by
    torch.autograd through the forward with that layer's pattern made a leaf."""
    if hook not in ("q", "k"):
        raise ValueError("the QK fix is for hook q or k")
    point, record, shift, per_head, heads = _check(m, tokens, source, hook)
    L, T, H = m.cfg["n_layers"], len(tokens), m.cfg["n_heads"]
    _, src_cap, probs, clean, result = _estimate_start(m, tokens, source, row, a, b, heads,
                                                       all_positions)
    cells, metric = _cells(T, all_positions), result["sweep.metric"]
    for l in range(L):
        leaf = probs[l].detach().clone().requires_grad_(True)
        out, _ = forward(m, tokens, patch={(l, "pattern"): [(i, h, leaf[h, i])
                                                            for h in range(H) for i in range(T)]})
        (out[row, a] - out[row, b]).backward()
        value = _recorded(src_cap, l, record)
        with torch.no_grad():
            for h in range(heads):
                for j, rows in enumerate(cells):
                    _, patched = forward(m, tokens,
                                         patch={(l, point): [(i, h, value[h, i]) for i in rows]})
                    metric[l, h, j] = clean + float(((patched[l] - probs[l]) * leaf.grad).sum())
    return result
