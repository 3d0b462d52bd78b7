"""Sample tables and relevance dumps, written under the run folder every N steps."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
from rich.console import Console
from rich.table import Table

from mrtpo.safe_files import no_follow  # never append through a link planted in the folder

log = logging.getLogger(__name__)


def _run_dir(trainer) -> Path:
    # Not `trainer.log_dir`: under DDP it is a collective, and these callbacks write on rank 0
    # only, so the other ranks would never join it.
    d = Path(trainer.default_root_dir)
    d.mkdir(parents=True, exist_ok=True)
    return d


# ---- a resumed run's records ----------------------------------------------------------------

#: A record's step, read from the start of its line (both writers put "step" first).
_STEP = re.compile(rb'\{"step": (-?\d+)[,}]')


def _step_of(line: bytes) -> int | None:
    """The ``step`` of one JSONL record, or None for a line that is not a record with one."""
    m = _STEP.match(line)
    if m:
        return int(m.group(1))
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _keep(line: bytes, last: int) -> bytes | None:
    """``line`` as it stays (None: dropped): records after ``last`` and a last line a kill cut
    off go; other lines are not ours to judge and stay."""
    if not line.endswith(b"\n"):
        try:
            json.loads(line)
        except ValueError:
            return None
        line += b"\n"
    step = _step_of(line)
    return None if step is not None and step > last else line


def _open_records(path: Path) -> int | None:
    """``path`` opened for reading without following a link (None: there is no file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise ValueError(
            f"{path} is a symbolic link; the run keeps its own records there and writes "
            "through no link: remove the link (a copy of its file may take its place)"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(
            f"{path} is not a regular file: move it away, the run writes its records there"
        )
    return fd


def drop_records_after(path: str | Path, last: int) -> int:
    """On resume from step ``last``: drop from the JSONL ``path`` the later steps' records
    (the resumed run writes them again) and a last line a kill cut off; return how many went.
    The kept lines replace the file in one rename, only when something goes; a link is
    refused, neither read nor replaced."""
    path = Path(path)
    fd = _open_records(path)
    if fd is None:
        return 0
    with open(fd, "rb") as src:  # read twice, never whole: the file can hold gigabytes
        dropped, whole = 0, True
        for line in src:
            dropped += _keep(line, last) is None
            whole = line.endswith(b"\n")
        if not dropped and whole:
            return 0
        src.seek(0)
        out, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with open(out, "wb") as dst:
                dst.writelines(k for k in (_keep(line, last) for line in src) if k is not None)
                dst.flush()
                os.fchmod(dst.fileno(), stat.S_IMODE(os.fstat(src.fileno()).st_mode))
                os.fsync(dst.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return dropped


def _drop_rerun_records(trainer, pl_module, name: str) -> None:
    """In a run started from a checkpoint: drop the records of ``<run>/name`` that belong to
    steps after it (see ``drop_records_after``), on rank 0, which alone writes them."""
    if trainer.ckpt_path is None or not trainer.is_global_zero:
        return
    last = int(getattr(pl_module, "iteration", trainer.global_step))
    path = _run_dir(trainer) / name
    dropped = drop_records_after(path, last)
    if dropped:
        log.info(
            "resume: %d line(s) of %s after step %d (the stopped run's) dropped; those steps "
            "run again and write their own",
            dropped,
            path,
            last,
        )


def relevance_record(
    scored, j: int, q, w, replayed, names, tokenizer, step: int, beta: float
) -> dict:
    """One line of ``relevance.jsonl``: response ``j`` with each replayed reward's per-token
    relevance ``q`` and weight ``w`` (``[N, K, T]``; ``names`` label K, ``replayed [N, K]``).
    The one builder: the callback and the replication harness's direct replay both write it."""
    roll = scored.rollout
    t = int(roll.response_mask[j].sum())
    ids = roll.response_ids[j, :t].tolist()
    rows = [(k, n) for k, n in enumerate(names) if replayed[j, k]]
    return {
        "step": step,
        "id": roll.examples[j].id,
        "beta": beta,
        "prompt": roll.examples[j].messages[-1]["content"],
        "tokens": [tokenizer.decode([i]) for i in ids],
        "token_ids": ids,
        "rewards": scored.scores[j].rewards,
        "q": {n: torch.round(q[j, k, :t], decimals=5).tolist() for k, n in rows},
        "w": {n: torch.round(w[j, k, :t], decimals=5).tolist() for k, n in rows},
    }


def _one_line(text: str, width: int, middle: bool = False) -> str:
    """``text`` on one line (line breaks shown as ⏎), cut to ``width`` characters: at the
    end, or (``middle``) in the middle, keeping its start and its end (where a prompt's
    instructions often are)."""
    flat = " ⏎ ".join(part.strip() for part in str(text).splitlines() if part.strip())
    if len(flat) <= width:
        return flat
    if not middle:
        return flat[: width - 1] + "…"
    head = (width - 1) // 3
    return flat[:head] + "…" + flat[len(flat) - (width - 1 - head) :]


def sample_table(rows: list[dict], step: int, width: int = 100) -> Table:
    """Sampled responses with each reward (``-``: does not apply), one line each within
    ``width``; a prompt all of them answer goes in the title."""
    rewards = [
        " ".join(f"{k}={'-' if v is None else f'{v:.3g}'}" for k, v in r["rewards"].items())
        for r in rows
    ]
    prompts = [_one_line(r["prompt"], 10_000) for r in rows]
    shared = len(set(prompts)) == 1
    reward_w = min(max(len(x) for x in rewards), max(36, width // 3))  # longer: wrapped
    prompt_w = 0 if shared else 18
    response_w = max(10, width - prompt_w - reward_w - (7 if shared else 10))  # the borders
    title = f"samples at step {step}"
    if shared:
        title += ", prompt: " + _one_line(prompts[0], max(20, width - len(title) - 10), True)
    t = Table(title=title, title_justify="left", show_lines=False)
    if not shared:
        t.add_column("prompt", no_wrap=True, overflow="ellipsis", width=prompt_w)
    t.add_column("response", no_wrap=True, overflow="ellipsis", width=response_w)
    t.add_column("rewards", overflow="fold", width=reward_w)
    last = None
    for r, prompt, shown in zip(rows, prompts, rewards, strict=True):
        cells = [_one_line(r["response"], response_w), shown]
        if not shared:
            cells.insert(0, "" if prompt == last else _one_line(prompt, prompt_w, True))
        t.add_row(*cells)
        last = prompt
    return t


class SampleTable(L.Callback):
    """Every ``every`` steps from the first: ``num`` responses (prompt, response, rewards) to
    ``samples.jsonl``, and a compact table of them printed (``print_table``)."""

    def __init__(self, every: int = 10, num: int = 4, print_table: bool = True) -> None:
        self.every, self.num, self.print_table = every, num, print_table

    def on_train_start(self, trainer, pl_module) -> None:
        _drop_rerun_records(trainer, pl_module, "samples.jsonl")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        scored, step = pl_module.last, pl_module.iteration
        if scored is None or not trainer.is_global_zero or self.every <= 0:
            return
        if (step - 1) % self.every != 0:
            return
        roll = scored.rollout
        rows = [
            {
                "step": step,
                "id": roll.examples[i].id,
                "prompt": roll.examples[i].messages[-1]["content"],
                "response": roll.texts[i],
                "rewards": scored.scores[i].rewards,
                "reasons": scored.scores[i].reasons,
            }
            for i in range(min(self.num, roll.n))
        ]
        with open(
            _run_dir(trainer) / "samples.jsonl", "a", encoding="utf-8", opener=no_follow
        ) as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        if self.print_table and rows:
            # on stdout, between the step lines it belongs to
            console = Console(file=sys.stdout)
            console.print(sample_table(rows, step, width=console.width))
            sys.stdout.flush()


class RelevanceDump(L.Callback):
    """Every ``every`` steps: ``relevance.jsonl`` gets, for a few replayed responses, the
    response tokens with each reward's relevance q and weight w (input to the pictures)."""

    def __init__(self, every: int = 10, num: int = 4) -> None:
        self.every, self.num = every, num

    def on_train_start(self, trainer, pl_module) -> None:
        _drop_rerun_records(trainer, pl_module, "relevance.jsonl")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        scored = pl_module.last
        if scored is None or scored.q is None or not trainer.is_global_zero or self.every <= 0:
            return
        step = pl_module.iteration
        if (step - 1) % self.every != 0:
            return
        tok, beta = pl_module.tokenizer, scored.beta
        # the method's own weights (MRTPO's from JSD, CoRT's from log-likelihood contrasts),
        # or 1 on every token for a method without them: the step's record holds them
        w = scored.token_weights
        names = scored.reward_names if scored.q.shape[1] == len(scored.reward_names) else ("joint",)
        picked = scored.replayed.any(-1).nonzero().flatten().tolist()[: self.num]
        with open(
            _run_dir(trainer) / "relevance.jsonl", "a", encoding="utf-8", opener=no_follow
        ) as f:
            for j in picked:
                rec = relevance_record(
                    scored, j, scored.q, w, scored.replayed, names, tok, step=step, beta=beta
                )
                rec.update(pl_module.step.diagnostics.record_fields(scored, j))  # the viewer's
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
