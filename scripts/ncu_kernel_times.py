#!/usr/bin/env python3
"""Sums kernel times by kernel name from `ncu --csv --metrics gpu__time_duration.sum` output.

    ncu --csv --metrics gpu__time_duration.sum -k regex:'^[^F]' --launch-skip 324 \\
        --launch-count 324 kvlens_gpu_check --quick --only e2e > step.csv
    scripts/ncu_kernel_times.py step.csv

prints, per kernel name: launches, total microseconds, share of the total. Used to see
where a decode step's GPU time goes (docs/cuda.md, "Results").
"""
import collections
import csv
import sys


def main(path):
    header = None
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for row in csv.reader(open(path)):
        if "Kernel Name" in row:
            header = row
            continue
        if header is None or len(row) != len(header):
            continue  # ncu's own lines
        d = dict(zip(header, row))
        if d.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(d["Metric Value"].replace(",", ""))
        unit = d.get("Metric Unit", "nsecond")
        us = value / 1e3 if unit.startswith("n") else value if unit.startswith("u") else value * 1e3
        name = d["Kernel Name"].split("(")[0].split("<")[0]
        by_name[name][0] += 1
        by_name[name][1] += us
    total = sum(us for _, us in by_name.values())
    if total == 0:
        sys.exit(f"{path}: no gpu__time_duration.sum rows")
    for name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:40s} {n:5d} {us:10.1f} us {100 * us / total:5.1f}%")
    print(f"{'total':40s} {sum(n for n, _ in by_name.values()):5d} {total:10.1f} us")


if __name__ == "__main__":
    main(sys.argv[1])
