"""Training jobs (composed Hydra configs) run in a pool of worker processes.

Each job is a list of overrides of ``configs/train.yaml`` and a folder. A job that finished
without error left ``job.json`` there and is not run again, so an interrupted harness resumes
where it stopped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import traceback
import warnings
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import muted_libraries
from mrtpo.run.config import compose


@dataclass
class Job:
    key: str  # e.g. "k4/sft", "k4/mrtpo/s0"
    overrides: list[str]
    out: Path
    steps: int  # expected steps (for the progress bar; SFT: the upper bound)
    #: keys of jobs (in the same ``run_all`` call, or finished before it) that must have
    #: finished without error before this one starts
    after: tuple[str, ...] = ()


_MUTED = ("lightning", "pytorch_lightning", "lightning_fabric", "mrtpo")


def quiet() -> None:
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
        if name.split(".")[0] in _MUTED:
            logging.getLogger(name).setLevel(logging.ERROR)
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "mrtpo"):
        logging.getLogger(name).setLevel(logging.ERROR)


@contextlib.contextmanager
def quieted():
    """``quiet()`` for the length of a ``with`` block: a replication's main also runs inside a
    test process, whose later tests read the mrtpo log and the warnings."""
    import transformers

    hf = transformers.utils.logging
    verbosity, bars = hf.get_verbosity(), hf.is_progress_bar_enabled()
    names = [n for n in logging.root.manager.loggerDict if n.split(".")[0] in _MUTED]
    with muted_libraries(sorted(set(names) | set(_MUTED))):
        quiet()
        try:
            yield
        finally:
            hf.set_verbosity(verbosity)
            if bars:
                hf.enable_progress_bar()


def run_folder(logdir: Path | None, report_only: bool, default: Path, what: str) -> Path:
    """The run folder a harness writes to (``default`` when none is given), resolved; a report
    of an earlier run must name its folder (``what`` says which kind of run folder)."""
    if logdir is None:
        if report_only:
            raise ValueError(f"report_only needs the log folder of {what} (--logdir)")
        logdir = default
    return Path(logdir).resolve()


def _worker_init(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    quiet()


def _reporter(queue, key: str):
    import lightning as L

    class Reporter(L.Callback):
        """Sends (job, step, success) to the parent for its progress display."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            m = trainer.callback_metrics
            val = m.get("train/success", m.get("val_success"))
            queue.put((key, int(trainer.global_step), None if val is None else float(val)))

    return Reporter()


def recorded_csv(csv: Path, job_dir: Path) -> Path:
    """The metrics file a job record (``job.json``, written by ``run_job``) names, also when
    the run folder was moved or copied since: the record holds the absolute path it was
    written at, so the same path's tail is looked for below the job's own folder."""
    if csv.exists():
        return csv
    for depth in range(1, len(csv.parts)):
        candidate = job_dir.joinpath(*csv.parts[-depth:])
        if candidate.exists():
            return candidate
    return csv


def run_job(job: Job, queue=None) -> dict[str, Any]:
    """Train one composed config (in a worker process); return where its results are."""
    from mrtpo.lightning.pipeline import build, metrics_csv

    t0 = time.perf_counter()
    try:
        cfg = compose("train.yaml", job.overrides)
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


def _blocked(job: Job, results: dict[str, dict]) -> str | None:
    """Why ``job`` can never run here (a job it waits for failed), or None."""
    failed = [k for k in job.after if k in results and results[k].get("error")]
    return f"not run: {', '.join(failed)} failed" if failed else None


def _unfinished(jobs: list[Job]) -> tuple[dict[str, dict], list[Job]]:
    """The results of jobs finished before (their ``job.json``) and the jobs left to run, in
    order; refused when a job waits for a job not given or the jobs wait for each other."""
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
    keys = {j.key for j in jobs}
    unknown = sorted({k for j in todo for k in j.after if k not in keys})
    if unknown:
        raise ValueError(f"jobs wait for jobs not given to run_all: {', '.join(unknown)}")
    can, left = set(results), list(todo)  # every job can start once the others succeed
    while left:
        ready = [j for j in left if all(k in can for k in j.after)]
        if not ready:
            raise ValueError(f"jobs wait for each other: {', '.join(j.key for j in left)}")
        can |= {j.key for j in ready}
        left = [j for j in left if j not in ready]
    return results, todo


@dataclass
class _Pool:
    """One ``run_all`` call's state: the pool, its progress display and what is where."""

    pool: Any
    progress: Any
    console: Any
    queue: Any
    workers: int
    todo: list[Job]
    results: dict[str, dict]
    overall: int = 0
    bars: dict[str, int] = field(default_factory=dict)
    pending: dict[Future, Job] = field(default_factory=dict)

    def fill(self, waiting: list[Job]) -> None:
        """Drop what can never run, then give the free workers the first jobs that can."""
        for job in list(waiting):
            why = _blocked(job, self.results)
            if why is not None:
                waiting.remove(job)
                self.results[job.key] = {"key": job.key, "csv": None, "error": why}
                self.progress.advance(self.overall)
                self.console.print(f"[red]{job.key} {why}")
        for job in list(waiting):
            if len(self.pending) >= self.workers:
                break
            if all(k in self.results and not self.results[k].get("error") for k in job.after):
                waiting.remove(job)
                self.pending[self.pool.submit(run_job, job, self.queue)] = job

    def show_steps(self) -> None:
        while not self.queue.empty():
            key, step, succ = self.queue.get_nowait()
            if key not in self.bars:
                steps = next(j.steps for j in self.todo if j.key == key)
                self.bars[key] = self.progress.add_task(f"  {key}", total=steps, info="")
            info = "" if succ is None else f"success {succ:.2f}"
            self.progress.update(self.bars[key], completed=step, info=info)

    def collect(self, done) -> None:
        for fut in done:
            job = self.pending.pop(fut)
            res = fut.result()
            self.results[job.key] = res
            if job.key in self.bars:
                self.progress.remove_task(self.bars[job.key])
            self.progress.advance(self.overall)
            if res.get("error"):
                self.console.print(f"[red]{job.key} failed:[/red] {res['error'].splitlines()[0]}")
                self.console.print(res["error"][-2000:], markup=False)


def run_all(jobs: list[Job], workers: int, threads: int, console, title: str) -> dict[str, dict]:
    """Run jobs on a process pool with a rich progress display; skip finished ones.

    ``jobs`` is in order of priority: a free worker takes the first job whose ``after`` jobs
    have finished, so a long chain of dependent jobs listed first is never queued behind
    independent ones. A job whose ``after`` job failed is not run (its result says which, and
    no ``job.json`` is written, so a rerun tries it again).

    Workers are fresh interpreters ("spawn": no forked torch or tokenizer state) with
    ``threads`` torch threads each; they start with this process's ``sys.path``, so they import
    this module from ``scripts/`` as it was imported here.
    """
    import multiprocessing as mp

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    results, todo = _unfinished(jobs)
    if not todo:
        return results
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
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
        run = _Pool(pool, progress, console, manager.Queue(), workers, todo, results)
        run.overall = progress.add_task(f"[bold]{title}", total=len(todo), info="")
        waiting = list(todo)
        while waiting or run.pending:
            run.fill(waiting)
            if not run.pending:  # what is left waits for a job that failed: dropped next pass
                continue
            done, _ = wait(list(run.pending), timeout=0.5, return_when=FIRST_COMPLETED)
            run.show_steps()
            run.collect(done)
    manager.shutdown()
    return results
