"""Autograd gradients of J = sum over (row, token) of log_softmax(logits[row])[token].

gradients(model, tokens, targets, doc_ids=None) -> dict name -> float64 numpy array:
  objective           [1]
  grad.embeds         [T, d]         input embeddings (GPT-2: token + position sum; Gemma:
                                     times sqrt(d), the first layer's input)
  grad.resid.{l}      [T, d]         residual stream *leaving* layer l
  grad.q.{l}          [H, T, hd]     queries before RoPE (after Qwen3/Gemma 3's head norms),
                                     TransformerLens's hook_q
  grad.k.{l}, grad.v.{l}  [KV, T, hd]  keys before RoPE (hook_k), values; per KV head (GQA:
                                     summed over the query heads)
  grad.rot_q.{l}, grad.rot_k.{l}     q and k after RoPE, what the scores use (rotary models
                                     only: hook_rot_q / hook_rot_k)
  grad.scores.{l}, grad.probs.{l}  [H, T, T]  (masked entries 0)
  grad.attn_out.{l}   [H, T, hd]     attention output per head, before W_O
  grad.w{q,k,v,o}      [out, in]      with param_layer = l: that layer's attention weights
                                     (GPT-2: the Q, K, V row blocks of the fused c_attn)
  grad.hook.{name}.{l}               the gradient at TransformerLens's hook `name` of layer l,
                                     laid out as attribution.py's act.{name}.{l}: resid_pre,
                                     resid_mid, resid_post, attn_out, mlp_out, z, result (each
                                     head o_proj's gradient), q, k (before
                                     RoPE), v, rot_q, rot_k (rotary only), attn_scores,
                                     pattern (masked entries: dO . v, not 0), mlp_pre,
                                     mlp_post, mlp_pre_linear (gated FFN only); and
  grad.hook.ln_final  [T, D]         (no layer) the final norm's output, the unembedding's input
Every intermediate comes from model.forward's capture, with retain_grad().

cached_kv_gradients(model, tokens, target, cached) -> the same J for one (row, token), with
the K/V rows of positions < cached as leaves (a cached prefix; no path back through the
layers that made them):
  objective           [1]
  grad.cached_k.{l}, grad.cached_v.{l}  [cached, KV*hd]  (K after RoPE, as the cache holds it;
                                                   heads side by side)
"""
import torch

from .model import forward


def _attention_weights(m, layer):
    lw = m.layers[layer]
    return [lw["wq"], lw["wk"], lw["wv"], lw["wo"]] if m.family == "llama" else [lw["w_qkv"], lw["w_o"]]


def gradients(m, tokens, targets, doc_ids=None, param_layer=None):
    params = [] if param_layer is None else _attention_weights(m, param_layer)
    for w in params:
        w.requires_grad_(True)
    try:
        return _gradients(m, tokens, targets, doc_ids, param_layer, params)
    finally:
        for w in params:
            w.requires_grad_(False)
            w.grad = None


def _gradients(m, tokens, targets, doc_ids, param_layer, params):
    embed = m.w["embed"] if m.family == "llama" else m.w["wte"]
    ids = torch.as_tensor(list(tokens), dtype=torch.long)
    x0 = (embed[ids] * m.cfg.get("embed_scale", 1.0)).detach().clone().requires_grad_(True)
    capture = {}
    logits, _ = forward(m, tokens, doc_ids=doc_ids, inputs_embeds=x0, capture=capture)
    layers = capture["layers"]
    for rec in layers:
        for t in rec.values():
            t.retain_grad()
    capture["ln_final"].retain_grad()
    logp = torch.log_softmax(logits, dim=-1)
    j = sum(logp[r, t] for r, t in targets)
    j.backward()
    out = {"objective": j.detach().reshape(1).numpy(), "grad.embeds": x0.grad.numpy(),
           "grad.hook.ln_final": capture["ln_final"].grad.numpy()}
    for l, rec in enumerate(layers):
        names = [("resid", "resid"), ("v", "v"), ("scores", "scores"), ("probs", "probs"),
                 ("attn_out", "attn_out")]
        if "q_unrotated" in rec:
            names += [("q", "q_unrotated"), ("k", "k_unrotated"), ("rot_q", "q"), ("rot_k", "k")]
        else:
            names += [("q", "q"), ("k", "k")]
        for name, key in names:
            g = rec[key].grad
            out[f"grad.{name}.{l}"] = (torch.zeros_like(rec[key]) if g is None else g).numpy()
    for l, rec in enumerate(layers):
        out.update(_hook_gradients(rec, l))
    if params:
        if m.family == "llama":
            grads = [w.grad for w in params]
        else:
            d = m.cfg["dim"]
            qkv, wo = params[0].grad, params[1].grad
            grads = [qkv[:d], qkv[d:2 * d], qkv[2 * d:], wo]
        for name, g in zip(("wq", "wk", "wv", "wo"), grads):
            out[f"grad.{name}"] = g.detach().clone().numpy()
    return out


# hook name -> (capture key, whether the capture is head first [heads, T, hd] and the hook
# position first [T, heads, hd])
_HOOK_CAPTURES = {
    "resid_pre": ("resid_pre", False), "resid_mid": ("resid_mid", False),
    "resid_post": ("resid", False), "attn_out": ("attn_block", False),
    "mlp_out": ("mlp_block", False), "z": ("attn_out", True), "v": ("v", True),
    "attn_scores": ("scores", False), "pattern": ("probs", False),
    "mlp_pre": ("mlp_pre", False), "mlp_post": ("mlp_post", False),
    "mlp_pre_linear": ("mlp_pre_linear", False),
}


def _hook_gradients(rec, layer):
    hooks = dict(_HOOK_CAPTURES)
    if "q_unrotated" in rec:
        hooks.update(q=("q_unrotated", True), k=("k_unrotated", True), rot_q=("q", True),
                     rot_k=("k", True))
    else:
        hooks.update(q=("q", True), k=("k", True))
    out = {}
    if "o_proj" in rec and rec["o_proj"].grad is not None:
        # result [T, H, D]: the heads' outputs through W_O sum to o_proj, so each head's
        # gradient is o_proj's
        g = rec["o_proj"].grad
        heads = rec["attn_out"].shape[0]
        out[f"grad.hook.result.{layer}"] = g[:, None, :].expand(-1, heads, -1).numpy()
    for name, (key, head_first) in hooks.items():
        if key not in rec:
            continue
        t = rec[key]
        g = torch.zeros_like(t) if t.grad is None else t.grad
        out[f"grad.hook.{name}.{layer}"] = (g.transpose(0, 1) if head_first else g).numpy()
    return out


def cached_kv_gradients(m, tokens, target, cached):
    if not 0 < cached < len(tokens):
        raise ValueError(f"cached = {cached} must be in [1, {len(tokens) - 1}]")
    capture = {"kv_leaf_end": cached}
    logits, _ = forward(m, tokens, capture=capture)
    row, token = target
    j = torch.log_softmax(logits, dim=-1)[row, token]
    j.backward()
    out = {"objective": j.detach().reshape(1).numpy()}
    for l, (kl, vl) in enumerate(capture["kv_leaves"]):
        for name, leaf in (("k", kl), ("v", vl)):
            g = leaf.grad  # [KV, cached, hd] -> [cached, KV*hd]
            out[f"grad.cached_{name}.{l}"] = g.transpose(0, 1).reshape(cached, -1).numpy()
    return out
