#!/usr/bin/python3
"""kvlens float64 oracle CLI (run with Debian's /usr/bin/python3, which has torch).

  oracle.py --model PATH --tokens "1 2 3" [--doc-ids "0 0 1"] [--positions-per-doc]
            --out FILE [--attention]
  oracle.py --model PATH --generate N --prompt-tokens "1 403 407"
  oracle.py --model PATH --tokens "1 2 3" --out FILE --grad-logprob "2:7 1:5"
  oracle.py --model PATH --tokens "1 2 3" --out FILE --grad-logprob "2:7" --grad-cached-kv 2
  oracle.py --model PATH --tokens "1 2 3" --out FILE --activations
  oracle.py --model PATH --tokens "1 2 3" --out FILE --logit-attribution "2:7"   (or "2:7:5")
  oracle.py --model PATH --tokens "1 2 3" --out FILE --sae SAE_PATH[@HOOK]
  oracle.py --model PATH --tokens "1 2 3" --out FILE --steer HOOK:FILE[:COEF] [--steer ...]
  oracle.py --model PATH --generate N --prompt-tokens "1 403" --steer HOOK:FILE[:COEF]
  oracle.py --model PATH --tokens "1 2 3" --out FILE --patch-sweep HOOK:ROW:A:B \
            --source-tokens "1 5 3" [--patch-all-positions] [--patch-attribution | --patch-qk-fix]
  oracle.py --model PATH --tokens "1 2 3" --out FILE --ablate-neuron L:N[:ROW] [--ablate-mean]

--activations adds every cached activation (TransformerLens's run_with_cache):
act.resid_pre/resid_mid/resid_post/attn_out/mlp_out.{l} [T, D], act.z.{l} [T, H, hd],
act.result.{l} [T, H, D], act.mlp_pre/mlp_post.{l} [T, F], act.q.{l} [T, H, hd],
act.k/v.{l} [T, KV, hd], act.attn_scores/pattern.{l} [H, T, T] (masked: -inf / 0),
act.ln_final [T, D].
--logit-attribution "row:token[:baseline]" adds the direct logit attribution of
logit[row, token] (minus logit[row, baseline]) with the norms' scales frozen: dla.logit,
dla.scale, dla.embed, dla.pos_embed, dla.final_norm_bias [1], dla.attn, dla.mlp,
dla.attn_bias, dla.mlp_bias [L], dla.heads [L, H], dla.neurons [L, F].
kvlens_oracle/attribution.py defines every array.
--sae SAE_PATH[@HOOK] runs a sparse autoencoder (a SAELens directory, or a Gemma Scope
.npz; kvlens_oracle/sae.py) on the rows of its hook (TransformerLens names:
blocks.L.hook_resid_pre / hook_resid_mid / hook_resid_post / hook_attn_out / hook_mlp_out,
blocks.L.attn.hook_z with the heads side by side) and adds sae.input [T, d_in] (those rows),
sae.acts [T, d_sae] (the features) and sae.recon [T, d_in] (sae.acts @ W_dec + b_dec).
@HOOK overrides or supplies the cfg's hook_name; an .npz, which names none, needs it.
--steer HOOK:FILE[:COEF[:START]] (repeatable) adds COEF (default 1) times the vector in FILE
(d_model whitespace-separated floats) to every row (from row START on) of the residual stream at HOOK
(blocks.L.hook_resid_pre / hook_resid_mid / hook_resid_post) during the pass, for the
logits of --tokens and for each step of --generate; entries at one point add up
(kvlens_oracle/model.py). Not with --grad-logprob, --activations, --logit-attribution, --sae.

--patch-sweep HOOK:ROW:A:B with --source-tokens (as many as --tokens) adds an activation
patching sweep (kvlens_oracle/patching.py): sweep.metric [L, heads or 1, T], each layer's
(and head's, for q, z and pattern; KV head's, for k and v) row of HOOK (resid_pre, resid_mid,
resid_post, attn_out, mlp_out, q, k, v, z, pattern) taken from the source's run, scored by
logits[ROW, A] - logits[ROW, B]; sweep.clean, sweep.source. --patch-all-positions: one cell
per layer (and head) with every row of HOOK patched at once, sweep.metric [L, heads or 1, 1].
--patch-attribution: each cell by attribution patching instead (clean + (source - clean) .
gradient, torch.autograd), the same arrays. --patch-qk-fix (hook q or k): AtP*'s QK fix,
clean + (patched pattern - clean pattern) . the pattern's gradient at the cell's layer.

PATH: a llama2.c .bin, a GGUF file (llama), or a Hugging Face directory (gpt2 / llama).
The output container format is described in README.md and kvlens_oracle/container.py.
"""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from kvlens_oracle import forward, greedy, load_model, positions_per_document, write_container  # noqa: E402


def _ints(text):
    return [int(x) for x in text.replace(",", " ").split()]


def _steering(ap, model, specs):
    """--steer HOOK:FILE[:COEF[:START]] values -> forward's steer list
    [(layer, point, coef * vector, start)]."""
    from kvlens_oracle.model import steer_hook
    steer = []
    for spec in specs:
        hook, colon, rest = spec.partition(":")
        if not colon or not rest:
            ap.error(f"--steer {spec!r}: expected HOOK:FILE[:COEF[:START]]")
        path, coef, start = rest, 1.0, 0
        if not os.path.exists(rest) and ":" in rest:
            path, _, text = rest.rpartition(":")
            if not os.path.exists(path) and ":" in path:  # FILE:COEF:START
                path, _, coef_text = path.rpartition(":")
                try:
                    start = int(text)
                except ValueError:
                    ap.error(f"--steer {spec!r}: start {text!r} is not an integer")
                if start < 0:
                    ap.error(f"--steer {spec!r}: start {start} is negative")
                text = coef_text
            try:
                coef = float(text)
            except ValueError:
                ap.error(f"--steer {spec!r}: coefficient {text!r} is not a number")
            if not math.isfinite(coef):
                ap.error(f"--steer {spec!r}: coefficient {text!r} is not finite")
        try:
            layer, point = steer_hook(hook, model.cfg["n_layers"])
        except ValueError as e:
            ap.error(f"--steer {spec!r}: {e}")
        try:
            with open(path) as f:
                words = f.read().split()
        except (OSError, UnicodeDecodeError) as e:
            ap.error(f"--steer {spec!r}: cannot read vector file {path!r}: {e}")
        try:
            vec = [float(w) for w in words]
        except ValueError as e:
            ap.error(f"--steer {spec!r}: vector file {path!r}: {e}")
        if len(vec) != model.cfg["dim"]:
            ap.error(f"--steer {spec!r}: vector file {path!r} holds {len(vec)} values, the "
                     f"model's d_model is {model.cfg['dim']}")
        if not all(math.isfinite(v) for v in vec):
            ap.error(f"--steer {spec!r}: vector file {path!r} holds a non-finite value")
        steer.append((layer, point, coef * torch.tensor(vec, dtype=torch.float64), start))
    return steer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", help='space-separated token ids, e.g. "1 2 3"')
    ap.add_argument("--tokens-file", help="file of whitespace-separated token ids")
    ap.add_argument("--doc-ids", help="one document id per token (packed inputs)")
    ap.add_argument("--positions-per-doc", action="store_true",
                    help="restart positions at 0 at each document boundary (default: 0..T-1)")
    ap.add_argument("--out", help="output KVORACLE container")
    ap.add_argument("--attention", action="store_true", help="also write attn.{layer} [H, T, T]")
    ap.add_argument("--generate", type=int, help="print N greedy token ids after --prompt-tokens")
    ap.add_argument("--prompt-tokens")
    ap.add_argument("--stop-ids", default="", help="ids that end --generate (e.g. \"1 2\")")
    ap.add_argument("--grad-logprob",
                    help='"row:token ...": also write autograd gradients of the summed '
                         "log-probabilities (kvlens_oracle/grad.py lists the arrays)")
    ap.add_argument("--grad-cached-kv", type=int, metavar="P",
                    help="with one --grad-logprob target: gradients with respect to the K/V "
                         "rows of positions < P as leaves (a cached prefix), grad.cached_{k,v}.{l}")
    ap.add_argument("--grad-param-layer", type=int, metavar="L",
                    help="with --grad-logprob: also grad.w{q,k,v,o}, layer L's attention weights")
    ap.add_argument("--activations", action="store_true",
                    help="also write every act.* array (kvlens_oracle/attribution.py lists them)")
    ap.add_argument("--logit-attribution", metavar="ROW:TOKEN[:BASELINE]",
                    help="also write the dla.* direct logit attribution arrays for logit[ROW, "
                         "TOKEN] (minus logit[ROW, BASELINE])")
    ap.add_argument("--sae", metavar="PATH[@HOOK]",
                    help="also write sae.input, sae.acts, sae.recon: the SAE at PATH (SAELens "
                         "dir or Gemma Scope .npz) on its hook's rows (@HOOK: override or "
                         "supply the hook name; required for .npz)")
    ap.add_argument("--ablate-neuron", action="append", default=[], metavar="LAYER:NEURON[:ROW]",
                    help="zero (with --ablate-mean: mean-ablate) that FFN neuron's mlp_post at "
                         "ROW (default: every row) in --out's logits; repeatable")
    ap.add_argument("--ablate-mean", action="store_true",
                    help="--ablate-neuron sets the neuron to its mean over the rows")
    ap.add_argument("--patch-sweep", metavar="HOOK:ROW:A:B",
                    help="also write sweep.metric/clean/source: activation patching from "
                         "--source-tokens at HOOK, scored by logits[ROW, A] - logits[ROW, B]")
    ap.add_argument("--source-tokens", help="the patch source of --patch-sweep")
    ap.add_argument("--patch-all-positions", action="store_true",
                    help="--patch-sweep: one cell per layer (and head), every row patched")
    ap.add_argument("--patch-attribution", action="store_true",
                    help="--patch-sweep: first-order estimates (attribution patching)")
    ap.add_argument("--patch-qk-fix", action="store_true",
                    help="--patch-sweep of q or k: AtP*'s QK fix (the pattern exact, the rest "
                         "to first order)")
    ap.add_argument("--steer", action="append", default=[], metavar="HOOK:FILE[:COEF[:START]]",
                    help="add COEF (default 1) times FILE's vector (d_model whitespace-separated "
                         "floats) to every row of the residual stream at HOOK (blocks.L."
                         "hook_resid_pre/mid/post) for --tokens' logits and --generate; "
                         "repeatable")
    a = ap.parse_args(argv)

    # The modes that run their own passes, which --steer and --ablate-neuron do not edit.
    own_passes = [flag for flag, on in (("--grad-logprob", a.grad_logprob),
                                        ("--grad-cached-kv", a.grad_cached_kv is not None),
                                        ("--grad-param-layer", a.grad_param_layer is not None),
                                        ("--activations", a.activations),
                                        ("--logit-attribution", a.logit_attribution),
                                        ("--sae", a.sae),
                                        ("--patch-sweep", a.patch_sweep)) if on]
    if a.steer and own_passes:
        ap.error(f"--steer does not combine with {', '.join(own_passes)}")
    if a.ablate_neuron and (own_passes or a.generate is not None):
        clash = own_passes + (["--generate"] if a.generate is not None else [])
        ap.error(f"--ablate-neuron applies to --out's logits only, not {', '.join(clash)}")

    sae = None
    if a.sae:
        from kvlens_oracle.sae import load_sae
        path, at, hook = a.sae.rpartition("@")
        if not at or os.path.exists(a.sae):
            path, hook = a.sae, None
        try:
            sae = load_sae(path, hook=hook)
        except (OSError, ValueError) as e:
            ap.error(f"--sae: {e}")
        if sae.hook_name is None:
            ap.error(f"--sae {path}: the file names no hook; give PATH@HOOK")

    model = load_model(a.model)
    steer = _steering(ap, model, a.steer) or None
    if a.generate is not None:
        if not a.prompt_tokens:
            ap.error("--generate needs --prompt-tokens")
        out = greedy(model, _ints(a.prompt_tokens), a.generate, stop_ids=set(_ints(a.stop_ids)),
                     steer=steer)
        print(" ".join(map(str, out)))
        return 0

    if bool(a.tokens) == bool(a.tokens_file):
        ap.error("give exactly one of --tokens / --tokens-file")
    if not a.out:
        ap.error("--out is required")
    if a.tokens_file:
        with open(a.tokens_file) as f:
            tokens = _ints(f.read())
    else:
        tokens = _ints(a.tokens)
    docs = _ints(a.doc_ids) if a.doc_ids else None
    if a.positions_per_doc and docs is None:
        ap.error("--positions-per-doc needs --doc-ids")
    pos = positions_per_document(docs) if a.positions_per_doc else None
    ablate = []
    for spec in a.ablate_neuron:
        parts = spec.split(":")
        if len(parts) not in (2, 3):
            ap.error(f"--ablate-neuron {spec!r}: expected LAYER:NEURON[:ROW]")
        ablate.append((int(parts[0]), int(parts[1]), int(parts[2]) if len(parts) == 3 else None,
                       a.ablate_mean))
    with torch.no_grad():
        logits, attn = forward(model, tokens, doc_ids=docs, positions=pos, steer=steer,
                               ablate_neurons=ablate or None)
    arrays = {"logits": logits.numpy()}
    if a.grad_logprob:
        from kvlens_oracle.grad import cached_kv_gradients, gradients
        targets = [tuple(int(v) for v in pair.split(":")) for pair in a.grad_logprob.split()]
        if a.grad_cached_kv is not None:
            if len(targets) != 1 or docs is not None:
                ap.error("--grad-cached-kv takes one --grad-logprob target and no --doc-ids")
            arrays.update(cached_kv_gradients(model, tokens, targets[0], a.grad_cached_kv))
        else:
            arrays.update(gradients(model, tokens, targets, doc_ids=docs,
                                    param_layer=a.grad_param_layer))
    elif a.grad_cached_kv is not None:
        ap.error("--grad-cached-kv needs --grad-logprob")
    if a.attention:
        for layer in range(attn.shape[0]):
            arrays[f"attn.{layer}"] = attn[layer].numpy()
    acts = None
    if a.activations or sae is not None:
        from kvlens_oracle.attribution import activations
        acts = activations(model, tokens, doc_ids=docs, positions=pos)
    if a.activations:
        arrays.update(acts)
    if a.logit_attribution:
        from kvlens_oracle.attribution import logit_attribution
        parts = a.logit_attribution.split(":")
        if len(parts) not in (2, 3):
            ap.error('--logit-attribution takes "row:token" or "row:token:baseline"')
        row, token = int(parts[0]), int(parts[1])
        baseline = int(parts[2]) if len(parts) == 3 else None
        arrays.update(logit_attribution(model, tokens, row, token, baseline,
                                        doc_ids=docs, positions=pos))
    if sae is not None:
        from kvlens_oracle.sae import decode, encode, hook_input
        try:
            x = hook_input(acts, sae.hook_name)
            if x.shape[1] != sae.d_in:
                raise ValueError(f"hook {sae.hook_name} rows are {x.shape[1]} wide, the SAE "
                                 f"reads {sae.d_in}")
        except ValueError as e:
            ap.error(f"--sae: {e}")
        f = encode(sae, x)
        arrays.update({"sae.input": x, "sae.acts": f.numpy(), "sae.recon": decode(sae, f).numpy()})
    if a.patch_sweep:
        from kvlens_oracle.patching import (attribution_patch_sweep, patch_sweep,
                                            qk_fixed_patch_sweep)
        sweep = (qk_fixed_patch_sweep if a.patch_qk_fix else
                 attribution_patch_sweep if a.patch_attribution else patch_sweep)
        parts = a.patch_sweep.split(":")
        if len(parts) != 4 or not a.source_tokens:
            ap.error('--patch-sweep takes "HOOK:ROW:A:B" and needs --source-tokens')
        try:
            arrays.update(sweep(model, tokens, _ints(a.source_tokens), parts[0], int(parts[1]),
                                int(parts[2]), int(parts[3]),
                                all_positions=a.patch_all_positions))
        except ValueError as e:
            ap.error(f"--patch-sweep: {e}")
    write_container(a.out, arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
