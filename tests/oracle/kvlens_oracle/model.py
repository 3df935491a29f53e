"""Float64 forward passes written from the equations (Llama and GPT-2; Gemma is a Llama whose
config has gate="gelu_tanh" and embed_scale=sqrt(dim), its norms' 1 + weight taken at load;
Gemma 3 adds per-layer windows (cfg["windowed_layers"]) with their own RoPE base
(cfg["rope_local_base"], no factors), an attention scale (cfg["attn_scale"]) and norms on
each block's output (post_attn_norm, post_ffn_norm) before its residual add; Gemma 2 has
those norms and windows too, and soft-caps scores and logits: cfg["attn_softcap"],
cfg["final_softcap"], each x -> cap * tanh(x / cap)).

forward(model, tokens, doc_ids=None, positions=None) -> (logits [T, V], attn [L, H, T, T]).
Activation steering: `steer=[(layer, point, vector [d][, start]), ...]`, point "pre", "mid"
or "post" (TransformerLens's blocks.{layer}.hook_resid_{point}; steer_hook parses those
names), adds each vector to every row (or, given start, to rows start, start + 1, …: token
indices, which are positions for one sequence) of the residual stream at that point before anything downstream
reads it: "pre" entering the block, "mid" after its attention's residual add (Gemma 2/3:
resid_pre + post_attn_norm(attention)), "post" leaving it (the last block's: the stream
entering the final norm). Entries at one point add up (summed in the order given, then
added once); post of layer l and pre of l + 1 are the same point. steer=None or [] changes
nothing. The captured resid_pre / resid_mid / resid / resid_final are the steered values.
Activation patching: `patch={(layer, point): [(row, vector), ...]}` replaces one row of a
tensor as the forward forms it, before anything downstream reads it: point "pre" the
stream entering the block (layer n_layers: the stream entering the final norm), "attn" /
"mlp" what the attention / FFN adds (after b_O or the block-output norm), "mid" the
stream after the attention's add; point "z" takes (row, head, vector [hd]), that head's
output before W_O (TransformerLens's hook_z), "q", "k" and "v" the same for its query, or
a KV head's key or value, as TransformerLens hooks them: after Qwen3's head norms, before
RoPE (hook_q, hook_k, hook_v), and "pattern" (row, head, probabilities [T]), that head's
attention row before it weighs the values (hook_pattern). patching.py sweeps it.
Everything is differentiable (no in-place ops), so torch.autograd can produce gradients.
Pass `capture={}` to receive capture["embeds"] (the token embeddings, before GPT-2's
positions), capture["resid_final"] (the residual entering the final norm, [T, d]),
capture["ln_final"] (that norm's output, [T, d]) and capture["layers"], one dict a layer:
  q [H, T, hd] (post-RoPE), k, v [KV, T, hd], scores, probs [H, T, T], attn_out [H, T, hd]
  (per head, before W_O), resid [T, d] (leaving the layer);
  q_unrotated, k_unrotated: q and k before RoPE (Llama family only);
  mlp_pre_linear [T, F]: the gated FFN's up projection n2 @ W_up^T (Llama family only);
  resid_pre [T, d] (entering it), resid_mid [T, d] (resid_pre + attn_block);
  o_proj [T, d]: merged heads @ W_O^T, no bias, before any post-attention norm;
  attn_block [T, d]: what attention adds to the stream (o_proj + GPT-2's b_o, or Gemma 2/3's
    post_attn_norm(o_proj));
  mlp_pre [T, F]: n2 @ W_gate^T (GPT-2: n2 @ W_fc^T + b_fc); mlp_post [T, F]: the FFN
    hidden, gate(mlp_pre) * (n2 @ W_up^T) (GPT-2: gelu_tanh(mlp_pre));
  f_proj [T, d]: mlp_post @ W_down^T, no bias, before any post-FFN norm;
  mlp_block [T, d]: what the FFN adds (f_proj + GPT-2's b_proj, or post_ffn_norm(f_proj)).
Every record value is a tensor of the graph (grad.py calls retain_grad() on each).
"""
import math
import re

import torch

F64 = torch.float64


def allowed_mask(T, doc_ids=None, window=None):
    """[T, T] bool: query i may see key j iff j <= i (and same document when doc_ids given;
    and i - j < window when a sliding window is given, as Mistral 7B v0.1's)."""
    idx = torch.arange(T)
    mask = idx[None, :] <= idx[:, None]
    if window is not None:
        mask = mask & (idx[:, None] - idx[None, :] < window)
    if doc_ids is not None:
        d = torch.as_tensor(doc_ids)
        mask = mask & (d[None, :] == d[:, None])
    return mask


def soft_cap(x, cap):
    return x if not cap else cap * torch.tanh(x / cap)


def attention(q, k, v, mask, scale=None, softcap=None):
    """q [H, T, hd]; k, v [H, T, hd] (already expanded for GQA). Returns (out, probs, scores).
    Scores are q.k times scale (default 1/sqrt(hd)), soft-capped when softcap is given."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = soft_cap(q @ k.transpose(-1, -2) * scale, softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if not bool(mask.any(dim=-1).all()):
        raise ValueError("a query row has no visible key")
    m = scores.max(dim=-1, keepdim=True).values
    e = torch.exp(scores - m)
    probs = e / e.sum(dim=-1, keepdim=True)
    return probs @ v, probs, scores


def rms_norm(x, w, eps):
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w


def layer_norm(x, w, b, eps):
    mu = x.mean(dim=-1, keepdim=True)
    var = ((x - mu) ** 2).mean(dim=-1, keepdim=True)  # biased variance
    return (x - mu) / torch.sqrt(var + eps) * w + b


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def silu(x):
    return x / (1.0 + torch.exp(-x))


def rope(x, positions, base, style, factors=None):
    """x [H, T, hd]. style "adjacent": pairs (2i, 2i+1); "half": pairs (i, i + hd/2).
    Pair i is rotated by angle pos * base^(-2i/hd) / factors[i] (Llama 3.1's rope scaling:
    GGUF rope_freqs.weight; no division when factors is None)."""
    hd = x.shape[-1]
    i = torch.arange(hd // 2, dtype=F64)
    freq = base ** (-2.0 * i / hd)
    if factors is not None:
        freq = freq / factors
    ang = positions.to(F64)[:, None] * freq  # [T, hd/2]
    cos, sin = torch.cos(ang), torch.sin(ang)
    if style == "adjacent":
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    if style == "half":
        a, b = x[..., :hd // 2], x[..., hd // 2:]
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    raise ValueError(f"unknown RoPE style {style!r}")


def _heads(x, n, hd):
    return x.reshape(x.shape[0], n, hd).transpose(0, 1)  # [T, n*hd] -> [n, T, hd]


def _merge(x):
    return x.transpose(0, 1).reshape(x.shape[1], -1)  # [n, T, hd] -> [T, n*hd]


def _leaf_prefix(capture, k, v):
    """With capture["kv_leaf_end"] = P: K/V rows of positions < P become fresh leaves (same
    values, no path back into the layers that made them), as a cached prefix is to a
    probe over the tokens after it. The leaves go to capture["kv_leaves"]."""
    P = capture.get("kv_leaf_end") if capture is not None else None
    if not P:
        return k, v
    kl = k[:, :P].detach().clone().requires_grad_(True)
    vl = v[:, :P].detach().clone().requires_grad_(True)
    capture.setdefault("kv_leaves", []).append((kl, vl))
    return torch.cat((kl, k[:, P:]), dim=1), torch.cat((vl, v[:, P:]), dim=1)


def _ablated(mlp_post, ablate_neurons, layer):
    """mlp_post [T, F] with forward's ablate_neurons of `layer` applied (a copy; itself if
    none)."""
    entries = [e for e in (ablate_neurons or ()) if e[0] == layer]
    if not entries:
        return mlp_post
    out = mlp_post.clone()
    for _, neuron, row, mean in entries:
        value = mlp_post[:, neuron].mean() if mean else 0.0
        rows = slice(None) if row is None else row
        out[rows, neuron] = value
    return out


def _record(capture, **kw):
    if capture is not None:
        capture.setdefault("layers", []).append(kw)


def _final(capture, resid_final, ln_final):
    if capture is not None:
        capture["resid_final"], capture["ln_final"] = resid_final, ln_final


STEER_POINTS = ("pre", "mid", "post")
_STEER_HOOK = re.compile(r"blocks\.(\d+)\.hook_resid_(pre|mid|post)")


def steer_hook(name, n_layers):
    """TransformerLens's "blocks.L.hook_resid_pre" / "hook_resid_mid" / "hook_resid_post" ->
    (L, "pre" | "mid" | "post"); ValueError for any other name or L outside [0, n_layers)."""
    g = _STEER_HOOK.fullmatch(name)
    if g is None:
        raise ValueError(f"unknown hook {name!r} (steering takes blocks.L.hook_resid_pre, "
                         "blocks.L.hook_resid_mid or blocks.L.hook_resid_post)")
    layer = int(g.group(1))
    if layer >= n_layers:
        raise ValueError(f"hook {name!r}: layer {layer} out of range [0, {n_layers})")
    return layer, g.group(2)


def _steer_table(m, steer):
    """steer entries -> {(layer, point): [(start, float64 vector [d]), ...]}, checked."""
    table = {}
    for entry in steer or ():
        if len(entry) not in (3, 4):
            raise ValueError("a steering entry is (layer, point, vector[, start])")
        layer, point, vec = entry[:3]
        start = int(entry[3]) if len(entry) == 4 else 0
        if start < 0:
            raise ValueError(f"steering start {start} is negative")
        if point not in STEER_POINTS:
            raise ValueError(f"steering point {point!r} is not one of {STEER_POINTS}")
        if not 0 <= int(layer) < m.cfg["n_layers"]:
            raise ValueError(f"steering layer {layer} out of range [0, {m.cfg['n_layers']})")
        vec = torch.as_tensor(vec, dtype=F64)
        if tuple(vec.shape) != (m.cfg["dim"],):
            raise ValueError(f"steering vector has shape {list(vec.shape)}, the model's "
                             f"residual stream is [{m.cfg['dim']}]")
        table.setdefault((int(layer), point), []).append((start, vec))
    return table


def _steer(x, table, layer, point):
    """x [T, d] plus the steering vectors at (layer, point), each on its rows from its start
    on (those from 0 summed in order first, then added once); x itself if none."""
    entries = table.get((layer, point)) if table else None
    if not entries:
        return x
    whole = [v for start, v in entries if start == 0]
    if whole:
        total = whole[0]
        for v in whole[1:]:
            total = total + v
        x = x + total
    for start, v in entries:
        if start > 0:
            rows = torch.zeros(x.shape[0], 1, dtype=F64)
            rows[start:] = 1
            x = x + rows * v
    return x


def _patched(t, patch, layer, point):
    """t with the rows `patch` gives for (layer, point) replaced (a copy; t if none)."""
    entries = patch.get((layer, point)) if patch else None
    if not entries:
        return t
    t = t.clone()
    for entry in entries:
        if point in ("z", "pattern", "q", "k", "v"):  # t: [heads, T, hd] or [H, T, T]
            row, head, vec = entry
            t[head, row] = torch.as_tensor(vec, dtype=F64)
        else:
            row, vec = entry
            t[row] = torch.as_tensor(vec, dtype=F64)
    return t


def llama_forward(m, x, positions, mask, capture=None, steer=None, patch=None,
                  ablate_neurons=None):
    c = m.cfg
    table = _steer_table(m, steer)
    H, KV, hd, eps = c["n_heads"], c["n_kv_heads"], c["head_dim"], c["eps"]
    group = H // KV
    probs_all = []
    for i, lw in enumerate(m.layers):
        x = _patched(_steer(x, table, i, "pre"), patch, i, "pre")
        n = rms_norm(x, lw["attn_norm"], eps)
        factors, base, layer_mask = c.get("rope_factors"), c["rope_base"], mask
        if c.get("windowed_layers") is not None:  # Gemma 3
            if c["windowed_layers"][i] and c.get("rope_local_base"):
                factors, base, layer_mask = None, c["rope_local_base"], mask[0]
            elif c["windowed_layers"][i]:  # Gemma 2: one RoPE for every layer
                layer_mask = mask[0]
            else:
                layer_mask = mask[1]
        qp, kp, vp = n @ lw["wq"].T, n @ lw["wk"].T, n @ lw["wv"].T
        if "bq" in lw:  # Qwen2's biases
            qp, kp, vp = qp + lw["bq"], kp + lw["bk"], vp + lw["bv"]
        q, k = _heads(qp, H, hd), _heads(kp, KV, hd)
        if "q_norm" in lw:  # Qwen3: RMSNorm over each head's vector, before RoPE
            q, k = rms_norm(q, lw["q_norm"], eps), rms_norm(k, lw["k_norm"], eps)
        q, k = _patched(q, patch, i, "q"), _patched(k, patch, i, "k")
        q_unrotated, k_unrotated = q, k  # TransformerLens's hook_q / hook_k
        q = rope(q, positions, base, c["rope_style"], factors)
        k = rope(k, positions, base, c["rope_style"], factors)
        v = _patched(_heads(vp, KV, hd), patch, i, "v")
        k, v = _leaf_prefix(capture, k, v)
        kv_of_head = torch.arange(H) // group  # GQA: query head h reads KV head h // group
        out, probs, scores = attention(q, k[kv_of_head], v[kv_of_head], layer_mask,
                                       c.get("attn_scale"), c.get("attn_softcap"))
        if patch and (i, "pattern") in patch:
            probs = _patched(probs, patch, i, "pattern")
            out = probs @ v[kv_of_head]
        out = _patched(out, patch, i, "z")
        o_proj = _merge(out) @ lw["wo"].T
        o = o_proj
        if "post_attn_norm" in lw:
            o = rms_norm(o_proj, lw["post_attn_norm"], eps)
        o = _patched(o, patch, i, "attn")
        h = _patched(_steer(x + o, table, i, "mid"), patch, i, "mid")
        n2 = rms_norm(h, lw["ffn_norm"], eps)
        gate = gelu_tanh if c.get("gate") == "gelu_tanh" else silu
        mlp_pre = n2 @ lw["w1"].T
        mlp_pre_linear = n2 @ lw["w3"].T
        mlp_post = _ablated(gate(mlp_pre) * mlp_pre_linear, ablate_neurons, i)
        f_proj = mlp_post @ lw["w2"].T
        f = f_proj
        if "post_ffn_norm" in lw:
            f = rms_norm(f_proj, lw["post_ffn_norm"], eps)
        f = _patched(f, patch, i, "mlp")
        resid_pre, x = x, _steer(h + f, table, i, "post")
        probs_all.append(probs)
        _record(capture, q=q, k=k, v=v, scores=scores, probs=probs, attn_out=out, resid=x,
                resid_pre=resid_pre, resid_mid=h, attn_block=o, mlp_block=f, o_proj=o_proj,
                f_proj=f_proj, mlp_pre=mlp_pre, mlp_post=mlp_post, q_unrotated=q_unrotated,
                k_unrotated=k_unrotated, mlp_pre_linear=mlp_pre_linear)
    x = _patched(x, patch, len(m.layers), "pre")
    n = rms_norm(x, m.w["final_norm"], eps)
    _final(capture, x, n)
    return soft_cap(n @ m.w["out"].T, c.get("final_softcap")), torch.stack(probs_all)


def gpt2_forward(m, x, positions, mask, capture=None, steer=None, patch=None,
                 ablate_neurons=None):
    c = m.cfg
    H, hd, d, eps = c["n_heads"], c["head_dim"], c["dim"], c["eps"]
    table = _steer_table(m, steer)
    x = x + m.w["wpe"][positions]
    probs_all = []
    for i, lw in enumerate(m.layers):
        x = _patched(_steer(x, table, i, "pre"), patch, i, "pre")
        qkv = layer_norm(x, lw["ln1_w"], lw["ln1_b"], eps) @ lw["w_qkv"].T + lw["b_qkv"]
        q, k, v = (_patched(_heads(qkv[:, j * d:(j + 1) * d], H, hd), patch, i, point)
                   for j, point in enumerate("qkv"))
        k, v = _leaf_prefix(capture, k, v)
        out, probs, scores = attention(q, k, v, mask)
        if patch and (i, "pattern") in patch:
            probs = _patched(probs, patch, i, "pattern")
            out = probs @ v
        out = _patched(out, patch, i, "z")
        o_proj = _merge(out) @ lw["w_o"].T
        o = _patched(o_proj + lw["b_o"], patch, i, "attn")
        h = _patched(_steer(x + o, table, i, "mid"), patch, i, "mid")
        n2 = layer_norm(h, lw["ln2_w"], lw["ln2_b"], eps)
        mlp_pre = n2 @ lw["w_fc"].T + lw["b_fc"]
        mlp_post = _ablated(gelu_tanh(mlp_pre), ablate_neurons, i)
        f_proj = mlp_post @ lw["w_proj"].T
        f = _patched(f_proj + lw["b_proj"], patch, i, "mlp")
        resid_pre, x = x, _steer(h + f, table, i, "post")
        probs_all.append(probs)
        _record(capture, q=q, k=k, v=v, scores=scores, probs=probs, attn_out=out, resid=x,
                resid_pre=resid_pre, resid_mid=h, attn_block=o, mlp_block=f, o_proj=o_proj,
                f_proj=f_proj, mlp_pre=mlp_pre, mlp_post=mlp_post)
    x = _patched(x, patch, len(m.layers), "pre")
    n = layer_norm(x, m.w["lnf_w"], m.w["lnf_b"], eps)
    _final(capture, x, n)
    return n @ m.w["out"].T, torch.stack(probs_all)


def forward(m, tokens, doc_ids=None, positions=None, inputs_embeds=None, capture=None,
            steer=None, patch=None, ablate_neurons=None):
    """Full causal pass over `tokens` (list of ids). positions default to 0..T-1;
    `inputs_embeds` [T, d] replaces the token-embedding lookup (Gemma's: the lookup times
    embed_scale) for input gradients; `steer` as in the module docstring;
    `ablate_neurons` [(layer, neuron, row or None, mean)] sets the FFN hidden activation
    (TransformerLens's mlp.hook_post) of that neuron at `row` (None: every row) to 0, or with
    mean=True to its mean over the rows, before the down projection reads it."""
    ids = torch.as_tensor(list(tokens), dtype=torch.long)
    T = ids.shape[0]
    if T == 0:
        raise ValueError("empty token list")
    if int(ids.min()) < 0 or int(ids.max()) >= m.cfg["vocab_size"]:
        raise ValueError(f"token id out of range [0, {m.cfg['vocab_size']})")
    if doc_ids is not None and len(doc_ids) != T:
        raise ValueError("doc_ids must have one entry per token")
    pos = torch.arange(T) if positions is None else torch.as_tensor(list(positions), dtype=torch.long)
    mask = allowed_mask(T, doc_ids, m.cfg.get("sliding_window"))
    if m.cfg.get("windowed_layers") is not None:  # (windowed layers' mask, the others')
        mask = (mask, allowed_mask(T, doc_ids))
    embed = m.w["embed"] if m.family == "llama" else m.w["wte"]
    x = embed[ids] * m.cfg.get("embed_scale", 1.0) if inputs_embeds is None else inputs_embeds
    if capture is not None:
        capture["embeds"] = x
    fwd = llama_forward if m.family == "llama" else gpt2_forward
    return fwd(m, x, pos, mask, capture, steer, patch, ablate_neurons)


def positions_per_document(doc_ids):
    """Positions that restart at 0 at every document boundary."""
    pos, last, count = [], object(), 0
    for d in doc_ids:
        count = count + 1 if d == last else 0
        last = d
        pos.append(count)
    return pos


def greedy(m, prompt, n_new, stop_ids=(), steer=None):
    """Greedy continuation by recomputing the full pass each step (under `steer`, as forward's,
    on every row of every step)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n_new):
            logits, _ = forward(m, seq, steer=steer)
            nxt = int(torch.argmax(logits[-1]))
            seq.append(nxt)
            if nxt in stop_ids:
                break
    return seq[len(prompt):]
