"""Toy replication of MRTPO's learning-speed claim, on a CPU, in minutes.

    make replicate                       # quick: K=4, 5 seeds, grpo/gdpo/mrtpo/mrtpo_shuffle/mrtpo_joint
    make replicate ARGS=--full           # K = 2, 4 and 8
    python scripts/replicate.py --demo   # one short SFT + MRTPO run: watch the reward rise
    python scripts/replicate.py --report-only --logdir logs/replicate/<run>   # redo the report

For each K (number of rewards): one warm start in two SFT passes — ``experiment=toy_sft`` learns
the task from clean references until held-out success reaches a target, then
``experiment=toy_sft_noisy`` trains on references that often break a constraint until success
has fallen to RL's starting level — then RL from that same checkpoint with every method and
seed (``experiment=toy_replication``; the same prompts and sampling seeds for every method,
since both follow ``seed``). Runs go through ``mrtpo.pipeline.build`` in worker processes, one CPU
thread each. Then the script writes ``docs/replication.md``: per K, steps to reach a success
threshold, final success and area under the success curve (mean and 95% interval over seeds,
and paired differences against GDPO), learning-curve PNGs, and the relevance statistics —
how much of each reward's Jensen–Shannon relevance falls on the tokens its checker reads —
with a picture of one response shaded by each reward's relevance (PNG and HTML).
Nothing in the report is written by hand: every number and verdict comes from the runs.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import html
import itertools
import json
import logging
import math
import os
import platform
import re
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "configs"
METHODS = ("grpo", "gdpo", "mrtpo", "mrtpo_shuffle", "mrtpo_joint")
BASELINE = "gdpo"
SMOOTH = 5  # steps in the trailing moving average used for threshold crossings and plots
FINAL_WINDOW = 10  # last steps averaged into the "final" success rate

# Two-sided 95% quantiles of Student's t (df = 1..30); normal beyond.
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Jobs: composed Hydra configs run in worker processes
# ---------------------------------------------------------------------------------------------


@dataclass
class Job:
    key: str  # e.g. "k4/sft", "k4/mrtpo/s0"
    overrides: list[str]
    out: Path
    steps: int  # expected steps (for the progress bar; SFT: the upper bound)


def compose(overrides: Sequence[str]):
    """The real training config, composed as ``src/train.py`` would compose it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = hydra_compose("train.yaml", overrides=list(overrides), return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
    return cfg


def _quiet() -> None:
    """Keep the console for the progress display: no library banners, bars or warnings."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    import lightning  # noqa: F401  (sets its own log levels on import: import first)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    for name in list(logging.root.manager.loggerDict):
        if name.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric", "mrtpo"):
            logging.getLogger(name).setLevel(logging.ERROR)
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "mrtpo"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _worker_init(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    _quiet()


def _reporter(queue, key: str):
    import lightning as L

    class Reporter(L.Callback):
        """Sends (job, step, success) to the parent for its progress display."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            m = trainer.callback_metrics
            val = m.get("train/success", m.get("val_success"))
            queue.put((key, int(trainer.global_step), None if val is None else float(val)))

    return Reporter()


def run_job(job: Job, queue=None) -> dict[str, Any]:
    """Train one composed config (in a worker process); return where its results are."""
    from mrtpo.pipeline import build, metrics_csv

    t0 = time.perf_counter()
    try:
        cfg = compose(job.overrides)
        trainer, module, dm = build(cfg)
        if queue is not None:
            trainer.callbacks.append(_reporter(queue, job.key))
        trainer.fit(module, datamodule=dm)
        path = metrics_csv(trainer)
        result = {"key": job.key, "csv": str(path) if path else None, "error": None}
    except Exception as exc:  # reported in the parent; one failed run must not lose the rest
        result = {"key": job.key, "csv": None, "error": f"{exc}\n{traceback.format_exc()}"}
    result["wall_s"] = time.perf_counter() - t0
    (job.out / "job.json").write_text(json.dumps(result, indent=2))
    return result


def run_all(jobs: list[Job], workers: int, threads: int, console, title: str) -> dict[str, dict]:
    """Run jobs on a process pool with a rich progress display; skip finished ones."""
    import multiprocessing as mp

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    results: dict[str, dict] = {}
    todo = []
    for job in jobs:
        done = job.out / "job.json"
        if done.exists():
            prev = json.loads(done.read_text())
            if not prev.get("error"):
                results[job.key] = prev
                continue
        job.out.mkdir(parents=True, exist_ok=True)
        todo.append(job)
    if not todo:
        return results
    # Workers are fresh interpreters ("spawn": no forked torch state) that inherit sys.path;
    # they import this file by name when it was itself imported (tests).
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.append(here)
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    queue = manager.Queue()
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    )
    with (
        Progress(*columns, console=console, transient=False) as progress,
        ProcessPoolExecutor(
            max_workers=workers, mp_context=ctx, initializer=_worker_init, initargs=(threads,)
        ) as pool,
    ):
        overall = progress.add_task(f"[bold]{title}", total=len(todo), info="")
        bars: dict[str, int] = {}
        pending: dict[Future, Job] = {pool.submit(run_job, j, queue): j for j in todo}
        while pending:
            done, _ = wait(list(pending), timeout=0.5, return_when=FIRST_COMPLETED)
            while not queue.empty():
                key, step, succ = queue.get_nowait()
                if key not in bars:
                    steps = next(j.steps for j in todo if j.key == key)
                    bars[key] = progress.add_task(f"  {key}", total=steps, info="")
                info = "" if succ is None else f"success {succ:.2f}"
                progress.update(bars[key], completed=step, info=info)
            for fut in done:
                job = pending.pop(fut)
                res = fut.result()
                results[job.key] = res
                if job.key in bars:
                    progress.remove_task(bars[job.key])
                progress.advance(overall)
                if res.get("error"):
                    console.print(f"[red]{job.key} failed:[/red] {res['error'].splitlines()[0]}")
                    console.print(res["error"][-2000:], markup=False)
    manager.shutdown()
    return results


# ---------------------------------------------------------------------------------------------
# Reading runs
# ---------------------------------------------------------------------------------------------


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """Rows of a Lightning metrics.csv, numbers only (empty cells dropped)."""
    rows = []
    with open(path) as f:
        for r in csv.DictReader(f):
            row = {}
            for k, v in r.items():
                if v not in ("", None):
                    with contextlib.suppress(ValueError):
                        row[k] = float(v)
            rows.append(row)
    return rows


def rl_curves(path: str | Path) -> dict[str, list[float]]:
    """Per-step series of an RL run: success and each reward's mean."""
    rows = [r for r in read_metrics(path) if "train/success" in r]
    rows.sort(key=lambda r: r["step"])
    out: dict[str, list[float]] = {"success": [r["train/success"] for r in rows]}
    for k in rows[0] if rows else {}:
        m = re.fullmatch(r"train/reward/(.+)/mean", k)
        if m and m.group(1) != "total":
            out[m.group(1)] = [r.get(k, math.nan) for r in rows]
    return out


def smooth(x: Sequence[float], w: int = SMOOTH) -> list[float]:
    """Trailing moving average (the first points average what exists)."""
    out, acc = [], []
    for v in x:
        acc.append(v)
        if len(acc) > w:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def t975(n: int) -> float:
    return _T975[n - 2] if 2 <= n <= len(_T975) + 1 else 1.96


def mean_ci(values: Sequence[float]) -> tuple[float, float, int]:
    """(mean, half-width of the 95% t interval, n) over the finite values."""
    v = [x for x in values if x is not None and math.isfinite(x)]
    n = len(v)
    if n == 0:
        return math.nan, math.nan, 0
    m = sum(v) / n
    if n < 2:
        return m, math.nan, n
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (n - 1))
    return m, t975(n) * sd / math.sqrt(n), n


def run_stats(success: Sequence[float], threshold: float) -> dict[str, float]:
    s = smooth(success)
    hit = next((i for i, v in enumerate(s) if v >= threshold), None)
    n = len(success)
    return {
        "start": sum(success[:3]) / max(1, len(success[:3])),
        "steps_to_threshold": float(hit + 1) if hit is not None else math.nan,
        "final": sum(success[-FINAL_WINDOW:]) / max(1, len(success[-FINAL_WINDOW:])),
        "auc": sum(success) / n if n else math.nan,
        "steps": float(n),
    }


# ---------------------------------------------------------------------------------------------
# Relevance: where each reward's JS distance lands
# ---------------------------------------------------------------------------------------------


def token_word_index(tokenizer, token_ids: Sequence[int]) -> tuple[list[int | None], int]:
    """For each response token: the index of the word it belongs to, ``n_words`` for an
    end-of-sequence/special token (it decides where the response ends), None for spaces."""
    special = set(tokenizer.all_special_ids)
    pieces, spans, text = [], [], ""
    for i in token_ids:
        piece = "" if i in special else tokenizer.decode([i])
        spans.append((len(text), len(text) + len(piece)))
        pieces.append(piece)
        text += piece
    words = [(m.start(), m.end()) for m in re.finditer(r"[a-z]+", text.lower())]
    out: list[int | None] = []
    for tid, (a, b) in zip(token_ids, spans, strict=True):
        if tid in special:
            out.append(len(words))
            continue
        idx = next((w for w, (s, e) in enumerate(words) if s < b and a < e), None)
        out.append(idx)
    return out, len(words)


def relevance_stats(records: list[dict], task, tokenizer) -> dict[str, dict[str, float]]:
    """Per constraint type: the share of its relevance on the tokens its checker reads, and
    those tokens' share of the response (means over response–reward pairs)."""
    by_id = {}
    for split in ("train", "val"):
        by_id.update({e.id: e for e in task.examples(split)})
    acc: dict[str, dict[str, list[float]]] = {}
    for rec in records:
        ex = by_id.get(rec["id"])
        if ex is None:
            continue
        ids = rec["token_ids"]
        special = set(tokenizer.all_special_ids)
        text = tokenizer.decode([i for i in ids if i not in special])
        decisive = task.decisive_words(ex, text)
        word_of, _ = token_word_index(tokenizer, ids)
        for name, q in rec["q"].items():
            if name not in decisive or not decisive[name]:
                continue
            wanted = set(decisive[name])
            toks = [t for t, w in enumerate(word_of) if w is not None and w in wanted]
            total = sum(q)
            if not toks or total <= 0:
                continue
            kind = re.sub(r"_\d+$", "", name)
            a = acc.setdefault(kind, {"q_share": [], "tok_share": [], "argmax": []})
            a["q_share"].append(sum(q[t] for t in toks) / total)
            a["tok_share"].append(len(toks) / len(q))
            a["argmax"].append(float(max(range(len(q)), key=q.__getitem__) in toks))
    out = {}
    for kind, a in acc.items():
        n = len(a["q_share"])
        qs, ts = sum(a["q_share"]) / n, sum(a["tok_share"]) / n
        out[kind] = {
            "pairs": n,
            "q_share": qs,
            "tok_share": ts,
            "enrichment": qs / ts if ts > 0 else math.nan,
            "argmax_hit": sum(a["argmax"]) / n,
        }
    return out


def replay_records(
    policy_dir: Path, k: int, prompts: int, group: int, seed: int, beta: float
) -> list[dict]:
    """Sample responses from a policy, replay every (response, reward) pair, and return them
    in the relevance-dump format (``RelevanceDump``: tokens, token_ids, q, w per reward)."""
    import torch

    from mrtpo.batch import ScoredBatch, rewards_tensor
    from mrtpo.credit import relevance_weights
    from mrtpo.models import eos_token_ids, load_policy
    from mrtpo.replay import Replayer
    from mrtpo.rollout.base import SamplingConfig
    from mrtpo.rollout.build import build_rollout
    from mrtpo.rollout.hf import HFEngine

    cfg = compose(["experiment=toy_replication", f"task.num_constraints={k}"])
    from hydra.utils import instantiate

    task = instantiate(cfg.task)
    model, tok = load_policy(str(policy_dir))
    model.eval()
    engine = HFEngine()
    eos = eos_token_ids(tok, model)
    engine.bind(model, tok, eos)
    examples = list(task.examples("val"))[:prompts]
    sampling = SamplingConfig(
        temperature=float(cfg.rollout.sampling.temperature),
        max_new_tokens=int(cfg.rollout.sampling.max_new_tokens),
    )
    roll = build_rollout(engine, tok, examples, group, sampling, seed, eos)
    scores = task.score_many(roll.examples, roll.texts)
    names = tuple(task.reward_names)
    scored = ScoredBatch(
        rollout=roll, scores=scores, reward_names=names, rewards=rewards_tensor(scores, names)
    )
    pairs = ~scored.rewards.isnan()
    res = Replayer(tok).run(model, task, scored, pairs, "per_reward")
    w = relevance_weights(res.q, roll.response_mask, res.replayed, beta)
    records = []
    for j in range(roll.n):
        t = int(roll.response_mask[j].sum())
        ids = roll.response_ids[j, :t].tolist()
        records.append(
            {
                "step": 0,
                "id": roll.examples[j].id,
                "beta": beta,
                "prompt": roll.examples[j].messages[-1]["content"],
                "tokens": [tok.decode([i]) for i in ids],
                "token_ids": ids,
                "rewards": scores[j].rewards,
                "q": {
                    n: torch.round(res.q[j, i, :t], decimals=5).tolist()
                    for i, n in enumerate(names)
                    if res.replayed[j, i]
                },
                "w": {
                    n: torch.round(w[j, i, :t], decimals=5).tolist()
                    for i, n in enumerate(names)
                    if res.replayed[j, i]
                },
            }
        )
    return records


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pick_record(records: list[dict]) -> dict | None:
    """The most telling response to draw: most rewards replayed, with met and unmet ones."""

    def score(r):
        vals = [v for v in r["rewards"].values() if v is not None]
        mixed = 0 < sum(vals) < len(vals)
        return (len(r["q"]), mixed, len(r["tokens"]) >= 5, -r.get("step", 0))

    good = [r for r in records if r["q"]]
    return max(good, key=score) if good else None


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------

COLORS = {
    "grpo": "#7f7f7f",
    "gdpo": "#1f77b4",
    "mrtpo": "#d62728",
    "mrtpo_shuffle": "#ff7f0e",
    "mrtpo_joint": "#2ca02c",
}


def plot_curves(curves: dict[str, list[dict[str, list[float]]]], k: int, path: Path) -> None:
    """Success (smoothed) per step: mean and 95% band over seeds, one line per method; and
    one small panel per reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rewards = [n for n in next(iter(curves.values()))[0] if n != "success"]
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
    axes[0][0].legend(fontsize=8, ncols=len(curves), loc="lower right")
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


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def fmt(m: float, h: float, digits: int = 3) -> str:
    if m is None or math.isnan(m):
        return "–"
    if h is None or math.isnan(h):
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} ± {h:.{digits}f}"


def verdict(d_mean: float, d_half: float, what: str) -> str:
    if math.isnan(d_mean):
        return f"{what}: no data"
    if math.isnan(d_half):
        return f"{what}: {d_mean:+.3f} (one seed, no interval)"
    lo, hi = d_mean - d_half, d_mean + d_half
    if lo > 0:
        word = "higher, and the 95% interval excludes zero"
    elif hi < 0:
        word = "lower, and the 95% interval excludes zero"
    else:
        word = "not distinguishable from zero at this number of seeds"
    return f"{what}: {d_mean:+.3f} [{lo:+.3f}, {hi:+.3f}] — {word}"


def _sign(ci: tuple[float, float, int]) -> int:
    """+1 / -1 when the 95% interval excludes zero above / below, else 0."""
    m, h, _ = ci
    if math.isnan(m) or math.isnan(h):
        return 0
    return 1 if m - h > 0 else -1 if m + h < 0 else 0


def interpret(diffs: dict[str, tuple]) -> list[str]:
    """Plain-language reading of the paired AUC differences against GDPO (rules, not prose
    written after seeing the numbers)."""
    out = []
    if "mrtpo" not in diffs:
        return out
    gain = _sign(diffs["mrtpo"][0])
    if gain > 0:
        out.append(
            "**MRTPO learned faster than GDPO** on this toy (higher area under the success "
            "curve, interval excluding zero)."
        )
    elif gain < 0:
        out.append("**MRTPO learned more slowly than GDPO** on this toy.")
    else:
        out.append(
            "**MRTPO did not beat GDPO by a margin these seeds can resolve here.** The "
            "paper's claim is not confirmed at this scale; the effect, if any, is small next "
            "to the seed-to-seed noise."
        )
    if "mrtpo_shuffle" in diffs and gain > 0:
        sh = _sign(diffs["mrtpo_shuffle"][0])
        out.append(
            "Shuffling MRTPO's token weights within each response (same weights, random "
            "positions) "
            + (
                "removes the gain, so it comes from *where* the credit goes, not from "
                "reweighting as such."
                if sh <= 0
                else "keeps a gain, so part of the effect does not depend on where the credit goes."
            )
        )
    if "mrtpo_joint" in diffs:
        j = diffs["mrtpo_joint"][0]
        jm, mm = j[0], diffs["mrtpo"][0][0]
        word = {1: "beats GDPO", 0: "is not distinguishable from GDPO", -1: "trails GDPO"}
        out.append(
            f"The joint ablation (one relevance profile for all rewards together) "
            f"{word[_sign(j)]}, with a mean gain "
            f"{'below' if jm < mm else 'at or above'} MRTPO's."
        )
    return out


@dataclass
class KResult:
    k: int
    sft: dict[str, dict[str, Any]]  # SFT summary per warm-start pass
    curves: dict[str, list[dict[str, list[float]]]] = field(default_factory=dict)
    seeds: dict[str, list[int]] = field(default_factory=dict)
    relevance_sft: dict[str, dict[str, float]] = field(default_factory=dict)
    relevance_rl: dict[str, dict[str, float]] = field(default_factory=dict)
    picture: str | None = None


def write_report(
    results: list[KResult], args, settings: dict[str, Any], wall_s: float, out: Path
) -> Path:
    lines: list[str] = []
    add = lines.append
    mode = "full" if args.full else "quick"
    add("# Toy replication: does MRTPO learn faster than GDPO?")
    add("")
    add(
        "_Generated by `scripts/replicate.py` "
        f"({'`make replicate ARGS=--full`' if args.full else '`make replicate`'}) on "
        f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; do not edit by hand._"
    )
    add("")
    add(
        "The paper's tables need 7B models and GPUs. This miniature asks the same question on a "
        "CPU: a small policy learns to write word sequences under K programmatically checked "
        "constraints (first word, last word, words to include or avoid, word count), each a "
        "binary reward decided by different tokens of the response. Per K, one warm start in "
        "two SFT passes — first on clean reference responses until the policy has learned to "
        "read the constraints off the prompt, then on references that often break a "
        "constraint until its success rate has fallen to a low target — so that RL starts "
        "from a policy that *can* meet every constraint but often does not. Then RL from that "
        "same checkpoint with each method and seed (same prompts and sampling seeds for every "
        "method). *Success* is the share of sampled responses meeting all K constraints."
    )
    add("")
    add("## Setup")
    add("")
    add(f"- mode: **{mode}**, K = {', '.join(str(r.k) for r in results)}; "
        f"seeds: {args.seeds}; methods: {', '.join(args.methods)}")  # fmt: skip
    for k, v in settings.items():
        add(f"- {k}: {v}")
    add(
        f"- wall time: **{wall_s / 60:.1f} min** for the whole run on {os.cpu_count()} CPU "
        f"cores ({args.workers} worker processes, {args.threads} thread each; "
        f"{platform.processor() or platform.machine()})"
    )
    add(
        f"- statistics: mean ± half-width of the 95% t-interval over seeds; success curves "
        f"smoothed by a trailing {SMOOTH}-step average before the threshold test; *final* = "
        f"mean success over the last {FINAL_WINDOW} steps; *AUC* = mean success over all "
        "steps (area under the curve divided by its length). A run that never reaches the "
        "threshold counts as the number of steps it ran (a lower bound), so its mean is too."
    )
    add("")
    by_k: dict[int, dict[str, tuple]] = {}
    for r in results:
        add(f"## K = {r.k}")
        add("")
        for phase, what in (
            (SFT_PHASES[0], "learn the task (clean references)"),
            (SFT_PHASES[1], "lower the success rate (references that often break a constraint)"),
        ):
            sm = r.sft.get(phase)
            if not sm:
                continue
            last = sm["history"][-1] if sm.get("history") else {}
            rates = ", ".join(
                f"{n.split('/', 1)[1]} {v:.2f}" for n, v in last.items() if n.startswith("reward/")
            )
            ev = sm.get("eval", {})
            sign = "≤" if sm.get("stop_when") == "below" else "≥"
            add(
                f"**Warm start, {what}:** {sm.get('steps', '?')} SFT steps; "
                f"{'stopped at' if sm.get('reached') else 'did NOT reach'} the target held-out "
                f"success {sign} {sm.get('target_success')}; held-out success "
                f"{last.get('success', math.nan):.3f} ({ev.get('prompts')} prompts × "
                f"{ev.get('samples')} samples at temperature {ev.get('temperature')}); per "
                f"constraint: {rates}."
            )
            add("")
        thr = args.threshold
        stats = {m: [run_stats(c["success"], thr) for c in runs] for m, runs in r.curves.items()}
        n_seeds = {m: len(v) for m, v in stats.items()}
        add(f"| method | seeds | start | steps to success ≥ {thr:g} | reached | final | AUC |")
        add("|---|---|---|---|---|---|---|")
        for m in args.methods:
            if m not in stats:
                continue
            st = stats[m]
            steps = [x["steps_to_threshold"] if not math.isnan(x["steps_to_threshold"])
                     else x["steps"] for x in st]  # fmt: skip
            reached = sum(not math.isnan(x["steps_to_threshold"]) for x in st)
            cells = [
                fmt(*mean_ci([x["start"] for x in st])[:2]),
                fmt(*mean_ci(steps)[:2], digits=1),
                f"{reached}/{len(st)}",
                fmt(*mean_ci([x["final"] for x in st])[:2]),
                fmt(*mean_ci([x["auc"] for x in st])[:2]),
            ]
            add(f"| {m} | {n_seeds[m]} | " + " | ".join(cells) + " |")
        add("")
        if BASELINE in stats:
            add(
                f"Paired differences against {BASELINE} (same seed: same prompts, same first batch):"
            )
            add("")
            add("| method | Δ AUC | Δ final | Δ steps to threshold | seeds with higher AUC |")
            add("|---|---|---|---|---|")
            base = dict(zip(r.seeds[BASELINE], stats[BASELINE], strict=True))
            diffs = by_k.setdefault(r.k, {})
            for m in args.methods:
                if m == BASELINE or m not in stats:
                    continue
                pairs = [(x, base[s]) for s, x in zip(r.seeds[m], stats[m], strict=True)
                         if s in base]  # fmt: skip
                if not pairs:
                    continue

                def steps_of(x):
                    return (
                        x["steps"]
                        if math.isnan(x["steps_to_threshold"])
                        else x["steps_to_threshold"]
                    )

                d_auc = [a["auc"] - b["auc"] for a, b in pairs]
                d_fin = [a["final"] - b["final"] for a, b in pairs]
                d_stp = [steps_of(a) - steps_of(b) for a, b in pairs]
                diffs[m] = (mean_ci(d_auc), mean_ci(d_fin), mean_ci(d_stp))
                wins = sum(d > 0 for d in d_auc)
                add(
                    f"| {m} | {fmt(*diffs[m][0][:2])} | {fmt(*diffs[m][1][:2])} | "
                    f"{fmt(*diffs[m][2][:2], digits=1)} | {wins}/{len(pairs)} |"
                )
            add("")
            add("What the numbers say:")
            add("")
            if "mrtpo" in diffs:
                add("- " + verdict(*diffs["mrtpo"][0][:2], "MRTPO − GDPO, AUC"))
                add("- " + verdict(*diffs["mrtpo"][1][:2], "MRTPO − GDPO, final success"))
            if "mrtpo_shuffle" in diffs and "mrtpo" in diffs:
                add("- " + verdict(*diffs["mrtpo_shuffle"][0][:2], "MRTPO-shuffle − GDPO, AUC"))
            if "mrtpo_joint" in diffs:
                add("- " + verdict(*diffs["mrtpo_joint"][0][:2], "MRTPO-joint − GDPO, AUC"))
            if "grpo" in diffs:
                add("- " + verdict(*diffs["grpo"][0][:2], "GRPO − GDPO, AUC"))
            for line in interpret(diffs):
                add("- " + line)
            add("")
        add(f"![learning curves, K={r.k}](figures/replication_k{r.k}.png)")
        add("")
        add("### Where the relevance lands")
        add("")
        add(
            "For each response–constraint pair, the share of that constraint's relevance "
            "(sum of q over the response) on the tokens its checker reads — the first word; the "
            "last word; every occurrence of an included or avoided word (pairs where the word "
            "occurs); for the word count, the end-of-sequence token, whose position sets the "
            "count — against those tokens' share of the response. Enrichment = relevance share "
            "/ token share (1 = no better than spreading evenly); *argmax* = how often the "
            "single most relevant token is one of them."
        )
        add("")
        for label, rel in (
            ("warm-start policy, every pair replayed (direct replay)", r.relevance_sft),
            ("during MRTPO training (relevance dumps of the mrtpo runs)", r.relevance_rl),
        ):
            if not rel:
                continue
            add(f"*{label}:*")
            add("")
            add(
                "| constraint | pairs | token share | relevance share | enrichment | argmax on them |"
            )
            add("|---|---|---|---|---|---|")
            for kind, v in sorted(rel.items()):
                add(
                    f"| {kind} | {v['pairs']} | {v['tok_share']:.3f} | {v['q_share']:.3f} | "
                    f"{v['enrichment']:.2f}× | {v['argmax_hit']:.2f} |"
                )
            add("")
        if r.picture:
            add(
                f"One response, each token shaded by each reward's relevance "
                f"([hover version](figures/relevance_k{r.k}.html)):"
            )
            add("")
            add(f"![relevance, K={r.k}](figures/relevance_k{r.k}.png)")
            add("")
    if len(by_k) > 1:
        add("## Across K: does the gain grow with the number of rewards?")
        add("")
        cols = [m for m in args.methods if m != BASELINE]
        add("| K | " + " | ".join(f"{m} − gdpo, Δ AUC" for m in cols) + " |")
        add("|---|" + "---|" * len(cols))
        for k, d in sorted(by_k.items()):
            add(f"| {k} | " + " | ".join(fmt(*d[m][0][:2]) if m in d else "–" for m in cols) + " |")
        add("")
        gains = [(k, d["mrtpo"][0]) for k, d in sorted(by_k.items()) if "mrtpo" in d]
        if len(gains) > 1:
            means = [g[0] for _, g in gains]
            rising = all(b > a for a, b in itertools.pairwise(means))
            overlap = any(
                abs(a[0] - b[0]) < (a[1] + b[1])
                for (_, a), (_, b) in itertools.pairwise(gains)
                if not (math.isnan(a[1]) or math.isnan(b[1]))
            )
            add(
                "- MRTPO's mean gain over GDPO "
                + ("rises with K" if rising else "does not rise steadily with K")
                + (
                    ", but neighbouring intervals overlap: the trend is not resolved at this "
                    "number of seeds."
                    if overlap
                    else ", and neighbouring intervals do not overlap."
                )
            )
            add("")
    add("## Caveats")
    add("")
    add(
        "- Scale: a ~100k-parameter model trained from scratch on a synthetic task, not a "
        "pretrained LLM; effect sizes here say nothing about the paper's numbers, only whether "
        "the mechanism pushes in the claimed direction."
    )
    add(
        "- Success is measured on each step's own training samples (B prompts × G samples), "
        "not on held-out prompts; the per-seed curves are noisy and the tables average them."
    )
    add(
        "- The warm start is engineered for headroom: references that break constraints on "
        "purpose make a policy that *can* follow each constraint but often does not, which is "
        "the regime where placing each reward's credit on the right tokens can matter."
    )
    add("")
    add("## Reproduce")
    add("")
    add("```")
    add("make replicate                 # this report (quick mode)")
    add("make replicate ARGS=--full     # K = 2, 4, 8")
    add("python scripts/replicate.py --report-only --logdir <logs/replicate/...>")
    add("```")
    add("")
    add(
        "Raw runs (metrics.csv per run, relevance dumps, the SFT checkpoints) are under the log "
        f"folder (`{os.path.relpath(args.logdir, ROOT)}` for this report)."
    )
    add("")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    return out


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


SFT_PHASES = ("sft", "sft_noisy")  # folder names; experiment=toy_<name>


def sft_job(k: int, phase: str, logdir: Path, args) -> Job:
    """Warm-start pass ``phase`` for K; the noisy pass starts from the clean pass's policy."""
    out = logdir / f"k{k}" / phase
    ov = [
        f"experiment=toy_{phase}",
        f"task.num_constraints={k}",
        f"paths.output_dir={out}",
        f"paths.log_dir={logdir}",
        "++trainer.enable_progress_bar=false",
        f"stage.sft.save_dir={out / 'policy'}",
        f"seed={args.sft_seed}",
    ]
    if phase != SFT_PHASES[0]:
        ov += [
            f"model.name_or_path={logdir / f'k{k}' / SFT_PHASES[0] / 'policy'}",
            "model.tiny=null",
        ]
    if args.sft_max_steps is not None:
        ov.append(f"trainer.max_steps={args.sft_max_steps}")
    ov += args.sft_override
    cfg = compose(ov)
    return Job(f"k{k}/{phase}", ov, out, int(cfg.trainer.max_steps))


def warm_start(k: int, logdir: Path) -> Path:
    """The policy every RL run of K starts from."""
    return logdir / f"k{k}" / SFT_PHASES[-1] / "policy"


def run_warm_starts(args, console, workers: int) -> bool:
    for phase in SFT_PHASES:
        jobs = [sft_job(k, phase, args.logdir, args) for k in args.k_values]
        res = run_all(jobs, workers, args.threads, console, f"SFT ({phase})")
        failed = [key for key, v in res.items() if v.get("error")]
        if failed:
            console.print(f"[red]SFT failed for {failed}; stopping")
            return False
    return True


def rl_job(k: int, method: str, seed: int, policy: Path, logdir: Path, args) -> Job:
    out = logdir / f"k{k}" / method / f"s{seed}"
    ov = [
        "experiment=toy_replication",
        f"task.num_constraints={k}",
        f"method={method}",
        f"seed={seed}",
        f"model.name_or_path={policy}",
        "model.tiny=null",
        f"paths.output_dir={out}",
        f"paths.log_dir={logdir}",
        "++trainer.enable_progress_bar=false",
    ]
    if args.steps is not None:
        ov.append(f"trainer.max_steps={args.steps}")
    ov += args.override
    steps = args.steps if args.steps is not None else int(compose(ov).trainer.max_steps)
    return Job(f"k{k}/{method}/s{seed}", ov, out, steps)


def parse_args(argv: Sequence[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--full", action="store_true", help="K = 2, 4 and 8 (default: K = 4 only)")
    p.add_argument("--demo", action="store_true", help="one short SFT + MRTPO run (make train)")
    p.add_argument(
        "--ks", type=str, default=None, help="comma-separated K values (overrides --full)"
    )
    p.add_argument("--seeds", type=int, default=5, help="seeds per method (default 5)")
    p.add_argument("--methods", type=str, default=",".join(METHODS))
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the preset's)")
    p.add_argument("--threshold", type=float, default=0.5, help="success rate for 'steps to'")
    p.add_argument("--sft-max-steps", type=int, default=None, help="SFT step limit")
    p.add_argument("--sft-seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--logdir", type=Path, default=None, help="default: logs/replicate/<time>")
    p.add_argument("--docs", type=Path, default=ROOT / "docs", help="where the report goes")
    p.add_argument("--report-only", action="store_true", help="rebuild the report from --logdir")
    p.add_argument("--relevance-prompts", type=int, default=32)
    p.add_argument("--override", action="append", default=[], help="extra RL config override")
    p.add_argument(
        "--sft-override", action="append", default=[], help="extra override for both SFT passes"
    )
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.methods) - {p.stem for p in (CONFIG_DIR / "method").glob("*.yaml")})
    if unknown:
        p.error(f"unknown method(s) {unknown}; see configs/method/")
    if args.ks:
        args.k_values = [int(x) for x in args.ks.split(",")]
    else:
        args.k_values = [2, 4, 8] if args.full else [4]
    if args.logdir is None:
        if args.report_only:
            p.error("--report-only needs --logdir")
        stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
        args.logdir = ROOT / "logs" / ("demo" if args.demo else "replicate") / stamp
    args.logdir = args.logdir.resolve()
    return args


def demo(args, console) -> int:
    """Warm start, then MRTPO: print the success rate climbing, step by step."""
    from rich.table import Table

    from mrtpo.sft import read_summary

    k = args.k_values[0]
    console.rule(f"[bold]Demo: SFT warm start, then MRTPO on the synthetic task (K={k})")
    if not run_warm_starts(args, console, 1):
        return 1
    for phase in SFT_PHASES:
        s = read_summary(args.logdir / f"k{k}" / phase / "policy")
        console.print(
            f"SFT ({phase}): {s['steps']} steps, held-out success "
            f"{s['history'][-1]['success']:.2f} (target {s['stop_when']} {s['target_success']})"
        )
    job = rl_job(k, "mrtpo", 0, warm_start(k, args.logdir), args.logdir, args)
    res = run_all([job], 1, args.threads, console, "MRTPO")
    r = res[job.key]
    if r.get("error"):
        return 1
    cur = rl_curves(r["csv"])
    table = Table(title=f"MRTPO from the warm start: success = all {k} constraints met")
    table.add_column("RL steps")
    for name in cur:
        table.add_column(name)
    n = len(cur["success"])
    for a in range(0, n, 5):
        table.add_row(
            f"{a + 1}-{min(n, a + 5)}",
            *(f"{sum(v[a : a + 5]) / len(v[a : a + 5]):.2f}" for v in cur.values()),
        )
    console.print(table)
    console.print(
        f"success rose from {sum(cur['success'][:5]) / 5:.2f} (first 5 steps) to "
        f"{sum(cur['success'][-5:]) / 5:.2f} (last 5). Metrics: {r['csv']}"
    )
    return 0


# What a run was made with: --report-only reads these back from the log folder.
_RUN_KEYS = ("k_values", "seeds", "methods", "steps", "full", "override", "sft_override",
             "sft_max_steps", "sft_seed", "workers", "threads")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    from rich.console import Console

    args = parse_args(argv)
    console = Console()
    _quiet()
    sys.path.insert(0, str(ROOT / "src"))
    if args.demo:
        return demo(args, console)
    t0 = time.perf_counter()
    wall_file = args.logdir / "wall_s.json"
    run_file = args.logdir / "run.json"
    if args.report_only:
        if not run_file.exists():
            console.print(f"[red]{run_file} not found: is --logdir a replicate run folder?")
            return 1
        for key, value in json.loads(run_file.read_text()).items():
            setattr(args, key, value)
    else:
        args.logdir.mkdir(parents=True, exist_ok=True)
        run_file.write_text(json.dumps({k: getattr(args, k) for k in _RUN_KEYS}, indent=2))
        console.rule(
            f"[bold]Toy replication: K={args.k_values}, {args.seeds} seeds, "
            f"{len(args.methods)} methods → {args.logdir}"
        )
        if not run_warm_starts(args, console, args.workers):
            return 1
        jobs = [
            rl_job(k, m, s, warm_start(k, args.logdir), args.logdir, args)
            for k in args.k_values
            for s in range(args.seeds)
            for m in args.methods
        ]
        run_all(jobs, args.workers, args.threads, console, "RL runs")
    results = analyse(args, console)
    settings = describe(args)
    if not args.report_only:  # training and analysis; a resumed run adds to the earlier time
        prev = json.loads(wall_file.read_text())["wall_s"] if wall_file.exists() else 0.0
        wall_file.write_text(json.dumps({"wall_s": prev + time.perf_counter() - t0}))
    wall = json.loads(wall_file.read_text())["wall_s"] if wall_file.exists() else math.nan
    out = write_report(results, args, settings, wall, args.docs / "replication.md")
    console.print(f"[bold green]report:[/bold green] {out}  (wall time {wall / 60:.1f} min)")
    return 0


def describe(args) -> dict[str, Any]:
    """The settings that shape the result, read from the composed presets."""
    from hydra.utils import instantiate

    ov = ["experiment=toy_replication", *args.override]
    if args.steps is not None:
        ov.append(f"trainer.max_steps={args.steps}")
    cfg = compose(ov)
    sft = compose(["experiment=toy_sft", *args.sft_override]).stage.sft
    noisy = compose(["experiment=toy_sft_noisy", *args.sft_override])
    tiny = cfg.model.tiny
    n_params = None
    policy = warm_start(args.k_values[0], args.logdir) / "config.json"
    if policy.exists():
        c = json.loads(policy.read_text())
        h, i, n, v = (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                      c["vocab_size"])  # fmt: skip
        kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
        n_params = v * h + n * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + h
    task = instantiate(cfg.task)
    return {
        "policy": (
            f"Qwen2 architecture, {tiny.num_hidden_layers} layers, hidden {tiny.hidden_size}, "
            f"{tiny.num_attention_heads} heads, vocabulary {tiny.vocab_size} (byte-level BPE "
            f"trained offline), random init (std {tiny.initializer_range})"
            + (f", ~{n_params / 1e3:.0f}k parameters" if n_params else "")
        ),
        "task": (
            f"synthetic word constraints, responses of {task.min_words}–{task.max_words} words; "
            f"SFT on {noisy.task.num_train} generated prompts, RL on the first "
            f"{task.num_train} of them; SFT checks and the direct replay on held-out (val) prompts"
        ),
        "SFT (warm start)": (
            f"(1) clean references, lr {sft.lr}, batch {sft.batch_size}, until held-out success "
            f"≥ {sft.target_success} (checked every {sft.eval_every} steps from step "
            f"{sft.min_steps}); (2) from there, references of which "
            f"{noisy.task.reference_success:.0%} meet every constraint (each constraint broken "
            f"independently), lr {noisy.stage.sft.lr}, at least {noisy.stage.sft.min_steps} steps "
            f"and until held-out success ≤ {noisy.stage.sft.target_success}"
        ),
        "RL": (
            f"{cfg.trainer.max_steps} steps × {cfg.rl.prompts_per_step} prompts × "
            f"{cfg.rl.group_size} samples, temperature {cfg.rollout.sampling.temperature}, "
            f"max {cfg.rollout.sampling.max_new_tokens} new tokens, lr {cfg.optim.lr}, "
            f"mini-batch {cfg.rl.mini_batch_size}, clip {cfg.rl.clip_low}/{cfg.rl.clip_high}, "
            f"no KL; MRTPO β={cfg.method.beta} (warm-up {cfg.method.beta_warmup_steps} steps)"
        ),
    }


def analyse(args, console) -> list[KResult]:
    from hydra.utils import instantiate

    from mrtpo.models import load_policy
    from mrtpo.sft import read_summary

    figs = args.docs / "figures"
    results = []
    for k in args.k_values:
        kdir = args.logdir / f"k{k}"
        policy = warm_start(k, args.logdir)
        if not policy.exists():
            console.print(f"[yellow]no warm-start policy for K={k} under {kdir}; skipped")
            continue
        r = KResult(k=k, sft={ph: read_summary(kdir / ph / "policy") for ph in SFT_PHASES})
        for m in args.methods:
            for s in range(args.seeds):
                job = kdir / m / f"s{s}" / "job.json"
                if not job.exists():
                    continue
                info = json.loads(job.read_text())
                if info.get("error") or not info.get("csv"):
                    continue
                c = rl_curves(info["csv"])
                if c["success"]:
                    r.curves.setdefault(m, []).append(c)
                    r.seeds.setdefault(m, []).append(s)
        if r.curves:
            plot_curves(r.curves, k, figs / f"replication_k{k}.png")
        # relevance: direct replay of the warm start, and the dumps of the MRTPO runs
        cfg = compose(["experiment=toy_replication", f"task.num_constraints={k}"])
        task = instantiate(cfg.task)
        _, tok = load_policy(str(policy))
        direct = kdir / "relevance_sft.jsonl"
        if not direct.exists():
            recs = replay_records(
                policy, k, args.relevance_prompts, 4, 12345, float(cfg.method.beta)
            )
            direct.write_text("".join(json.dumps(x) + "\n" for x in recs))
        sft_recs = read_jsonl(direct)
        r.relevance_sft = relevance_stats(sft_recs, task, tok)
        rl_recs = []
        for s in range(args.seeds):
            for path in sorted((kdir / "mrtpo" / f"s{s}").rglob("relevance.jsonl")):
                rl_recs += read_jsonl(path)
        r.relevance_rl = relevance_stats(rl_recs, task, tok)
        rec = pick_record([x for x in rl_recs if x.get("step", 0) <= 5] or rl_recs or sft_recs)
        if rec is not None:
            plot_relevance(rec, figs / f"relevance_k{k}.png", figs / f"relevance_k{k}.html")
            r.picture = f"relevance_k{k}.png"
        results.append(r)
    return results


if __name__ == "__main__":
    sys.exit(main())
