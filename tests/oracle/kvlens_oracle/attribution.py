"""Cached activations (TransformerLens's run_with_cache) and direct logit attribution, in
float64, from model.forward's capture (no autograd).

activations(model, tokens, doc_ids=None, positions=None) -> dict name -> numpy array
(T tokens, D width, H query heads, KV key/value heads, hd head size, F FFN width):
  act.resid_pre.{l}   [T, D]       residual entering layer l
  act.resid_mid.{l}   [T, D]       resid_pre + attn_out
  act.resid_post.{l}  [T, D]       resid_mid + mlp_out, leaving layer l (= resid_pre.{l+1})
  act.attn_out.{l}    [T, D]       what attention adds to the stream: heads @ W_O^T (+ GPT-2's
                                   b_o; Gemma 2/3: after the post-attention norm)
  act.mlp_out.{l}     [T, D]       what the FFN adds (+ GPT-2's b_proj; Gemma 2/3: after the
                                   post-FFN norm)
  act.z.{l}           [T, H, hd]   each head's attention output, before W_O
  act.result.{l}      [T, H, D]    z[:, h] @ W_O[:, h*hd:(h+1)*hd]^T: no bias, before any
                                   post-attention norm (summed over heads: heads @ W_O^T)
  act.mlp_pre.{l}     [T, F]       gate pre-activation n2 @ W_gate^T (GPT-2: n2 @ W_fc^T + b_fc)
  act.mlp_post.{l}    [T, F]       FFN hidden gate(mlp_pre) * (n2 @ W_up^T) (GPT-2:
                                   gelu_tanh(mlp_pre)), the input of W_down
  act.q.{l}           [T, H, hd]   queries before RoPE (after Qwen3/Gemma 3's head norms), as
                                   TransformerLens's hook_q
  act.k.{l}, act.v.{l}  [T, KV, hd]  keys before RoPE, values (GPT-2: KV = H)
  act.rot_q.{l}, act.rot_k.{l}     q and k after RoPE (rotary models only: hook_rot_q / _k)
  act.mlp_pre_linear.{l}  [T, F]   the gated FFN's up projection (Llama family only)
  act.ln1_scale.{l}, act.ln2_scale.{l}   [T, 1]  the attention / FFN norm's divisor
                      sqrt(mean(x~^2) + eps), x~ = x - mean(x) (GPT-2) or x, of resid_pre /
                      resid_mid (TransformerLens's blocks.{l}.ln1.hook_scale, ln2)
  act.ln1_normalized.{l}, act.ln2_normalized.{l}  [T, D]  x~ / scale: the norm with unit
                      weight and no bias (hook_normalized)
  act.ln_final_scale [T, 1], act.ln_final_normalized [T, D]  the same of the final norm
  act.ln1_post_scale.{l}, act.ln1_post_normalized.{l}, act.ln2_post_…  the same of Gemma 2/3's
                      norms on the attention output (heads @ W_O^T) and on the FFN output
                      (mlp_post @ W_down^T) (TransformerLens's blocks.{l}.ln1_post, ln2_post)
  act.embed           [T, D]       the token embeddings (Gemma's times sqrt(D))
  act.pos_embed       [T, D]       GPT-2's position embeddings (resid_pre.0 = embed + pos_embed)
  act.ln_final        [T, D]       the final norm's output (logits = ln_final @ W_U^T, before
                                   any final soft-cap)

logit_attribution(model, tokens, row, token, baseline=None, doc_ids=None, positions=None)
-> dict name -> numpy array: the direct logit attribution of logit[row, token] (minus
logit[row, baseline] when given), every norm's scale frozen at its value in this run (as
TransformerLens does), so the parts add up exactly. With x the residual entering the final
norm at row, u = W_U[token] (- W_U[baseline]) and w the final norm's weight:
  RMSNorm: s = 1/sqrt(mean(x^2) + eps), a = s * w * u
  GPT-2's LayerNorm: s = 1/sqrt(var(x) + eps) (biased), a = s * w * u - mean(s * w * u)
and every component c of x contributes c . a:
  dla.logit           [1]     ln_final[row] . u: the logit (difference) before any soft-cap
  dla.scale           [1]     s
  dla.embed           [1]     token embedding (times Gemma's sqrt(D); GPT-2: wte only) . a
  dla.pos_embed       [1]     GPT-2: wpe[position of row] . a; 0 otherwise
  dla.attn, dla.mlp   [L]     act.attn_out.{l}[row] . a, act.mlp_out.{l}[row] . a
  dla.final_norm_bias [1]     GPT-2: b_final . u (the LayerNorm's bias, uncentred u); 0 otherwise
  dla.heads           [L, H]  act.result.{l}[row, h] . a', a' = a, or with a post-attention
                              norm (Gemma 2/3) r * w_post_attn * a, r = 1/sqrt(mean(o^2) + eps)
                              of that layer's heads @ W_O^T at row, frozen
  dla.attn_bias       [L]     GPT-2: b_o . a; 0 otherwise
  dla.neurons         [L, F]  act.mlp_post.{l}[row, i] * (W_down[:, i] . a''), a'' = a, or with
                              a post-FFN norm r_f * w_post_ffn * a, r_f from W_down's output
  dla.mlp_bias        [L]     GPT-2: b_proj . a; 0 otherwise
Identities: embed + pos_embed + sum(attn) + sum(mlp) + final_norm_bias = logit;
sum_h heads[l] + attn_bias[l] = attn[l]; sum_i neurons[l] + mlp_bias[l] = mlp[l].
"""
import torch

from .model import forward, layer_norm, rms_norm


def _run(m, tokens, doc_ids, positions):
    capture = {}
    with torch.no_grad():
        logits, _ = forward(m, tokens, doc_ids=doc_ids, positions=positions, capture=capture)
    return logits, capture


def _w_o(m, lw):
    return lw["wo"] if m.family == "llama" else lw["w_o"]


def _head_results(m, lw, z):
    """z [H, T, hd] -> [T, H, D]: each head's output through its slice of W_O."""
    H, hd = z.shape[0], z.shape[2]
    wo = _w_o(m, lw).reshape(-1, H, hd)  # [D, H*hd] -> [D, H, hd]
    return torch.einsum("hte,dhe->thd", z, wo)


def _norm_parts(m, x):
    """TransformerLens's hook_scale [T, 1] and hook_normalized [T, D] of a norm reading x: the
    divisor, and the norm's output with unit weight (no bias)."""
    eps, ones = m.cfg["eps"], torch.ones(x.shape[-1], dtype=x.dtype)
    if m.family == "gpt2":
        centred = x - x.mean(-1, keepdim=True)
        return (torch.sqrt((centred ** 2).mean(-1, keepdim=True) + eps),
                layer_norm(x, ones, torch.zeros_like(ones), eps))
    return torch.sqrt((x * x).mean(-1, keepdim=True) + eps), rms_norm(x, ones, eps)


def activations(m, tokens, doc_ids=None, positions=None):
    _, cap = _run(m, tokens, doc_ids, positions)
    out = {}
    heads = lambda t: t.transpose(0, 1)  # noqa: E731  [n, T, hd] -> [T, n, hd]
    for l, (rec, lw) in enumerate(zip(cap["layers"], m.layers)):
        out.update({
            f"act.resid_pre.{l}": rec["resid_pre"],
            f"act.resid_mid.{l}": rec["resid_mid"],
            f"act.resid_post.{l}": rec["resid"],
            f"act.attn_out.{l}": rec["attn_block"],
            f"act.mlp_out.{l}": rec["mlp_block"],
            f"act.z.{l}": heads(rec["attn_out"]),
            f"act.result.{l}": _head_results(m, lw, rec["attn_out"]),
            f"act.mlp_pre.{l}": rec["mlp_pre"],
            f"act.mlp_post.{l}": rec["mlp_post"],
            f"act.q.{l}": heads(rec.get("q_unrotated", rec["q"])),
            f"act.k.{l}": heads(rec.get("k_unrotated", rec["k"])),
            f"act.v.{l}": heads(rec["v"]),
            f"act.attn_scores.{l}": rec["scores"],  # [H, T, T], head first as TL's
            f"act.pattern.{l}": rec["probs"],
        })
        if "q_unrotated" in rec:  # rotary models: what the scores use
            out[f"act.rot_q.{l}"], out[f"act.rot_k.{l}"] = heads(rec["q"]), heads(rec["k"])
        if "mlp_pre_linear" in rec:  # gated FFNs
            out[f"act.mlp_pre_linear.{l}"] = rec["mlp_pre_linear"]
        norms = [("ln1", rec["resid_pre"]), ("ln2", rec["resid_mid"])]
        if "post_attn_norm" in lw:  # Gemma 2/3's norms on the blocks' outputs
            norms += [("ln1_post", rec["o_proj"]), ("ln2_post", rec["f_proj"])]
        for ln, x in norms:
            out[f"act.{ln}_scale.{l}"], out[f"act.{ln}_normalized.{l}"] = _norm_parts(m, x)
    out["act.ln_final"] = cap["ln_final"]
    out["act.embed"] = cap["embeds"]
    if m.family == "gpt2":
        at = torch.arange(len(tokens)) if positions is None else torch.as_tensor(list(positions))
        out["act.pos_embed"] = m.w["wpe"][at]
    out["act.ln_final_scale"], out["act.ln_final_normalized"] = _norm_parts(m, cap["resid_final"])
    return {k: v.contiguous().numpy() for k, v in out.items()}


def _rms_scale(x, eps):
    return 1.0 / torch.sqrt((x * x).mean() + eps)


def logit_attribution(m, tokens, row, token, baseline=None, doc_ids=None, positions=None):
    T, V = len(tokens), m.cfg["vocab_size"]
    if not 0 <= row < T:
        raise ValueError(f"row {row} out of range [0, {T})")
    for t in (token, baseline):
        if t is not None and not 0 <= t < V:
            raise ValueError(f"token id {t} out of range [0, {V})")
    _, cap = _run(m, tokens, doc_ids, positions)
    eps, gpt2 = m.cfg["eps"], m.family == "gpt2"
    with torch.no_grad():
        W_U = m.w["out"]
        u = W_U[token] - (W_U[baseline] if baseline is not None else 0.0)
        x = cap["resid_final"][row]
        if gpt2:
            s = 1.0 / torch.sqrt(((x - x.mean()) ** 2).mean() + eps)
            a = s * m.w["lnf_w"] * u
            a = a - a.mean()
        else:
            s = _rms_scale(x, eps)
            a = s * m.w["final_norm"] * u
        zero = torch.zeros((), dtype=a.dtype)
        tok = int(tokens[row])
        if gpt2:
            pos = row if positions is None else int(list(positions)[row])
            embed = m.w["wte"][tok] @ a
            pos_embed = m.w["wpe"][pos] @ a
            final_bias = m.w["lnf_b"] @ u
        else:
            embed = (m.w["embed"][tok] * m.cfg.get("embed_scale", 1.0)) @ a
            pos_embed, final_bias = zero, zero
        attn, mlp, heads, attn_bias, neurons, mlp_bias = [], [], [], [], [], []
        for rec, lw in zip(cap["layers"], m.layers):
            attn.append(rec["attn_block"][row] @ a)
            mlp.append(rec["mlp_block"][row] @ a)
            a_attn, a_mlp = a, a
            if "post_attn_norm" in lw:
                a_attn = _rms_scale(rec["o_proj"][row], eps) * lw["post_attn_norm"] * a
            if "post_ffn_norm" in lw:
                a_mlp = _rms_scale(rec["f_proj"][row], eps) * lw["post_ffn_norm"] * a
            result = _head_results(m, lw, rec["attn_out"][:, row:row + 1])[0]  # [H, D]
            heads.append(result @ a_attn)
            w_down = lw["w_proj"] if gpt2 else lw["w2"]  # [D, F]
            neurons.append(rec["mlp_post"][row] * (a_mlp @ w_down))
            attn_bias.append(lw["b_o"] @ a if gpt2 else zero)
            mlp_bias.append(lw["b_proj"] @ a if gpt2 else zero)
        out = {
            "dla.logit": cap["ln_final"][row] @ u,
            "dla.scale": s,
            "dla.embed": embed,
            "dla.pos_embed": pos_embed,
            "dla.attn": torch.stack(attn),
            "dla.mlp": torch.stack(mlp),
            "dla.final_norm_bias": final_bias,
            "dla.heads": torch.stack(heads),
            "dla.attn_bias": torch.stack(attn_bias),
            "dla.neurons": torch.stack(neurons),
            "dla.mlp_bias": torch.stack(mlp_bias),
        }
    return {k: (v.reshape(1) if v.dim() == 0 else v).contiguous().numpy() for k, v in out.items()}
