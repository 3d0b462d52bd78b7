"""Reading what training runs wrote: Lightning's ``metrics.csv`` and the JSON-lines dumps."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import re
import subprocess
from pathlib import Path

from mrtpo.safe_files import UnsafePath, kind, refusal, write_atomic

#: the project root of a source checkout (src/mrtpo/evaluate/analysis/runs.py -> <root>)
ROOT = Path(__file__).resolve().parents[4]


def source_commit(root: Path = ROOT) -> str:
    """Short hash of HEAD, ``+dirty`` when ``configs/``, ``src/`` or ``scripts/`` have changes
    (untracked files too): what a reader needs to rerun the same code."""
    try:

        def git(*a: str) -> str:
            return subprocess.run(
                ["git", *a], cwd=root, capture_output=True, text=True, check=True, timeout=30
            ).stdout.strip()

        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "configs", "src", "scripts")
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return head + ("+dirty" if dirty else "")


def read_metrics(path: str | Path, warnings: list[str] | None = None) -> list[dict[str, float]]:
    """Rows of a Lightning metrics.csv, numbers only (empty cells dropped: Lightning writes one row
    per logging call, so most cells of a row are empty). A malformed file is read as far as it makes
    sense: a column with a cell that is no number (text, a cell of megabytes) is left out whole, and
    a row with more cells than the header (whose cells cannot be told apart) is left out; each is
    named in one line appended to ``warnings``. A file the csv module cannot parse raises
    ``ValueError`` naming it."""
    path = Path(path)
    try:
        with (
            _field_limit(path.stat().st_size),
            open(path, newline="", encoding="utf-8", errors="replace") as f,
        ):
            reader = csv.reader(f)
            head = next(reader, [])
            lines = [(reader.line_num, cells) for cells in reader]
    except csv.Error as exc:
        raise ValueError(f"{path}: not a CSV table ({exc})") from None
    cut = _cut_last_line(path, head, lines)
    rows, bad, long = _numbers(head, lines)
    if warnings is not None:
        if cut:
            warnings.append(f"{path}: line {cut} is incomplete (a killed writer?); left out")
        warnings += [f"{path}: column {_quoted(head[i])} holds a cell that is no number "
                     f"(line {n}: {what}); the column is left out" for i, (n, what) in bad.items()]  # fmt: skip
        if long:
            more = f" (and {len(long) - 3} more rows)" if len(long) > 3 else ""
            warnings.append(
                f"{path}: line {long[0][0]} has {long[0][1]} cells for the header's {len(head)} "
                f"columns{more}; {'the row is' if len(long) == 1 else 'these rows are'} left out"
            )
    return rows


def _numbers(
    head: list[str], lines: list[tuple[int, list[str]]]
) -> tuple[list[dict[str, float]], dict[int, tuple[int, str]], list[tuple[int, int]]]:
    """(rows of numbers, {bad column: (its first bad line, that cell described)}, [(line,
    cells) of each row longer than ``head``]); the bad columns are already left out."""
    rows: list[dict[str, float]] = []
    bad: dict[int, tuple[int, str]] = {}
    long: list[tuple[int, int]] = []
    for n, cells in lines:
        if len(cells) > len(head):
            long.append((n, len(cells)))
            continue
        row = {}
        for i, v in enumerate(cells):
            if v == "" or i in bad:
                continue
            try:
                row[head[i]] = float(v)
            except ValueError:
                bad[i] = (n, f"{len(v):,} characters" if len(v) > 40 else repr(v))
        rows.append(row)
    gone = {head[i] for i in bad} - {h for i, h in enumerate(head) if i not in bad}
    return [{k: v for k, v in r.items() if k not in gone} for r in rows], bad, long


def _cut_last_line(path: Path, head: list[str], lines: list[tuple[int, list[str]]]) -> int:
    """Take the last line off ``lines`` when a killed writer cut it (no line end, a cell that
    is no number), so that it costs its row and not a column; its line number, else 0."""
    if not lines:
        return 0
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        ended = f.read(1) in (b"\n", b"\r")
    n, cells = lines[-1]
    if ended or all(_is_float(v) for v in cells[: len(head)] if v != ""):
        return 0
    lines.pop()
    return n


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _quoted(name: str, most: int = 80) -> str:
    """A column name on one line (``repr``), cut to about ``most`` characters."""
    text = repr(name)
    return text if len(text) <= most else f"{text[: most - 12]}...' ({len(name):,} characters)"


@contextlib.contextmanager
def _field_limit(size: int):
    """csv's cell size limit raised to ``size`` (a file's size bounds its cells) while a file
    is read, then put back: a cell past the default 131,072 characters is an error there."""
    old = csv.field_size_limit()
    csv.field_size_limit(max(old, min(size + 1, 2**31 - 1)))
    try:
        yield
    finally:
        csv.field_size_limit(old)


#: A row of an RL step: every task logs the summed reward; ``train/success`` only a task with
#: a success check (synthetic, a custom task with ``task.success``).
STEP_KEYS = ("train/success", "train/reward/total/mean")


def _step_rows(path: str | Path, warnings: list[str] | None = None) -> list[dict[str, float]]:
    rows = [r for r in read_metrics(path, warnings) if any(k in r for k in STEP_KEYS)]
    rows.sort(key=lambda r: r["step"])
    return rows


def rl_curves(path: str | Path, warnings: list[str] | None = None) -> dict[str, list[float]]:
    """Per-step series of an RL run: ``success``, each reward's mean by name, and each extra
    metric as ``extra/<reward>/<name>`` (NaN at a step without it); what was left out goes to
    ``warnings``."""
    rows = _step_rows(path, warnings)
    out: dict[str, list[float]] = {}
    if any("train/success" in r for r in rows):
        out["success"] = [r.get("train/success", math.nan) for r in rows]
    for k in rows[0] if rows else {}:
        m = re.fullmatch(r"train/reward/(.+)/mean", k)
        if m and m.group(1) != "total":
            out[m.group(1)] = [r.get(k, math.nan) for r in rows]
    extras = dict.fromkeys(k for r in rows for k in r if k.startswith("train/extra/"))
    for k in extras:
        out[k.removeprefix("train/")] = [r.get(k, math.nan) for r in rows]
    return out


def read_jsonl(path: str | Path) -> list[dict]:
    """Records of a JSON-lines file ([] if absent; a leading BOM skipped). Lines end at ``\n``
    only: the trainer writes text as it is (``ensure_ascii=False``), so a prompt may hold U+2028
    or U+0085, which ``str.splitlines`` would take for line ends."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8-sig")
    return [json.loads(line) for line in text.split("\n") if line.strip()]


class UnsafeOutput(UnsafePath):
    """An output path holds a link, folder, FIFO or device: nothing was written there."""


def check_output(path: str | Path) -> None:
    """Raise ``UnsafeOutput`` (naming it) when something other than a regular file stands at
    ``path``: a link (which may point to a user's file), a folder, a FIFO, a device."""
    what = kind(path)
    if what is not None:
        raise UnsafeOutput(f"{refusal(path, what)}, or write elsewhere (--out)")


def write_file(path: str | Path, data: bytes | str) -> Path:
    """Write ``path`` whole (``safe_files.write_atomic``: a reader never sees half a file, and a
    link put there after the check is replaced, never followed). ``UnsafeOutput`` for what
    ``check_output`` refuses; a failed write raises an ``OSError`` naming ``path``."""
    check_output(path)
    try:
        write_atomic(path, data)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
    return Path(path)


#: Per-step replay metrics of a run, by the name ``run_series`` gives them.
REPLAY_KEYS = {
    "train/replay/share": "replay/share",  # share of candidate (response, reward) pairs replayed
    "train/time/replay_share": "time/replay_share",  # share of the step's time spent replaying
}


def run_series(path: str | Path, warnings: list[str] | None = None) -> dict[str, list[float]]:
    """``rl_curves`` plus what replay cost and found, per step: ``replay/share``,
    ``time/replay_share`` and ``replay/top80/<reward>`` (share of a response's tokens holding
    80% of that reward's relevance). NaN where a step did not log it (GDPO never replays)."""
    rows = _step_rows(path)
    out = rl_curves(path, warnings)
    keys = {k for r in rows for k in r}
    for col, name in REPLAY_KEYS.items():
        if col in keys:
            out[name] = [r.get(col, math.nan) for r in rows]
    for col in sorted(keys):
        m = re.fullmatch(r"train/replay/top80_token_share/(.+)", col)
        if m:
            out[f"replay/top80/{m.group(1)}"] = [r.get(col, math.nan) for r in rows]
    return out
