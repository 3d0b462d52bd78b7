"""Figures of the toy replication: learning curves with bands, and one response shaded by each
reward's relevance (PNG, and an HTML page with each token's q and w on hover)."""

from __future__ import annotations

import html
import math
from pathlib import Path

from mrtpo.evaluate.analysis.stats import SMOOTH, mean_ci, smooth

COLORS = {
    "grpo": "#7f7f7f",
    "gdpo": "#1f77b4",
    "mrtpo": "#d62728",
    "mrtpo_shuffle": "#ff7f0e",
    "mrtpo_joint": "#2ca02c",
    "cort": "#9467bd",
    "opsd": "#8c564b",
    "mrtpo@beta=0.25": "#f7a3a3",
    "mrtpo@beta=0.75": "#7b0d0d",
    "gdpo@one_step_off": "#17becf",
    "mrtpo@one_step_off": "#e377c2",
}


def plot_curves(curves: dict[str, list[dict[str, list[float]]]], k: int, path: Path) -> None:
    """Success (smoothed) per step: mean and 95% band over seeds, one line per method; and
    one small panel per reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    # reward series only ("replay/...", "time/..." are per-step costs, drawn elsewhere)
    rewards = [n for n in next(iter(curves.values()))[0] if n != "success" and "/" not in n]
    ncols = min(4, len(rewards))
    nrows = 1 + math.ceil(len(rewards) / ncols)
    fig = plt.figure(figsize=(3.2 * ncols, 3.0 * nrows), constrained_layout=True)
    grid = fig.add_gridspec(nrows, ncols)
    axes = [(fig.add_subplot(grid[0, :]), "success")]
    for i, r in enumerate(rewards):
        axes.append((fig.add_subplot(grid[1 + i // ncols, i % ncols]), r))
    for ax, series in axes:
        for method, runs in curves.items():
            ys = [smooth(run[series]) for run in runs if series in run]
            if not ys:
                continue
            n = min(len(y) for y in ys)
            mean, lo, hi = [], [], []
            for t in range(n):
                m, h, _ = mean_ci([y[t] for y in ys])
                mean.append(m)
                h = 0.0 if math.isnan(h) else h
                lo.append(m - h)
                hi.append(m + h)
            x = list(range(1, n + 1))
            c = COLORS.get(method)
            ax.plot(x, mean, color=c, label=method, lw=2 if series == "success" else 1.2)
            ax.fill_between(x, lo, hi, color=c, alpha=0.15, lw=0)
        ax.set_title(
            f"all {k} constraints met (moving avg {SMOOTH})" if series == "success" else series,
            fontsize=10 if series == "success" else 9,
        )
        ax.set_xlabel("RL step", fontsize=8)
        ax.set_ylim(-0.02, 1.02)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, ncols=min(len(curves), 6), loc="lower right")
    axes[0][0].set_ylabel("success rate (train samples)", fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_relevance(rec: dict, png: Path, page: Path) -> None:
    """One response, a row per reward: each token shaded by that reward's relevance q
    (scaled by the row's maximum). PNG with matplotlib; HTML with hover titles (q and w)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rec["q"])
    toks = [t.replace("\n", "\\n") for t in rec["tokens"]]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(toks) + 2), 0.55 * len(names) + 1.6))
    for r, name in enumerate(names):
        q = rec["q"][name]
        top = max(q) or 1.0
        for t, v in enumerate(q):
            ax.add_patch(
                plt.Rectangle((t, r), 1, 1, color=(0.84, 0.15, 0.16, 0.05 + 0.9 * v / top))
            )
            ax.text(t + 0.5, r + 0.5, toks[t], ha="center", va="center", fontsize=8)
    ax.set_xlim(0, len(toks))
    ax.set_ylim(len(names), 0)
    ax.set_yticks([i + 0.5 for i in range(len(names))])
    labels = []
    for n in names:
        v = rec["rewards"].get(n)
        labels.append(f"{n} (r={'-' if v is None else f'{v:g}'})")
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xticks([])
    for s in ax.spines.values():
        s.set_visible(False)
    ax.set_title(rec["prompt"], fontsize=8, wrap=True)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    relevance_page(rec, page)


def relevance_page(rec: dict, page: Path) -> None:
    """The HTML version of ``plot_relevance``: a row per reward, each token's q and w on hover."""
    names = list(rec["q"])
    rows = []
    for name in names:
        q, w = rec["q"][name], rec["w"].get(name, [])
        top = max(q) or 1.0
        cells = []
        for t, tok in enumerate(rec["tokens"]):
            wt = f", w={w[t]:.3f}" if t < len(w) else ""
            title = f"{name}: q={q[t]:.4f}{wt}"
            alpha = 0.05 + 0.9 * q[t] / top
            cells.append(
                f'<td style="background: rgba(214,39,40,{alpha:.3f})" title="{html.escape(title)}">'
                f"{html.escape(tok)}</td>"
            )
        v = rec["rewards"].get(name)
        rows.append(
            f"<tr><th>{html.escape(name)} (r={'-' if v is None else f'{v:g}'})</th>"
            + "".join(cells)
            + "</tr>"
        )
    page.write_text(
        "<!doctype html><meta charset='utf-8'><title>MRTPO relevance</title>"
        "<style>body{font-family:sans-serif} td{padding:4px 6px;border:1px solid #eee;"
        "font-family:monospace;white-space:pre} th{text-align:right;padding-right:8px;"
        "font-weight:normal}</style>"
        f"<p><b>Prompt:</b> {html.escape(rec['prompt'])}</p>"
        f"<p>Each row: one reward's relevance q (Jensen–Shannon distance between the next-token "
        f"distributions with and without that constraint in the prompt), shaded relative to the "
        f"row's largest value. Hover a token for q and the token weight w "
        f"(β={rec.get('beta', 0):g}).</p>"
        f"<table>{''.join(rows)}</table>\n"
    )


def _band(series: list[list[float]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Per step: mean and 95% t band over runs (finite values), up to the shortest run."""
    n = min(len(y) for y in series)
    x, mean, lo, hi = [], [], [], []
    for t in range(n):
        m, h, _ = mean_ci([y[t] for y in series])
        if math.isnan(m):
            continue
        h = 0.0 if math.isnan(h) else h
        x.append(t + 1)
        mean.append(m)
        lo.append(m - h)
        hi.append(m + h)
    return x, mean, lo, hi


def plot_gain_vs_k(gains: dict[str, dict[int, tuple[float, float]]], path: Path) -> None:
    """Paired Δ AUC against GDPO per K, one line per method, with 95% interval bars;
    ``gains = {method: {K: (mean, half-width)}}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), constrained_layout=True)
    methods = [m for m in gains if gains[m]]
    for i, m in enumerate(methods):
        ks = sorted(gains[m])
        off = (i - (len(methods) - 1) / 2) * 0.06  # side by side, not on top of each other
        ys = [gains[m][k][0] for k in ks]
        err = [0.0 if math.isnan(gains[m][k][1]) else gains[m][k][1] for k in ks]
        ax.errorbar([k + off for k in ks], ys, yerr=err, color=COLORS.get(m), label=m,
                    marker="o", ms=4, capsize=3, lw=2 if m == "mrtpo" else 1)  # fmt: skip
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set_xlabel("K (rewards per response)")
    ax.set_ylabel("Δ AUC of success vs GDPO (paired, 95% CI)")
    ks = sorted({k for g in gains.values() for k in g})
    ax.set_xticks(ks)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncols=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_replay_share(shares: dict[int, list[list[float]]], path: Path) -> None:
    """Share of candidate (response, reward) pairs replayed per RL step, mean and 95% band
    over MRTPO's seeds, one line per K; ``shares = {K: [per-step series per seed]}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), constrained_layout=True)
    for k, runs in sorted(shares.items()):
        runs = [r for r in runs if r]
        if not runs:
            continue
        x, mean, lo, hi = _band(runs)
        (line,) = ax.plot(x, mean, lw=2, label=f"K = {k}")
        ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15, lw=0)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("RL step")
    ax.set_ylabel("share of pairs replayed (MRTPO)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_long_curves(
    panels: dict[str, dict[str, list[dict[str, list[float]]]]], path: Path
) -> None:
    """The long toy's learning curves: one column per cell (``{label: {method: [series per
    seed]}}``), success on top and the few-token reward ``mark`` below, mean and 95% band over
    seeds of the smoothed series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ("success", "mark")
    fig, axes = plt.subplots(
        len(rows), len(panels), figsize=(3.6 * len(panels), 5.6), squeeze=False,
        sharey=True, constrained_layout=True,
    )  # fmt: skip
    for col, (label, curves) in enumerate(panels.items()):
        for row, series in enumerate(rows):
            ax = axes[row][col]
            for method, runs in curves.items():
                ys = [smooth(r[series]) for r in runs if series in r]
                if not ys:
                    continue
                x, mean, lo, hi = _band(ys)
                c = COLORS.get(method)
                ax.plot(x, mean, color=c, label=method, lw=2 if method == "mrtpo" else 1.2)
                ax.fill_between(x, lo, hi, color=c, alpha=0.15, lw=0)
            what = "all constraints met" if series == "success" else "`mark` met"
            ax.set_title(f"{label}: {what}", fontsize=9)
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
            if row == len(rows) - 1:
                ax.set_xlabel("RL step (moving average of 5)", fontsize=8)
    # one legend for every method of any panel (the ablations run only at the longest free part)
    by_label = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            by_label.setdefault(lab, h)
    axes[0][0].legend(by_label.values(), by_label.keys(), fontsize=7)
    axes[0][0].set_ylabel("share of samples", fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_relevance_wrapped(rec: dict, png: Path, page: Path, width: int = 24) -> None:
    """One long response, ``width`` tokens a line; under each line a row per reward with each
    token shaded by that reward's relevance q (scaled by the reward's largest q over the whole
    response). The HTML page is ``relevance_page``'s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rec["q"])
    toks = [t.replace("\n", "\\n") for t in rec["tokens"]]
    lines = math.ceil(len(toks) / width)
    band = len(names) + 0.6  # rows of one line, and a gap
    fig, ax = plt.subplots(figsize=(0.62 * width + 2.2, 0.32 * band * lines + 1.2))
    tops = {n: (max(rec["q"][n]) or 1.0) for n in names}
    for t, tok in enumerate(toks):
        line, x = divmod(t, width)
        for r, name in enumerate(names):
            y = line * band + r
            v = rec["q"][name][t]
            ax.add_patch(
                plt.Rectangle((x, y), 1, 1, color=(0.84, 0.15, 0.16, 0.04 + 0.9 * v / tops[name]))
            )
            ax.text(x + 0.5, y + 0.5, tok, ha="center", va="center", fontsize=6)
    for line in range(lines):
        for r, name in enumerate(names):
            v = rec["rewards"].get(name)
            ax.text(-0.2, line * band + r + 0.5, f"{name} (r={'-' if v is None else f'{v:g}'})",
                    ha="right", va="center", fontsize=6)  # fmt: skip
    ax.set_xlim(-4.5, width)
    ax.set_ylim(lines * band, 0)
    ax.axis("off")
    ax.set_title(rec["prompt"], fontsize=7, wrap=True)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    relevance_page(rec, page)
