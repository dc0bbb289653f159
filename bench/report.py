# SPDX-License-Identifier: Apache-2.0
"""Merge hila_bench and anchors CSVs into one CSV, a PNG (time against T) and a markdown table with
achieved TFLOP/s (spec FLOP counts, HLA_SPEC §1/§7.1: GLA fwd T(2Cd+2Cdv+4d dv), bwd
T(6Cd+4Cdv+10d dv) per head) and the ratio to fla and cuDNN."""
import csv
import sys


def load(paths):
    rows = []
    for p in paths:
        with open(p) as f:
            rows += [r for r in csv.DictReader(line for line in f if not line.startswith("#"))]
    return rows


def gla_flops(B, T, H, d, direction, C=64):
    fwd = T * (2 * C * d + 2 * C * d + 4 * d * d)
    bwd = T * (6 * C * d + 4 * C * d + 10 * d * d)
    return B * H * (fwd if direction == "fwd" else fwd + bwd)


def main(out_csv, out_png, out_md, *inputs):
    rows = load(inputs)
    with open(out_csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    ceil = {r["op"]: float(r["ms"]) for r in rows if r["impl"] == "ceiling"}
    key = lambda r: (r["impl"], r["op"], int(r["B"]), int(r["T"]), r["direction"])
    t = {key(r): float(r["ms"]) for r in rows if r["impl"] != "ceiling"}
    shapes = sorted({(int(r["B"]), int(r["T"])) for r in rows if r["impl"] == "hila"}, key=lambda s: s[1])
    fla = "fla" if any(k[0] == "fla" for k in t) else "fla_guard_lifted"
    lines = ["| B | T | direction | hila gla ms | hila TFLOP/s | fla ms | hila / fla | SDPA flash ms | SDPA cuDNN ms | hila / cuDNN |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for B, T in shapes:
        for dirn in ("fwd", "fwdbwd"):
            h = t.get(("hila", "gla", B, T, dirn))
            fl = t.get((fla, "gla", B, T, dirn))
            fa = t.get(("sdpa_flash", "softmax", B, T, dirn))
            cu = t.get(("sdpa_cudnn", "softmax", B, T, dirn))
            tf = gla_flops(B, T, 16, 128, dirn) / h / 1e9 if h else float("nan")
            f = lambda x: f"{x:.3f}" if x else "—"
            r = lambda a, b: f"{a / b:.1f}×" if a and b else "—"
            lines.append(f"| {B} | {T} | {dirn} | {f(h)} | {tf:.1f} | {f(fl)} | {r(h, fl)} | {f(fa)} | {f(cu)} | {r(h, cu)} |")
    head = [f"Ceilings measured in the same run: bf16 GEMM {ceil.get('gemm_tflops', float('nan')):.0f} TFLOP/s, "
            f"device-to-device copy {ceil.get('copy_tbps', float('nan')):.2f} TB/s.", ""]
    with open(out_md, "w") as f:
        f.write("\n".join(head + lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, dirn in zip(axes, ("fwd", "fwdbwd")):
            for impl, op in (("hila", "gla"), (fla, "gla"), ("sdpa_flash", "softmax"), ("sdpa_cudnn", "softmax")):
                xs = [T for B, T in shapes if (impl, op, B, T, dirn) in t]
                ys = [t[(impl, op, B, T, dirn)] for B, T in shapes if (impl, op, B, T, dirn) in t]
                if xs:
                    ax.plot(xs, ys, marker="o", label=f"{impl} {op}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("T (B·T = 32K tokens; last point B=1, T=64K)")
            ax.set_ylabel("ms")
            ax.set_title(f"{dirn}, H=16, d=128, bf16")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_png, dpi=110)
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:])
