"""The paper's tables: every benchmark of a task family, for several runs, in one command.

``src/table.py <family> <folder>...`` (README: families, refusals, what a cell reads) runs
``mrtpo.evaluate.job.run`` per folder and split (a policy is loaded once for all its splits;
engines seed each call, so the numbers equal separate ``src/eval.py`` runs) and writes
``table.md``/``table.csv``. A run folder is evaluated from ``checkpoints/last.ckpt`` with the
family's task config (so a smoke run's ``task.max_examples`` does not shrink the benchmark),
else its ``policy/``; its method is its overrides minus the seed (as ``src/report.py``).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mrtpo.evaluate.analysis.jobs import find_runs, labels, load_run
from mrtpo.evaluate.analysis.runs import UnsafeOutput, check_output, write_file
from mrtpo.evaluate.analysis.stats import mean_ci
from mrtpo.evaluate.analysis.summary import MARKDOWN, fmt_ci, markdown_table

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bench:
    """One column of a table: a split of the family's task and the metric the paper shows."""

    column: str
    split: str
    metric: str
    overrides: tuple[str, ...] = ()
    needs: str | None = None  # an eval key that must be set (AdvancedIF's judge)


_CATS = "eval.categories="
_NON_LIVE = "[simple_python,simple_java,simple_javascript,multiple,parallel,parallel_multiple]"
_LIVE = "[live_simple,live_multiple,live_parallel,live_parallel_multiple]"
_IF5 = ("eval.n_samples=5",)

#: family (also the task config it evaluates) -> its benchmarks in the paper's column order
FAMILIES: dict[str, tuple[Bench, ...]] = {
    "text2sql": (
        Bench("Spider dev", "spider_dev", "exec_acc"),
        Bench("Spider test", "spider_test", "exec_acc"),
        Bench("Spider-Syn", "spider_syn_dev", "exec_acc"),
        Bench("Spider-Realistic", "spider_realistic", "exec_acc"),
        Bench("Spider-DK", "spider_dk", "exec_acc"),
        Bench("BIRD dev", "bird_dev", "exec_acc"),
    ),
    "ifeval": (
        Bench("IFEval", "ifeval", "prompt_level_strict_acc", _IF5),
        Bench("IFBench", "ifbench", "prompt_level_strict_acc", _IF5),
        Bench("MulDimIF", "muldimif", "muldimif_overall", _IF5),
        Bench("AdvancedIF", "advancedif", "prompt_level_strict_acc", (), "judge_url"),
    ),
    "toolcall": (
        Bench("BFCL Non-Live", "bfcl", "bfcl/non_live/summary_ast", (_CATS + _NON_LIVE,)),
        Bench("BFCL Live", "bfcl", "bfcl/live/summary_ast", (_CATS + _LIVE,)),
    ),
}
#: other names a researcher may type for a family
ALIASES = {"instructions": "ifeval", "if": "ifeval", "sql": "text2sql", "tools": "toolcall"}


@dataclass
class Source:
    """One folder to evaluate: how eval gets its weights, and its method and seed."""

    path: Path
    overrides: list[str]
    method: tuple[str, ...]
    seed: str


@dataclass
class Cell:
    value: float | None = None
    status: str = "ok"  # ok | absent | failed | skipped
    reason: str = ""
    output: str = ""
    examples: int | None = None  # prompts scored (eval.limit's first ones, or all)
    split_examples: int | None = None  # prompts in the whole split

    @property
    def partial(self) -> bool:
        """Fewer prompts scored than the split holds (``eval.limit``)."""
        n, of = self.examples, self.split_examples
        return None not in (n, of) and n < of


@dataclass
class Table:
    family: str
    benches: tuple[Bench, ...]
    sources: list[Source]
    cells: dict[tuple[int, int], Cell] = field(default_factory=dict)  # (source, bench)


def family_of(name: str) -> str:
    key = ALIASES.get(name, name)
    if key not in FAMILIES:
        raise SystemExit(f"error: unknown task family {name!r}; choose one of {sorted(FAMILIES)}")
    return key


def _quoted(path: Path) -> str:
    """A path as a Hydra override value: a sweep's run folders hold ``=`` and ``,``."""
    return "'" + str(path).replace("\\", "\\\\").replace("'", "\\'") + "'"


def _source(folder: Path) -> Source:
    """How to evaluate ``folder`` (a training run or a policy folder), and its method/seed."""
    ckpt = folder / "checkpoints" / "last.ckpt"
    has_run = (folder / ".hydra" / "config.yaml").is_file()
    if has_run and ckpt.is_file():
        overrides = [f"ckpt_path={_quoted(ckpt)}"]
    elif has_run and (folder / "policy" / "config.json").is_file():
        overrides = ["ckpt_path=null", f"model.name_or_path={_quoted(folder / 'policy')}"]
    elif (folder / "config.json").is_file():
        return Source(
            folder, [f"model.name_or_path={_quoted(folder)}"], (f"policy={folder.name}",), "-"
        )
    else:
        raise SystemExit(
            f"error: {folder}: neither a training run (checkpoints/last.ckpt or policy/) nor a "
            "policy folder (config.json)"
        )
    run = load_run(folder)
    return Source(folder, overrides, run.group, run.seed or "-")


def sources_of(folders: list[str]) -> list[Source]:
    """Each given folder; a sweep folder stands for the runs in it."""
    out: list[Source] = []
    for f in folders:
        path = Path(f)  # main checked that it exists
        if (path / "config.json").is_file() or (path / ".hydra").is_dir():
            out.append(_source(path.resolve()))
            continue
        runs = [r for r in find_runs([path]) if (r.path / ".hydra" / "config.yaml").is_file()]
        if not runs:
            raise SystemExit(f"error: {f}: holds no training run and is no policy folder")
        out.extend(_source(r.path) for r in runs)
    return out


def _one_line(exc: BaseException) -> str:
    """The first sentence of the error (a missing file's message names the file first)."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return lines[0].split(". ")[0][:300]


def evaluate_cell(
    task: str, bench: Bench, src: Source, out: Path, extra: list[str], models: dict | None = None
) -> Cell:
    """One split of one folder via ``job.run``; ``models`` keeps its policy for the next."""
    from mrtpo.evaluate.job import SplitDataMissing, run
    from mrtpo.run.config import compose

    overrides = [f"task={task}", *src.overrides, f"eval.split={bench.split}", *bench.overrides]
    overrides += [f"eval.output={_quoted(out)}", *extra]
    try:
        cfg = compose("eval.yaml", overrides)
        if bench.needs and not cfg.eval.get(bench.needs):
            return Cell(status="skipped", reason=f"needs eval.{bench.needs}")
        metrics = run(cfg, overrides=overrides, models=models)
    except SplitDataMissing as exc:
        return Cell(status="absent", reason=_one_line(exc))
    except Exception as exc:  # one split's failure leaves the others scored
        log.exception("%s on %s failed", src.path, bench.split)
        return Cell(status="failed", reason=_one_line(exc))
    value = metrics.get(bench.metric)
    if value is None:
        return Cell(status="failed", reason=f"eval wrote no {bench.metric}", output=str(out))
    scored = _scored(out)
    return Cell(value=float(value), output=str(out), examples=scored.get("examples"),
                split_examples=scored.get("split_examples"))  # fmt: skip


def _scored(out: Path) -> dict[str, Any]:
    """What the evaluation job recorded it scored (``metrics.json``'s ``scored``)."""
    try:
        scored = json.loads((out / "metrics.json").read_text(encoding="utf-8")).get("scored")
    except (OSError, ValueError, AttributeError):
        return {}
    return {k: v for k, v in (scored or {}).items() if isinstance(v, int) or k == "split"}


def counted(cells: list[Cell]) -> str:
    """`` (k/N)`` of a cell: prompts scored of the split's, for its seeds (``k1-k2`` when they
    differ), with ``*`` when that is less than the whole split (``eval.limit``)."""
    got = sorted({c.examples for c in cells if c.examples is not None})
    of = sorted({c.split_examples for c in cells if c.split_examples is not None})
    if not got or not of:
        return ""
    k = str(got[0]) if len(got) == 1 else f"{got[0]}-{got[-1]}"
    n = str(of[0]) if len(of) == 1 else f"{of[0]}-{of[-1]}"
    return f" ({k}/{n}{'*' if any(c.partial for c in cells) else ''})"


def build(family: str, folders: list[str], out: Path, extra: list[str]) -> Table:
    """Every folder on every benchmark of ``family`` (a folder's policy loaded once, then let
    go); results under ``out``."""
    from mrtpo.run.trained_run import check_sources

    task, benches = family, FAMILIES[family]
    table = Table(family, benches, sources_of(folders))
    check_sources(family, task, table.sources)  # the family's task, one model a row
    absent: dict[int, Cell] = {}  # benchmark -> why it has no data (the same for every folder)
    for i, src in enumerate(table.sources):
        models: dict = {}
        for j, bench in enumerate(benches):
            if j in absent:
                table.cells[i, j] = absent[j]
                continue
            slug = "".join(c if c.isalnum() else "_" for c in bench.column.lower()).strip("_")
            dest = out / "evals" / f"{i:02d}_{src.path.name}" / slug
            cell = evaluate_cell(task, bench, src, dest, extra, models)
            table.cells[i, j] = cell
            if cell.status in ("absent", "skipped"):
                absent[j] = cell
        log.info("%s: %d policy load(s) for %d benchmarks", src.path, len(models), len(benches))
        models.clear()  # one folder's policy in memory at a time
    return table


# ---- the table ------------------------------------------------------------------------------


def rows(table: Table) -> tuple[list[str], list[list[str]], list[dict[str, Any]]]:
    """Markdown head and rows, and the CSV records (one per method and benchmark)."""
    groups: dict[tuple[str, ...], list[int]] = {}  # method -> its folders
    for i, src in enumerate(table.sources):
        groups.setdefault(src.method, []).append(i)
    names, _ = labels(list(groups))
    if len(groups) == 1:  # one method: name it by what it is, not by what differs
        names = {k: " ".join(k) or "(defaults)" for k in groups}
    scored = [
        j
        for j in range(len(table.benches))
        if any(table.cells[i, j].status == "ok" for i in range(len(table.sources)))
    ]
    head = ["method", "seeds", *[table.benches[j].column for j in scored], "average"]
    md, recs = [], []
    for key, members in groups.items():
        line = [names[key], ", ".join(table.sources[i].seed for i in members)]
        for j in [*scored, None]:
            if j is None:  # average: each run's mean over the scored benchmarks
                vals = [[table.cells[i, jj].value for jj in scored] for i in members]
                vals = [sum(v) / len(v) if v and None not in v else None for v in vals]
                column, metric = "average", "mean of the columns"
                cells = [table.cells[i, jj] for i in members for jj in scored]
            else:
                vals = [table.cells[i, j].value for i in members]
                column, metric = table.benches[j].column, table.benches[j].metric
                cells = [table.cells[i, j] for i in members]
            iv = mean_ci(vals)
            line.append(fmt_ci(iv) + (counted(cells) if j is not None else ""))
            recs.append({"method": names[key], "benchmark": column, "metric": metric,
                         "mean": iv.mean, "ci95_half": iv.half, "n": iv.n,
                         "values": json.dumps(vals),
                         "examples": json.dumps([c.examples for c in cells]),
                         "split_examples": json.dumps([c.split_examples for c in cells]),
                         "partial": any(c.partial for c in cells)})  # fmt: skip
        md.append(line)
    return head, md, recs


def not_scored(table: Table) -> list[str]:
    """One line per benchmark (and folder) that has no number, with the reason."""
    lines: dict[tuple, str] = {}  # an absent or skipped benchmark once, a failure per folder
    for (i, j), cell in sorted(table.cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        shared = cell.status in ("absent", "skipped")
        who, bench = "" if shared else f" for {table.sources[i].path}", table.benches[j]
        if cell.status != "ok":
            line = f"{bench.column} ({bench.split}): {cell.status}{who}: {cell.reason}"
            lines.setdefault((j, cell.reason) if shared else (j, i), line)
    return list(lines.values())


def write(table: Table, out: Path) -> tuple[Path, Path]:
    """``table.md`` (``templates/table.md.j2``) and ``table.csv`` under ``out``."""
    head, md_rows, recs = rows(table)
    partial = [c.examples for c in table.cells.values() if c.status == "ok" and c.partial]
    text = MARKDOWN.get_template("table.md.j2").render(
        family=table.family, table=markdown_table(head, md_rows), sources=table.sources,
        metrics=", ".join(f"{b.column} = {b.metric}" for b in table.benches),
        least=min(partial, default=None), missing=not_scored(table),
    )  # fmt: skip
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(recs[0]))  # every method has an average
    writer.writeheader()
    writer.writerows(recs)
    md, path_csv = outputs(out)
    for p in (md, path_csv):
        check_output(p)  # both refused before either is written
    out.mkdir(parents=True, exist_ok=True)
    write_file(md, text)
    write_file(path_csv, buf.getvalue())
    return md, path_csv


def outputs(out: Path) -> tuple[Path, Path]:
    """The files ``write`` makes in ``out``."""
    return out / "table.md", out / "table.csv"


def scored_summary(table: Table) -> str | None:
    """None when some cell has a number; else the error line that says so, counting why."""
    status = [c.status for c in table.cells.values()]
    if "ok" in status:
        return None
    counts = ", ".join(f"{status.count(s)} {s}" for s in ("failed", "absent", "skipped"))
    return f"no benchmark was scored ({counts} of {len(status)} cells)"


# ---- command line ---------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="src/table.py",
        description="Evaluate run or policy folders on every benchmark of a task family and "
        "write the paper's table (methods x benchmarks, mean over seeds ± 95% CI) as "
        "table.md and table.csv.",
    )
    p.add_argument("family", help=f"task family: {', '.join(FAMILIES)}")
    p.add_argument(
        "folders", nargs="+", help="training run folders, sweep folders or policy folders"
    )
    p.add_argument("--out", default=None, help="output folder (default: tables/<family>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="an eval.py override for every split (e.g. eval.limit=50, rollout=vllm, "
                   "eval.judge_url=...); repeat for several")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    family = family_of(args.family)
    for f in args.folders:  # before anything heavy loads
        if not Path(f).exists():
            raise SystemExit(f"error: {f}: no such folder (give run, sweep or policy folders)")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise SystemExit(f"error: --set {bad[0]!r} is not KEY=VALUE")
    out = Path(args.out or Path("tables") / family)
    try:
        for p in outputs(out):  # before an hour of evaluation, not after
            check_output(p)
    except UnsafeOutput as exc:
        raise SystemExit(f"error: {exc}") from None
    table = build(family, args.folders, out, list(args.overrides))
    try:
        md, path_csv = write(table, out)
    except UnsafeOutput as exc:
        raise SystemExit(f"error: {exc}") from None
    except OSError as exc:
        raise SystemExit(f"error: cannot write {exc.filename}: {exc.strerror}; give --out "
                         "<a writable folder>") from None  # fmt: skip
    print(md.read_text(encoding="utf-8"))
    print(f"wrote {md} and {path_csv}")
    nothing = scored_summary(table)
    if nothing:  # the files list why; the exit status must say it too
        print(f"error: {nothing}: see 'Not scored' in {md}")
        return 1
    return 0
