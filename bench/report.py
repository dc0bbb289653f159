# SPDX-License-Identifier: Apache-2.0
"""Merge hila_bench and anchors CSVs into one CSV, a PNG (time against T) and a markdown table with
achieved TFLOP/s (FLOP counts of docs/math/HLA.md §1/§7.1: GLA fwd T(2Cd+2Cdv+4d dv), bwd
T(6Cd+4Cdv+10d dv) per head) and the ratio to fla and cuDNN."""
import csv
import sys


def load(paths):
    rows = []
    for p in paths:
        with open(p) as f:
            rows += [r for r in csv.DictReader(line for line in f if not line.startswith("#"))]
    return rows


def gla_flops(B, T, H, d, direction, C=64, dv=None):
    dv = d if dv is None else dv
    fwd = T * (2 * C * d + 2 * C * dv + 4 * d * dv)
    bwd = T * (6 * C * d + 4 * C * dv + 10 * d * dv)
    return B * H * (fwd if direction == "fwd" else fwd + bwd)


# GLA primitives per operator (docs/math/HLA.md §11: hla2 / ahla are two GLA passes, hla3 three).
PRIMS = {"gla": 1, "hla2": 2, "ahla": 2, "hla3": 3}
# The fla operator each hila operator is compared with (issue targets).
FLA_ANCHOR = {"loglinear": "loglinear", "loglinear_hla2": "loglinear", "loglinear_ahla": "loglinear",
              "loglinear_hla3": "loglinear", "gdn": "gdn", "loglinear_gdn": "gdn"}


def min_bytes(B, T, H, d, direction, dk=None, G=None):
    """Compulsory HBM traffic in bf16: q, k, v read and o written (forward); plus dO read and
    dq, dk, dv written (forward+backward, which reads q, k, v again). q, k have G groups of dk."""
    dk = d if dk is None else dk
    G = H if G is None else G
    nk, nv = B * T * G * dk * 2, B * T * H * d * 2
    return 2 * nk + 2 * nv if direction == "fwd" else 6 * nk + 5 * nv


def main(out_csv, out_png, out_md, *inputs):
    rows = load(inputs)
    with open(out_csv, "w", newline="") as f:
        names = list(dict.fromkeys(k for r_ in rows for k in r_))  # older CSVs lack dk, G
        w = csv.DictWriter(f, fieldnames=names, restval="")
        w.writeheader()
        w.writerows(rows)
    ceil = {r["op"]: float(r["ms"]) for r in rows if r["impl"] == "ceiling"}
    key = lambda r: (r["impl"], r["op"], int(r["B"]), int(r["T"]), r["direction"])
    t = {key(r): float(r["ms"]) for r in rows if r["impl"] != "ceiling" and r["direction"] in ("fwd", "fwdbwd")}
    # head counts and dims of hila's rows (H, dv, dk, G); older CSVs: dk = d, G = H
    dims = {key(r): (int(r["H"]), int(r["d"]), int(r.get("dk") or r["d"]), int(r.get("G") or r["H"]))
            for r in rows if r["impl"] == "hila" and r["direction"] in ("fwd", "fwdbwd")}
    shapes = sorted({(int(r["B"]), int(r["T"])) for r in rows if r["impl"] == "hila" and r["direction"] in ("fwd", "fwdbwd")},
                    key=lambda s: s[1])
    ops = sorted({k[1] for k in t if k[0] == "hila"}, key=lambda o: (o != "gla", o))
    fla = "fla_guard_lifted" if any(k[0] == "fla_guard_lifted" for k in t) else "fla"
    gemm, copy = ceil.get("gemm_tflops", float("nan")), ceil.get("copy_tbps", float("nan"))
    lines = ["| op | B | T | direction | hila ms | TFLOP/s (% GEMM) | GB/s (% copy) | fla anchor ms | hila / fla | "
             "SDPA flash ms | SDPA cuDNN ms | hila / cuDNN |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda x: f"{x:.3f}" if x else "—"
    r = lambda a, b: f"{a / b:.2f}×" if a and b else "—"
    for op in ops:
        for B, T in shapes:
            for dirn in ("fwd", "fwdbwd"):
                h = t.get(("hila", op, B, T, dirn))
                if not h:
                    continue
                anchor = FLA_ANCHOR.get(op, "gla")
                fl = t.get((fla, anchor, B, T, dirn))
                fa = t.get(("sdpa_flash", "softmax", B, T, dirn))
                cu = t.get(("sdpa_cudnn", "softmax", B, T, dirn))
                H, dv, dk, G = dims[("hila", op, B, T, dirn)]
                gbs = min_bytes(B, T, H, dv, dirn, dk, G) / h / 1e6
                if op in PRIMS:
                    tf = PRIMS[op] * gla_flops(B, T, H, dk, dirn, dv=dv) / h / 1e9
                    tfs = f"{tf:.1f} ({100 * tf / gemm:.0f}%)"
                else:
                    tfs = "—"
                lines.append(f"| {op} | {B} | {T} | {dirn} | {f(h)} | {tfs} | "
                             f"{gbs:.0f} ({100 * gbs / (1000 * copy):.0f}%) | {anchor}: {f(fl)} | {r(h, fl)} | {f(fa)} | {f(cu)} | {r(h, cu)} |")
    head = [f"Ceilings measured in the same run: bf16 GEMM {gemm:.0f} TFLOP/s, "
            f"device-to-device copy {copy:.2f} TB/s.", ""]
    extra = [r_ for r_ in rows if r_["impl"] == "hila" and r_["direction"] in ("first_call", "context")]
    if extra:
        lines += ["", "First call in a fresh process (host wall time, forward, B=1, T=256, bf16):", "",
                  "| what | ms |", "|---|---|"]
        lines += [f"| {r_['op']} {r_['direction']} | {float(r_['ms']):.1f} |" for r_ in extra]
    serve = {key(r_): float(r_["ms"]) for r_ in rows if r_["impl"] == "hila" and r_["direction"] in ("prefill", "continue")}
    if serve:  # hila_bench --prefill
        lines += ["", "Forward with the final state (prefill: from position 0; continue: from a state at T to 2T), ms:",
                  "", "| op | B | T | prefill | continue | forward alone |", "|---|---|---|---|---|---|"]
        for _, op, B, T in sorted({k[:4] for k in serve}, key=lambda k: (k[1], k[3])):
            cell = lambda d: f(serve.get(("hila", op, B, T, d)) or t.get(("hila", op, B, T, d)))
            lines.append(f"| {op} | {B} | {T} | {cell('prefill')} | {cell('continue')} | {cell('fwd')} |")
    with open(out_md, "w") as f_:
        f_.write("\n".join(head + lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, dirn in zip(axes, ("fwd", "fwdbwd")):
            anchors = sorted({FLA_ANCHOR.get(o, "gla") for o in ops})
            for impl, op in ([("hila", o) for o in ops] + [(fla, a_) for a_ in anchors] +
                             [("sdpa_flash", "softmax"), ("sdpa_cudnn", "softmax")]):
                xs = [T for B, T in shapes if (impl, op, B, T, dirn) in t]
                ys = [t[(impl, op, B, T, dirn)] for B, T in shapes if (impl, op, B, T, dirn) in t]
                if xs:
                    ax.plot(xs, ys, marker="o", label=f"{impl} {op}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            H, dv, dk, G = next(iter(dims.values()))
            ax.set_xlabel("T (B·T = 32K tokens; last point B=1, T=64K)")
            ax.set_ylabel("ms")
            ax.set_title(f"{dirn}, H={H}, dk={dk}, dv={dv}" + (f", G={G}" if G != H else "") + ", bf16")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_png, dpi=110)
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:])
