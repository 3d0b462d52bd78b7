"""A console a person can read: a line per step with the time left (``StepLine``; a live bar
under them on a terminal, plain text in a log file or CI), and at the end the means of the
rewards and success over blocks of steps with a PNG of their curves (``RunSummary``).
"""

from __future__ import annotations

import logging
import math
import re
import sys
import time
import warnings
from pathlib import Path

import lightning as L

log = logging.getLogger(__name__)

# Metric keys shown on the step line, in order, with their short labels.
_LINE_KEYS = (
    ("train/reward/total/mean", "reward"),
    ("train/success", "success"),
    ("sft/loss", "loss"),
    ("train/loss", "loss"),
)


def _value(metrics, key) -> float | None:
    try:
        f = float(metrics.get(key))
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def quiet_libraries() -> None:
    """No Lightning tips or device banners (each printed twice), weight-loading bars or
    deprecation notes from inside Lightning; warnings and errors still show."""
    for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    for pattern in (
        r".*isinstance\(treespec, LeafSpec\).*",
        r"You have overridden `transfer_batch_to_device`",
        r"Total length of .* across ranks is zero",
        r"Experiment logs directory .* exists and is not empty",
        r"Checkpoint directory .* exists and is not empty",
        r"Using ModelCheckpoint with manual optimization",
    ):
        warnings.filterwarnings("ignore", message=pattern)


def header(cfg) -> str:
    """Two lines saying what runs and where, and how to continue it."""
    from omegaconf import OmegaConf

    def choice(group: str) -> str:
        try:
            from hydra.core.hydra_config import HydraConfig

            return str(HydraConfig.get().runtime.choices.get(group))
        except Exception:
            return "?"

    out = OmegaConf.select(cfg, "paths.output_dir", default="?")
    stage = OmegaConf.select(cfg, "stage.name", default="rl")
    saver = OmegaConf.select(cfg, "callbacks.model_checkpoint", default=None)
    if saver is None or OmegaConf.select(saver, "save_weights_only", default=False):
        why = "null" if saver is None else "saves weights only"
        hint = f"(no resumable checkpoint: callbacks.model_checkpoint {why})"
    else:
        from mrtpo.run.resume import resume_command

        hint = f"(continue it: {resume_command(out)})"
    return (
        f"{stage}: task={choice('task')} method={choice('method')} "
        f"model={OmegaConf.select(cfg, 'model.name_or_path')} seed={cfg.get('seed')}\n"
        f"run folder: {out}   {hint}"
    )


def duration(seconds: float) -> str:
    """``seconds`` as a person reads a wait: ``45s``, ``4m05s``, ``1h02m``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _sft_target(trainer):
    """The SFT stage's target callback (held-out checks, early stop), if the run has one."""
    return next((c for c in trainer.callbacks if type(c).__name__ == "SFTTarget"), None)


def _sft_parts(target, step: int) -> list[str]:
    """What the step line says of SFT's held-out checks: the last one, or when the first is."""
    if target is None or not getattr(target, "examples", None):
        return []
    sign = "≤" if target.below else "≥"
    goal = "" if target.target is None else f", stops at {sign} {target.target:g}"
    if not target.history:
        first = max(target.min_steps, target.every)
        first = -(-first // target.every) * target.every  # the first multiple of eval_every
        return [f"held-out {target.metric}: first check at step {first}{goal}"]
    last = target.history[-1]
    return [f"held-out {target.metric} {last[target.metric]:.3f} (step {int(last['step'])}{goal})"]


class StepLine(L.Callback):
    """A line per step (at most one each ``min_interval_s`` seconds, always the last): step,
    rewards or loss, s/step, time left, SFT's last held-out check. ``bar``: ``auto`` (a live
    bar when stdout is a terminal), ``true`` or ``false``."""

    def __init__(self, min_interval_s: float = 0.0, bar: bool | str = "auto") -> None:
        if bar not in (True, False, "auto"):
            raise ValueError(f"callbacks.progress.bar={bar!r} is not allowed: auto, true or false")
        self.min_interval_s = float(min_interval_s)
        self.bar = bar
        self._t_start, self._t_last, self._step0 = 0.0, -math.inf, 0
        self._live = None  # rich's Progress while a live bar runs
        self._handlers: list[tuple[logging.StreamHandler, object]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self._t_start = time.perf_counter()
        self._step0 = int(trainer.global_step)
        terminal = sys.stdout.isatty() if self.bar == "auto" else bool(self.bar)
        if terminal and trainer.is_global_zero and trainer.max_steps > 0:
            stage = "sft" if _sft_target(trainer) is not None else "rl"
            self._live = _live_bar(stage, self._step0, int(trainer.max_steps))
            self._handlers = _through(sys.stdout, sys.stderr)

    def line(self, trainer, step: int, now: float) -> dict[str, str]:
        """The step's line as ``head``, ``info``, ``rate`` and ``eta`` (``≤`` when SFT may stop
        at its target sooner)."""
        m = trainer.callback_metrics
        parts, shown = [], set()
        for key, label in _LINE_KEYS:
            v = _value(m, key)
            if v is not None and label not in shown:
                parts.append(f"{label} {v:.3f}")
                shown.add(label)
        target = _sft_target(trainer)
        parts += _sft_parts(target, step)
        per_step = (now - self._t_start) / max(1, step - self._step0)
        total = int(trainer.max_steps)
        eta = ""
        if total > 0:
            early = target is not None and target.target is not None
            eta = f"eta {'≤' if early else ''}{duration(max(0, total - step) * per_step)}"
        return {
            "head": f"step {step}/{total}" if total > 0 else f"step {step}",
            "info": "  ".join(parts),
            "rate": f"{per_step:.2f} s/step",
            "eta": eta,
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not trainer.is_global_zero:
            return
        now = time.perf_counter()
        step = int(trainer.global_step)
        parts = self.line(trainer, step, now)
        if self._live is not None:
            fields = {k: parts[k] for k in ("rate", "eta", "info")}
            self._live.update(self._live.task_ids[0], completed=step, **fields)
        last = trainer.max_steps > 0 and step >= trainer.max_steps
        if now - self._t_last < self.min_interval_s and not last:
            return
        self._t_last = now
        # head, info, rate, eta; with a live bar, rich's stdout puts it above the bar
        print("  ".join(p for p in parts.values() if p), flush=True)

    def _stop(self, *hook_args, **hook_kwargs) -> None:
        """Stop the live bar (at train end: before the summary table prints)."""
        if self._live is not None:
            self._live.stop()
            self._live = None
        for handler, stream in self._handlers:
            handler.setStream(stream)
        self._handlers = []

    on_train_end = on_exception = teardown = _stop


def _live_bar(stage: str, start: int, total: int):
    """rich's live progress bar at the bottom of a terminal, started; what is printed to
    stdout or stderr while it runs goes above it."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        *(TextColumn(f"{{task.fields[{k}]}}") for k in ("rate", "eta", "info")),
        console=Console(file=sys.stdout),
        redirect_stdout=True,
        redirect_stderr=True,
        refresh_per_second=4,
    )
    bar.add_task(stage, total=total, completed=start, rate="", eta="", info="")
    bar.start()
    return bar


def _through(out, err) -> list[tuple[logging.StreamHandler, object]]:
    """Point the root logger's console handlers at ``out`` / ``err`` (the live display's
    stand-ins for stdout and stderr); return each handler with the stream it had."""
    changed = []
    for h in logging.getLogger().handlers:
        if type(h) is logging.StreamHandler and h.stream in (sys.__stdout__, sys.__stderr__):
            changed.append((h, h.stream))
            h.setStream(out if h.stream is sys.__stdout__ else err)
    return changed


TOTAL = "reward/total"


def _natural(key: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def column_groups(head: list[str], body: list[list[str]], width: int) -> list[list[int]]:
    """Column indices split into tables that each fit ``width`` characters, each starting
    with the steps column, so no header or value is cut short."""

    def need(c: int) -> int:  # rich's box: a border and one space of padding each side
        return max([len(head[c]), *(len(r[c]) for r in body)]) + 3

    groups: list[list[int]] = []
    cur, used = [0], need(0) + 1
    for c in range(1, len(head)):
        if len(cur) > 1 and used + need(c) > width:
            groups.append(cur)
            cur, used = [0], need(0) + 1
        cur.append(c)
        used += need(c)
    groups.append(cur)
    return groups


class RunSummary(L.Callback):
    """Means of each reward (and success) over blocks of ``block`` steps, at the end."""

    def __init__(self, block: int = 5, plot: bool = True) -> None:
        self.block = max(1, int(block))
        self.plot = plot
        self.rows: list[dict[str, float]] = []
        self.steps: list[int] = []  # the RL step of each row (a resumed run starts past 1)
        self.labels: dict[str, str] = {}  # reward name -> what a person reads (the task's)

    def on_train_start(self, trainer, pl_module) -> None:
        # instruction following's slots c0..c12 read 'constraint 1' ...; keys stay c{k}
        self.labels = dict(getattr(getattr(pl_module, "task", None), "reward_labels", {}) or {})

    def shown(self, key: str) -> str:
        """A column's header or a curve's legend: ``reward/c0`` -> ``c0 (constraint 1)``: the
        key that metrics.csv, report.py and --metric use, with the task's label beside it."""
        if not key.startswith("reward/"):
            return key
        name = key.removeprefix("reward/")
        label = self.labels.get(name, name)
        return name if label == name else f"{name} ({label})"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        m = trainer.callback_metrics
        row = {}
        for k in m:
            if (k.startswith("train/reward/") and k.endswith("/mean")) or k == "train/success":
                v = _value(m, k)
                if v is not None:
                    row[k.removeprefix("train/").removesuffix("/mean")] = v
        if row:
            self.rows.append(row)
            self.steps.append(int(trainer.global_step))

    def table(self) -> tuple[list[str], list[list[str]]]:
        names = list(dict.fromkeys(k for r in self.rows for k in r))
        # success, total, then the rewards with numbers in order (c2 before c10)
        names.sort(key=lambda k: (k != "success", k != "reward/total", _natural(k)))
        body = []
        for a in range(0, len(self.rows), self.block):
            chunk = self.rows[a : a + self.block]
            steps = self.steps[a : a + len(chunk)]  # appended with the rows
            cells = [f"{steps[0]}-{steps[-1]}"]
            for k in names:
                vals = [r[k] for r in chunk if k in r]
                cells.append(f"{sum(vals) / len(vals):.3f}" if vals else "")
            body.append(cells)
        return ["steps", *names], body

    def on_train_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero or not self.rows:
            return
        from rich.console import Console
        from rich.table import Table

        head, body = self.table()
        shown = [self.shown(h) for h in head]
        console = Console()
        title = f"{type(pl_module).__name__}: means over blocks of {self.block} steps"
        for cols in column_groups(shown, body, console.width):
            t = Table(title=title)
            for c in cols:
                t.add_column(shown[c], justify="right", no_wrap=True)
            for row in body:
                t.add_row(*[row[c] for c in cols])
            console.print(t)
            title = None
        if "success" in head:
            first = [r["success"] for r in self.rows[: self.block] if "success" in r]
            last = [r["success"] for r in self.rows[-self.block :] if "success" in r]
            if first and last:
                print(
                    f"success: {sum(first) / len(first):.2f} over the first {len(first)} steps, "
                    f"{sum(last) / len(last):.2f} over the last {len(last)}",
                    flush=True,
                )
        if self.plot:
            try:
                self._plot(Path(trainer.default_root_dir) / "curves.png")
            except Exception as exc:  # a plot is a convenience, never a reason to fail a run
                log.warning("could not plot the reward curves: %s", exc)

    def _plot(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = sorted({k for r in self.rows for k in r} - {TOTAL})
        fig, ax = plt.subplots(figsize=(7, 4.6), layout="constrained")
        for k in names:
            xs = [x for x, r in zip(self.steps, self.rows, strict=True) if k in r]
            ax.plot(xs, [r[k] for r in self.rows if k in r], label=self.shown(k), lw=1.2)
        ax.set_xlabel("step")
        ax.set_ylabel("mean over the step's responses")
        if any(TOTAL in r for r in self.rows):  # 0..K: its own axis, not the rewards' 0..1
            right = ax.twinx()
            xs = [x for x, r in zip(self.steps, self.rows, strict=True) if TOTAL in r]
            right.plot(xs, [r[TOTAL] for r in self.rows if TOTAL in r], "k--", lw=1.0,
                       label="total (right axis)")  # fmt: skip
            right.set_ylabel("summed reward (total)")
        # one legend for both axes, below the plot: inside it, the right axis' curve was
        # drawn over the left axis' legend, and two legends overlapped each other
        handles = [h for a in fig.axes for h in a.get_legend_handles_labels()[0]]
        fig.legend(handles=handles, fontsize=7, loc="outside lower center",
                   ncol=min(len(handles), 5), frameon=False)  # fmt: skip
        ax.grid(alpha=0.3)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
