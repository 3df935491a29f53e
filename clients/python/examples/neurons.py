#!/usr/bin/env python3
"""Which FFN neurons move a next-token log-probability, estimated and then measured.

Attribution by activation × gradient (TransformerLens's gradient cache next to
run_with_cache): zeroing neuron i of layer l at every position changes J = log p(token)
by about −Σ_pos act · ∂J/∂act, from one backward pass for every neuron at once. The K
neurons of largest estimated effect are then zero-ablated one by one (Intervene's
neuron_ablations: one forward each), and the table sets the estimate beside the exact
change, with their correlation.

    python3 clients/python/examples/neurons.py --server 127.0.0.1:50051 \
        --text "In the beginning God created the heaven and the" --token-text " earth"
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kvlens import Client  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", default="127.0.0.1:50051")
    ap.add_argument("--text", default="In the beginning God created the heaven and the")
    ap.add_argument("--token-text", default=" earth", help="the scored next token (one token)")
    ap.add_argument("--top", type=int, default=10, help="neurons ablated exactly")
    a = ap.parse_args()
    c = Client(a.server)
    token = c.to_single_token(a.token_text)
    target = [(-1, token)]
    cache = c.run_with_cache(text=a.text, hooks=["mlp_post"], fp64=True)
    grads = c.gradient_probe(text=a.text, targets=target, want=(), hooks=["mlp_post"],
                             fp64=True)
    layers = c.model_info().num_layers
    # estimated change of J when a neuron is zeroed at every position: −Σ_pos act · grad
    est = np.stack([-(cache["mlp_post", l] * grads.grad_cache["mlp_post", l]).sum(0)
                    for l in range(layers)])  # [layers, d_mlp]
    order = np.argsort(-np.abs(est), axis=None)[:a.top]
    rows = []
    for flat in order:
        layer, neuron = divmod(int(flat), est.shape[1])
        r = c.intervene(text=a.text, neuron_ablations=[(layer, neuron)], targets=target, fp64=True)
        e = r.effects[0]
        rows.append((layer, neuron, est[layer, neuron], e.edited_logprob - e.clean_logprob))
    print(f"J = log p({a.token_text!r} | {a.text!r}) = {grads.objective:.6f}")
    print(f"{'layer':>5} {'neuron':>7} {'estimate':>10} {'exact':>10}")
    for layer, neuron, estimate, exact in rows:
        print(f"{layer:>5} {neuron:>7} {estimate:>10.5f} {exact:>10.5f}")
    e = np.array([r[2] for r in rows])
    x = np.array([r[3] for r in rows])
    print(f"correlation {np.corrcoef(e, x)[0, 1]:.3f}; sign agreement "
          f"{int((np.sign(e) == np.sign(x)).sum())}/{len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
