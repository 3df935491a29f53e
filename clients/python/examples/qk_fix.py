#!/usr/bin/env python3
"""How close attribution patching comes to exact patching of queries and keys, with and
without AtP*'s QK fix.

Activation patching of a head's query or key (PatchSweep, hook q or k) runs a forward per
cell. Attribution patching (attribution=True) estimates every cell from one backward pass,
to first order, which misses most where a query or key moves its attention pattern through
the softmax. The QK fix (qk_fix=True; Kramár et al. 2024, AtP*) recomputes each cell's
pattern exactly and takes only the pattern's effect to first order. This sweeps every
layer × head × position both ways and exactly, and prints, per hook, each estimate's
correlation with the exact cells and its summed error relative to theirs.

    python3 clients/python/examples/qk_fix.py --server 127.0.0.1:50051 \
        --text "And God said unto Abraham, I am the" \
        --source-text "And God said unto Jacob, I am the" --token-text " LORD"
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
    ap.add_argument("--text", default="And God said unto Abraham, I am the")
    ap.add_argument("--source-text", default="And God said unto Jacob, I am the",
                    help="the prompt patched from (as many tokens as --text)")
    ap.add_argument("--token-text", default=" LORD", help="the scored next token (one token)")
    a = ap.parse_args()
    c = Client(a.server)
    target = [(-1, c.to_single_token(a.token_text))]
    print(f"J = log p({a.token_text!r} | {a.text!r}), patched from {a.source_text!r}")
    print(f"{'hook':>4} {'cells':>6} {'moved':>6} {'corr AtP':>9} {'corr QK-fix':>12} "
          f"{'error AtP':>10} {'error QK-fix':>13}")
    closer = True
    for hook in ("q", "k"):
        kw = dict(text=a.text, patch_source=a.source_text, hook=hook, targets=target, fp64=True)
        exact = c.patch_sweep(**kw)
        first = c.patch_sweep(attribution=True, **kw)
        fixed = c.patch_sweep(attribution=True, qk_fix=True, **kw)
        e = exact.metric - exact.clean
        moved = np.abs(e) > 1e-9
        row = []
        for est in (first, fixed):
            d = est.metric - est.clean
            # correlation over the cells the patch moves; error: Σ|estimate − exact| / Σ|exact|
            row.append((np.corrcoef(e[moved], d[moved])[0, 1],
                        np.abs(d - e).sum() / np.abs(e).sum()))
        closer = closer and row[1][1] < row[0][1]
        print(f"{hook:>4} {e.size:>6} {int(moved.sum()):>6} {row[0][0]:>9.4f} {row[1][0]:>12.4f} "
              f"{row[0][1]:>10.3f} {row[1][1]:>13.3f}")
    print(f"the QK fix is closer on both hooks: {'yes' if closer else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
