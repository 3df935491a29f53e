#!/usr/bin/env python3
"""The induction-head experiment (Olsson et al., 2022) against a running kvlens-server.

A sequence of P random tokens is repeated twice (after BOS). At position p in the second
copy, an induction head attends to the token *after* p's previous occurrence, p − P + 1.
The induction score of a head is the mean of that attention over the second copy
(docs/interpretability.md, engine/interpret/head_scores.h), averaged here over several
random sequences. Writes a [layer, head] heatmap of the scores and the best head's
attention pattern, and prints the table and the best head.

    python3 clients/python/examples/induction.py --server 127.0.0.1:50051 \
        --out-dir docs/img
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kvlens import Client  # noqa: E402
from kvlens import plot  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", default="127.0.0.1:50051")
    ap.add_argument("--period", type=int, default=40, help="P: random tokens per copy")
    ap.add_argument("--sequences", type=int, default=8, help="random sequences averaged")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=".")
    ap.add_argument("--fp64", action="store_true", help="compute in fp64 (default fp32)")
    a = ap.parse_args()

    client = Client(a.server)
    info = client.model_info()
    rng = np.random.default_rng(a.seed)
    special = {info.bos_id, info.eos_id}
    candidates = np.array([t for t in range(info.vocab_size) if t not in special])
    prefix = [info.bos_id] if info.bos_id >= 0 else []
    if len(prefix) + 2 * a.period > info.context_length:
        ap.error(f"2 x period + BOS exceeds the context ({info.context_length})")

    grids, example = [], None
    for _ in range(a.sequences):
        r = rng.choice(candidates, size=a.period, replace=False).tolist()
        tokens = prefix + r + r
        maps = client.attention_maps(tokens=tokens, summaries=True, probabilities=False,
                                     induction_period=a.period, induction_start=len(prefix),
                                     fp64=a.fp64)
        grids.append(maps.summary_grid("induction"))
        if example is None:
            example = (tokens, maps)
    scores = np.mean(grids, axis=0)                 # [layers, heads]
    spread = np.std(grids, axis=0)
    layers, heads = example[1].layers, example[1].heads
    best = np.unravel_index(np.nanargmax(scores), scores.shape)
    bl, bh = layers[best[0]], heads[best[1]]

    print(f"model {info.name} ({info.architecture}, {info.num_layers} layers x "
          f"{info.num_heads} heads), precision {example[1].precision}")
    print(f"{a.sequences} sequences of BOS + {a.period} random tokens repeated twice; "
          f"uniform attention over the second copy would score ~{1 / (len(prefix) + 1.5 * a.period):.3f}")
    print("induction score per head (mean over sequences):")
    print("layer " + " ".join(f"  h{h:<4d}" for h in heads))
    for i, l in enumerate(layers):
        print(f"{l:5d} " + " ".join(f"{scores[i, j]:6.3f}" for j in range(len(heads))))
    print(f"best head: layer {bl} head {bh}, induction score {scores[best]:.3f} "
          f"(± {spread[best]:.3f} across sequences)")

    os.makedirs(a.out_dir, exist_ok=True)
    grid_path = os.path.join(a.out_dir, "induction_scores.png")
    plot.head_score_grid(scores, grid_path, layers=layers, heads=heads, vmax=1.0,
                         title=f"{info.name}: induction score per head")
    tokens = example[0]
    head_maps = client.attention_maps(tokens=tokens, layers=[bl], heads=[bh], fp64=a.fp64)
    head_path = os.path.join(a.out_dir, "induction_best_head.png")
    plot.attention_heatmap(head_maps.probs[0, 0], head_path,
                           title=f"layer {bl} head {bh}: BOS + {a.period} tokens, repeated")
    print(f"wrote {grid_path} and {head_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
