# SPDX-License-Identifier: Apache-2.0
"""Summary tables (markdown) and plots (PNG) from the result CSVs of hila.experiments.

MQAR (``mqar.csv``): runs are grouped by their shared settings (everything but mixer, dim, length,
pairs, seed and lr); in each group, a cell (mixer, dim, length) reports the learning rate with the
best accuracy averaged over seeds, with that mean and the seeds' range. Writes ``mqar.md`` (tables,
best learning rates, and the log-linear paper's published numbers beside ours at T = 256) and
``mqar.png`` (accuracy against model dim, one panel per length).

NIAH (``niah.csv``): runs are grouped by their shared settings (everything but mixer, seed and lr;
the training needle count included) and their cells by the needle count evaluated (a cell's
``eval_needles``; rows written before that column existed evaluated the run's ``needles``). A mixer
run at several learning rates shows the one with the best mean probe accuracy over the group's
cells (and seeds). Per (setting, needle count evaluated): a table in ``niah.md`` (mean probe accuracy over depths per
mixer and evaluation length) and ``niah_n{N}.png`` (heatmaps of accuracy against length and depth,
one per mixer; ``niah_{i}_n{N}.png``, i = 1, 2, ..., where several settings are reported).
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Dict, List, Tuple

from .mixers import MIXERS
from .runner import read_rows

__all__ = ["build_report", "mqar_cells", "niah_cells", "eval_needles_of", "PUBLISHED_MQAR"]

# MQAR accuracy (%) at T = 256 by model dim, published with log-linear attention (Guo et al. 2025):
# {hila mixer whose design it is: (published model, {dim: accuracy as published})}.
PUBLISHED_MQAR: Dict[str, Tuple[str, Dict[int, str]]] = {
    "gla": ("Mamba-2", {16: "46.9", 32: "75.1", 64: "89.6"}),
    "loglinear": ("log-linear Mamba-2", {16: "55.9", 32: "76.5", 64: "92.9"}),
    "gdn": ("Gated DeltaNet", {16: "38.4", 32: "79.0", 64: "≥ 99"}),
    "loglinear_gdn": ("log-linear Gated DeltaNet", {16: "40.0", 32: "84.4", 64: "≥ 99"}),
}

_CELL = ("mixer", "dim", "seq_len", "pairs")
_RUN_AXES = _CELL + ("seed", "lr")
# Columns that describe a run's outcome, not its setting.
_OUTCOME = {"key", "status", "acc", "best_acc", "final_loss", "curve", "params", "ms_per_step", "wall_s",
            "device", "cuda_graph", "matmul", "torch", "finished", "eval_needles", "eval_len", "depth",
            "cell_acc", "cell_acc_all"}


def _order(mixer: str) -> int:
    names = list(MIXERS)
    return names.index(mixer) if mixer in names else len(names)


def _setting(row: Dict[str, str], axes=_RUN_AXES) -> Tuple:
    return tuple((k, v) for k, v in row.items() if k not in _OUTCOME and k not in axes)


def mqar_cells(rows: List[Dict[str, str]]) -> Dict[Tuple, Dict[Tuple, Dict]]:
    """{setting: {(mixer, dim, seq_len, pairs): {"lr", "mean", "lo", "hi", "seeds", "lrs",
    "params", "ms_per_step", "devices"}}} with the best learning rate of each cell."""
    runs = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in rows:
        cell = (r["mixer"], int(r["dim"]), int(r["seq_len"]), int(r["pairs"]))
        runs[_setting(r)][cell][float(r["lr"])].append(r)
    out = {}
    for setting, cells in runs.items():
        out[setting] = {}
        for cell, by_lr in cells.items():
            lr, rs = max(by_lr.items(), key=lambda kv: (mean(float(r["acc"]) for r in kv[1]), -kv[0]))
            accs = [100 * float(r["acc"]) for r in rs]
            out[setting][cell] = dict(lr=lr, mean=mean(accs), lo=min(accs), hi=max(accs), seeds=len(rs),
                                      lrs=len(by_lr), params=int(rs[0]["params"]),
                                      ms_per_step=mean(float(r["ms_per_step"]) for r in rs),
                                      wall_s=mean(float(r["wall_s"]) for r in rs),
                                      devices=sorted({r["device"] for r in rs}),
                                      diverged=sum(r["status"] == "diverged" for r in rs))
    return out


# Settings that a task does not read (left out of its captions).
_UNUSED = {"mqar": {"task", "needles", "lengths", "depths", "train_lengths", "eval_needles", "haystack"},
           "niah": {"task", "pairs", "train_examples", "power_a", "random_non_queries"}}


def _fmt_setting(setting: Tuple) -> str:
    task = dict(setting).get("task", "")
    return ", ".join(f"{k}={v}" for k, v in setting if v not in ("", None) and k not in _UNUSED.get(task, ()))


def _mixer_by_dim_table(cells, mixers, dims, T, K, fmt) -> List[str]:
    """A markdown table, a row per mixer and a column per model dimension d: fmt(cell) of the cell
    (mixer, d, T, K), empty where there is none."""
    lines = ["| mixer | " + " | ".join(f"d = {d}" for d in dims) + " |", "|---|" + "---|" * len(dims)]
    for m in mixers:
        row = ["" if c is None else fmt(c) for c in (cells.get((m, d, T, K)) for d in dims)]
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    return lines


def _mqar_markdown(cells_by_setting) -> str:
    lines = ["# MQAR results", "",
             "Accuracy (%) on the query positions of the test set, at the best learning rate of each "
             "cell (best mean over seeds); in parentheses the lowest and highest seed.", ""]
    for setting, cells in cells_by_setting.items():
        lines += [f"## Setting: {_fmt_setting(setting)}", ""]
        devices = sorted({d for c in cells.values() for d in c["devices"]})
        lines += [f"Devices: {', '.join(devices)}.", ""]
        for T, K in sorted({(c[2], c[3]) for c in cells}):
            dims = sorted({c[1] for c in cells if c[2] == T and c[3] == K})
            mixers = sorted({c[0] for c in cells if c[2] == T and c[3] == K}, key=_order)
            lines += [f"### T = {T}, {K} key-value pairs", ""]
            lines += _mixer_by_dim_table(cells, mixers, dims, T, K, lambda c: (
                f"{c['mean']:.1f}" + (f" ({c['lo']:.1f}–{c['hi']:.1f})" if c["seeds"] > 1 else "")))
            lines += ["", "Best learning rate / seeds / learning rates tried / parameters / ms per step:", ""]
            lines += _mixer_by_dim_table(cells, mixers, dims, T, K, lambda c: (
                f"{c['lr']:g} / {c['seeds']} / {c['lrs']} / {c['params']:,} / {c['ms_per_step']:.1f}"
                + (f" ({c['diverged']} diverged)" if c["diverged"] else "")))
            lines.append("")
            if T == 256:
                lines += _published_beside(cells, T, K)
    return "\n".join(lines) + "\n"


def _published_beside(cells, T, K) -> List[str]:
    dims = [16, 32, 64]
    have = [(m, pub) for m, pub in PUBLISHED_MQAR.items() if any((m, d, T, K) in cells for d in dims)]
    if not have:
        return []
    lines = ["Beside the log-linear paper's published MQAR accuracy (%) at T = 256 (its training setup "
             "differs from this one):", "",
             "| hila mixer | ours " + " | ours ".join(f"d = {d}" for d in dims) + " | published model | "
             + " | ".join(f"published d = {d}" for d in dims) + " |",
             "|---|" + "---|" * (2 * len(dims) + 1)]
    for m, (name, pub) in have:
        ours = [f"{cells[(m, d, T, K)]['mean']:.1f}" if (m, d, T, K) in cells else "" for d in dims]
        lines.append(f"| {m} | " + " | ".join(ours) + f" | {name} | "
                     + " | ".join(pub[d] for d in dims) + " |")
    return lines + [""]


def _mqar_plot(cells_by_setting, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [(s, T, K) for s, cells in cells_by_setting.items()
              for T, K in sorted({(c[2], c[3]) for c in cells})]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False,
                             layout="constrained")
    for ax, (setting, T, K) in zip(axes[0], panels):
        cells = cells_by_setting[setting]
        for m in sorted({c[0] for c in cells if c[2] == T}, key=_order):
            pts = sorted((d, c["mean"]) for (mm, d, t, k), c in cells.items()
                         if mm == m and t == T and k == K)
            i = _order(m)  # one color and marker per mixer, the same in every panel
            style = "--" if m == "sdpa" else ":" if m.endswith("_normalized") else "-"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="os^Dv"[i % 5],
                    color=plt.cm.tab20(i % 20), linestyle=style, label=m)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("model dim")
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(-2, 102)
        ax.set_title(f"MQAR T = {T}, {K} pairs", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def eval_needles_of(row: Dict[str, str]) -> int:
    """The needle count a niah row's cell was evaluated at: its ``eval_needles`` column, or the
    run's ``needles`` in rows written before that column existed (blank there)."""
    return int(row.get("eval_needles") or row["needles"])


def niah_cells(rows: List[Dict[str, str]]):
    """{(setting, needles evaluated): {mixer: {(eval_len, depth): accuracy (%), mean over seeds}}}
    and the runs' metadata {group: {mixer: a row of its runs}}. The setting holds the training
    needle count, not the learning rate: of a mixer's learning rates, the one with the best mean
    over the group's cells is reported (the smaller on a tie), and its row is the metadata's."""
    out = defaultdict(lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(list))))
    rows_of = defaultdict(dict)
    for r in rows:
        group = (_setting(r, ("mixer", "seed", "lr")), eval_needles_of(r))
        lr = float(r["lr"])
        out[group][r["mixer"]][lr][(int(r["eval_len"]), float(r["depth"]))].append(100 * float(r["cell_acc"]))
        rows_of[(group, r["mixer"])][lr] = r
    means, meta = {}, defaultdict(dict)
    for g, ms in out.items():
        means[g] = {}
        for m, by_lr in ms.items():
            cells = {lr: {c: mean(v) for c, v in cs.items()} for lr, cs in by_lr.items()}
            lr = max(cells, key=lambda x: (mean(cells[x].values()), -x))
            means[g][m], meta[g][m] = cells[lr], rows_of[(g, m)][lr]
    return means, meta


def _niah_outputs(rows, out: Path) -> List[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups, meta = niah_cells(rows)
    lines = ["# Needle in a haystack results", "",
             "Accuracy (%) of retrieving the probe needle, averaged over the evaluated depths (and seeds), "
             "per number of needles in the evaluation sequences (N); the setting names the training needles "
             "(`needles`) and lengths (`train_lengths`, blank: the evaluation lengths).", ""]
    paths = []
    settings = list(dict.fromkeys(setting for setting, _ in groups))
    for (setting, needles), mixers in sorted(groups.items(), key=lambda kv: (settings.index(kv[0][0]), kv[0][1])):
        lengths = sorted({c[0] for cells in mixers.values() for c in cells})
        depths = sorted({c[1] for cells in mixers.values() for c in cells})
        names = sorted(mixers, key=_order)
        devices = sorted({meta[(setting, needles)][m]["device"] for m in names})
        prefix = "niah" if len(settings) == 1 else f"niah_{settings.index(setting) + 1}"
        path = out / f"{prefix}_n{needles}.png"
        lines += [f"## N = {needles} needle{'s' if needles > 1 else ''} evaluated; setting: "
                  f"{_fmt_setting(setting)}", "",
                  f"Devices: {', '.join(devices)}. Heatmaps: `{path.name}`.", "",
                  "| mixer | " + " | ".join(f"T = {T}" for T in lengths) + " | mean | lr | ms/step |",
                  "|---|" + "---|" * (len(lengths) + 3)]
        for m in names:
            per_len = [mean(mixers[m][(T, d)] for d in depths if (T, d) in mixers[m]) for T in lengths]
            r = meta[(setting, needles)][m]
            lines.append(f"| {m} | " + " | ".join(f"{a:.1f}" for a in per_len)
                         + f" | {mean(per_len):.1f} | {float(r['lr']):g} | {float(r['ms_per_step']):.1f} |")
        lines.append("")
        cols = min(len(names), 3)
        rows_n = -(-len(names) // cols)
        fig, axes = plt.subplots(rows_n, cols, figsize=(3.8 * cols + 1, 3.2 * rows_n), squeeze=False,
                                 layout="constrained")
        for ax in axes.flat[len(names):]:
            ax.axis("off")
        for ax, m in zip(axes.flat, names):
            grid = [[mixers[m].get((T, d), float("nan")) for T in lengths] for d in depths]
            im = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto", origin="upper")
            ax.set_xticks(range(len(lengths)), [str(T) for T in lengths], fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
            ax.set_xlabel("length", fontsize=8)
            if ax in axes[:, 0]:
                ax.set_ylabel("needle depth", fontsize=8)
            ax.set_title(m, fontsize=9)
            for i, row in enumerate(grid):
                for j, a in enumerate(row):
                    if a == a:
                        ax.text(j, i, f"{a:.0f}", ha="center", va="center", fontsize=6)
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="accuracy (%)")
        fig.suptitle(f"needle in a haystack, {needles} needle{'s' if needles > 1 else ''} evaluated",
                     fontsize=10)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    md = out / "niah.md"
    md.write_text("\n".join(lines) + "\n")
    return [md] + paths


def build_report(results: Path, out: Path) -> List[Path]:
    """Writes the tables and plots of every result CSV found in ``results`` into ``out``; returns
    the paths written. A folder without result CSVs is an error (nothing to report)."""
    results, out = Path(results), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    mqar = read_rows(results / "mqar.csv")
    if mqar:
        cells = mqar_cells(mqar)
        (out / "mqar.md").write_text(_mqar_markdown(cells))
        _mqar_plot(cells, out / "mqar.png")
        written += [out / "mqar.md", out / "mqar.png"]
    niah = read_rows(results / "niah.csv")
    if niah:
        written += _niah_outputs(niah, out)
    if not written:
        raise FileNotFoundError(f"no mqar.csv or niah.csv with rows in {results}")
    return written
