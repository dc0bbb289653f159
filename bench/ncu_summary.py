# SPDX-License-Identifier: Apache-2.0
"""Summarise `ncu --csv --metrics gpu__time_duration.sum` of hila_bench: GPU time per kernel name
for the last forward and the last backward of the first op (launches after the first-call block)."""
import csv
import sys
from collections import OrderedDict


def main(path, label):
    rows = []
    with open(path) as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            unit = r.get("Metric Unit", "nsecond")
            v = float(r["Metric Value"].replace(",", ""))
            scale = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}.get(unit, 1e-6)
            rows.append((r["Kernel Name"].split("(")[0].split("<")[0].replace("void ", ""), v * scale))
    agg = OrderedDict()
    for name, ms in rows:
        n, tot = agg.get(name, (0, 0.0))
        agg[name] = (n + 1, tot + ms)
    total = sum(ms for _, ms in rows)
    print(f"== ncu {label}: {len(rows)} launches, {total:.3f} ms GPU time in all (first call + fwd + bwd)")
    for name, (n, tot) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print(f"  {tot:9.3f} ms  {n:4d}x  {name}")


if __name__ == "__main__":
    main(*sys.argv[1:])
