"""A run's per-token relevance as an HTML page and a PNG (``python src/relevance.py <run>``).

``relevance.jsonl`` (``mrtpo.lightning.callbacks.samples.RelevanceDump``) holds, for a few
responses every N steps, each replayed reward's relevance ``q`` (Jensen–Shannon distance, in
[0, 1]) per token and the token weight ``w`` derived from it. Every token is shaded on one
scale for the whole page so shades compare across rewards, responses and steps: q from 0 to
the page's largest, w on a log scale around 1 (GDPO's even share) in two hues. Responses and
the page get the credit diagnostics the trainer logs (``mrtpo.step.diagnostics``). Markup is
``templates/relevance.html.j2`` (Jinja2, autoescaped: no text from the file becomes markup).
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import functools
import io
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mrtpo.evaluate.analysis.jobs import kind_of
from mrtpo.evaluate.analysis.runs import UnsafeOutput, _step_rows, check_output, write_file
from mrtpo.evaluate.analysis.summary import MARKDOWN

FILE = "relevance.jsonl"
#: a longer line is left out unread (a record of 8,192 tokens and 13 rewards takes ~3 MB)
MAX_LINE = 16 << 20
#: a longer prompt is cut on the page
MAX_PROMPT = 20_000
Q_CMAP, W_CMAP = "YlOrRd", "PRGn"
#: the w scale spans at most 2^-W_OCTAVES .. 2^W_OCTAVES (larger weights get the end colour)
W_OCTAVES = 4.0


# ---- reading ------------------------------------------------------------------------------------
def find_file(source: str | Path) -> Path:
    """``relevance.jsonl`` of a run folder, or the file itself; a clear error otherwise."""
    path = Path(source)
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such run folder or file")
    if (path / FILE).is_file():
        return path / FILE
    below = sorted(path.rglob(FILE))
    if below:
        listed = "\n  ".join(str(p.parent) for p in below[:10])
        more = f"\n  ... and {len(below) - 10} more" if len(below) > 10 else ""
        raise FileNotFoundError(
            f"{path} holds no {FILE} itself, but {len(below)} run folder(s) below it do; give "
            f"one of them:\n  {listed}{more}"
        )
    raise FileNotFoundError(f"{path} has no {FILE}: {why_no_records(path)}")


def why_no_records(run: Path) -> str:
    """Why a run folder holds no relevance records (from its config and metrics), with the key
    to change."""
    generic = (
        "a run writes it when its method replays (MRTPO and its variants, CoRT) and "
        "callbacks.relevance_dump is on (configs/callbacks/default.yaml)"
    )
    try:
        cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
        target = str(OmegaConf.select(cfg, "method._target_"))
        dump = OmegaConf.select(cfg, "callbacks.relevance_dump", default=None)
        every = int(dump.get("every", 10)) if dump else 0
        rows = _step_rows(run / "csv" / "metrics.csv") if (run / "csv").is_dir() else []
    except Exception:  # not a run folder this version wrote: say what makes the file
        return generic
    with contextlib.suppress(Exception):  # a method class that cannot be imported: no verdict
        from hydra.utils import get_class

        if getattr(get_class(target), "relevance", None) is None:
            return f"its method ({target.rsplit('.', 1)[-1]}) does not replay: {generic}"
    if not dump or every <= 0:
        return "callbacks.relevance_dump was off in this run (set callbacks.relevance_dump.every=N)"
    dumped = [r for r in rows if (int(r.get("train/iteration", r["step"] + 1)) - 1) % every == 0]
    at = ", ".join(str(1 + i * every) for i in range(3)) + ", ..."
    why = (
        f"no response was replayed at those steps ({len(dumped)} of them: every reward was "
        "the same across each group, which is common early on or with an untrained policy)"
        if not any((r.get("train/adv/replayed_share", 0.0) or 0.0) > 0 for r in dumped)
        else "it had not written them when it stopped"
    )
    return (
        f"callbacks.relevance_dump.every={every} writes at steps {at} the responses replayed "
        f"there, and this run logged {len(rows)} step(s): {why}. That is not the method: set "
        "callbacks.relevance_dump.every=1 (a dump every step) or train longer"
    )


# A line that is no ``clean`` record is left out with a note naming it. The file is read a line
# at a time, twice, never whole: once for where each step's records start, then for the shown.
def _finite(v: Any) -> float | None:
    """``v`` as a finite float; None for a bool, a non-number, inf/NaN, or an int beyond float."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        with contextlib.suppress(OverflowError):
            if math.isfinite(f := float(v)):
                return f
    return None


def _rows(rows: Any, kind: str, n: int) -> dict[str, list[float]]:
    """``q`` or ``w``: reward name -> one finite number per token."""
    if not isinstance(rows, dict):
        raise ValueError(f"'{kind}' is not an object of reward name -> numbers ({kind_of(rows)})")
    out = {}
    for name, values in rows.items():
        if not isinstance(values, list) or len(values) != n:
            raise ValueError(f"{kind}[{name!r}] does not have one number per token ({n})")
        out[name] = [_finite(v) for v in values]
        if None in out[name]:
            raise ValueError(f"{kind}[{name!r}] holds a value that is not a finite number")
    return out


def _step(rec: dict) -> int:
    step = rec.get("step", 0)
    if isinstance(step, float) and step.is_integer():
        return int(step)
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"'step' is not a whole number ({kind_of(step)})")
    return step


def _rewards(rec: dict) -> dict[str, float | None]:
    """Each reward of the response: a number, or None where it did not apply (NaN too)."""
    rewards = rec.get("rewards") or {}
    if isinstance(rewards, dict):
        out = {k: v if isinstance(v, float) else _finite(v) for k, v in rewards.items()}
        if all(out[k] is not None or v is None for k, v in rewards.items()):
            return out
    raise ValueError("'rewards' is not an object of numbers (or null) by reward name")


def clean(rec: Any) -> dict | None:
    """The record as the page draws it, each value checked (ValueError: what is wrong); None
    when no reward was replayed."""
    if not isinstance(rec, dict):
        raise ValueError(f"not a JSON object ({kind_of(rec)})")
    tokens = rec.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError("'tokens' is not a list of strings")
    if "w" not in rec:
        raise ValueError("no 'w' (each reward's token weights)")
    q, w = _rows(rec.get("q"), "q", len(tokens)), _rows(rec["w"], "w", len(tokens))
    step, rewards, beta = _step(rec), _rewards(rec), rec.get("beta")
    if beta is not None and _finite(beta) is None:
        raise ValueError(f"'beta' is not a finite number ({kind_of(beta)})")
    if not q:
        return None
    prompt = rec.get("prompt", "")
    prompt = prompt if isinstance(prompt, str) else json.dumps(prompt)
    if len(prompt) > MAX_PROMPT:
        prompt = prompt[:MAX_PROMPT] + f" [... {len(prompt) - MAX_PROMPT} more characters]"
    return {"step": step, "id": str(rec.get("id", "?"))[:200], "beta": _finite(beta),
            "prompt": prompt, "tokens": tokens, "rewards": rewards, "q": q, "w": w,
            **_diagnostic_fields(rec, len(tokens))}  # fmt: skip


def _diagnostic_fields(rec: dict, n: int) -> dict:
    """The optional ``realloc`` (a number per token) and ``segments`` (name -> token indices)."""
    out: dict[str, Any] = {}
    if rec.get("realloc") is not None:
        out["realloc"] = _rows({"realloc": rec["realloc"]}, "realloc", n)["realloc"]
    segs = rec.get("segments")
    if segs is not None:
        ok = isinstance(segs, dict) and all(
            isinstance(v, list)
            and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in v)
            for v in segs.values()
        )
        if not ok:
            raise ValueError(f"'segments' is not an object of name -> token indices below {n}")
        out["segments"] = {str(k)[:100]: v for k, v in segs.items()}
    return out


def parse_line(raw: bytes, first: bool = False) -> dict | None:
    """One line as a ``clean`` record; None for a blank line or nothing to draw."""
    if first and raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8) :]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = f"byte 0x{raw[exc.start]:02x} at column {exc.start + 1}"
        raise ValueError(f"not UTF-8 ({where})") from None
    if not text.strip():
        return None
    try:
        rec = json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except ValueError as exc:  # an int of more digits than Python converts
        raise ValueError(f"not valid JSON ({exc})") from None
    return clean(rec)


def _lines(f) -> Iterator[tuple[int, int, bytes | None]]:
    """(line number, byte offset, line or None past ``MAX_LINE``) of binary ``f``. Lines end at
    ``\\n`` only: a prompt may hold U+2028 or U+0085, which ``str.splitlines`` splits at."""
    n = offset = 0
    while raw := f.readline(MAX_LINE + 1):
        n, start = n + 1, offset
        offset += len(raw)
        if len(raw) > MAX_LINE and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):
                raw = f.readline(1 << 20)
                offset += len(raw)
            yield n, start, None
        else:
            yield n, start, raw


def scan(path: Path) -> tuple[dict[int, list[int]], list[str], int]:
    """Where each step's drawable records start (step -> byte offsets), each line left out with
    why, and the number of lines."""
    offsets: dict[int, list[int]] = {}
    problems: list[str] = []
    n = 0
    with open(path, "rb") as f:
        for n, offset, raw in _lines(f):
            try:
                if raw is None:
                    raise ValueError(f"longer than {MAX_LINE >> 20} MiB, left out unread")
                rec = parse_line(raw, first=n == 1)
            except ValueError as exc:
                problems.append(f"{path.name} line {n}: {exc}")
                continue
            if rec is not None:
                offsets.setdefault(rec["step"], []).append(offset)
    return offsets, problems, n


def load_records(
    path: Path, steps: Sequence[int] | None = None, max_steps: int = 25, per_step: int = 8
) -> tuple[list[dict], list[str], list[str]]:
    """The records the page shows, notes on what it leaves out, and each line left out with why."""
    offsets, problems, n = scan(path)
    if not offsets:
        why = (f"{len(problems)} left out, the first: {problems[0]}"
               if problems else "none with a replayed reward")  # fmt: skip
        raise ValueError(f"{path}: no record to draw ({n} line{'s' * (n != 1)}, {why})")
    keep, note = choose_steps(sorted(offsets), steps, max_steps)
    capped = [s for s in sorted(keep) if len(offsets[s]) > per_step]
    notes = [note] if note else []
    if capped:
        more = f"; {len(capped) - 1} more steps hold more than {per_step}" * (len(capped) > 1)
        notes.append(f"at most {per_step} of the {len(offsets[capped[0]])} responses at "
                     f"step {capped[0]} are shown (--max-per-step){more}")  # fmt: skip
    records = []  # read in file order
    with open(path, "rb") as f:
        for o in sorted(o for s in keep for o in offsets[s][:per_step]):
            f.seek(o)
            with contextlib.suppress(ValueError):  # the file changed since it was scanned
                if (rec := parse_line(f.readline(MAX_LINE + 1), first=o == 0)) is not None:
                    records.append(rec)
    return records, notes, problems


def choose_steps(
    have: list[int], steps: Sequence[int] | None = None, max_steps: int = 25
) -> tuple[set[int], str]:
    """``steps`` of ``have`` (else all, thinned to ``max_steps`` evenly spaced from first to
    last), and a note of what was left out."""
    if steps:
        missing = sorted(set(steps) - set(have))
        if missing:
            raise ValueError(f"--steps: no records at step(s) {missing}; the file has {have}")
        keep = set(steps)
    elif len(have) > max_steps >= 1:
        idx = {round(i * (len(have) - 1) / max(1, max_steps - 1)) for i in range(max_steps)}
        keep = {have[i] for i in idx}
    else:
        keep = set(have)
    note = f"{len(keep)} of the file's {len(have)} steps are shown (--steps or --max-steps "
    note += "choose others)"
    return keep, note * (len(keep) < len(have))


# ---- one scale for the whole page --------------------------------------------------------------
@dataclass(frozen=True)
class Scales:
    q_max: float  # q is shaded from 0 to q_max
    w_octaves: float  # w from 2^-w_octaves to 2^w_octaves, 1 in the middle

    @classmethod
    def of(cls, records: list[dict]) -> Scales:
        qs = [v for r in records for row in r["q"].values() for v in row]
        ws = [v for r in records for row in r.get("w", {}).values() for v in row]
        q_max = max([*qs, 0.0]) or 1.0
        spread = max([abs(math.log2(max(v, 2**-W_OCTAVES))) for v in ws] + [0.0])
        return cls(q_max=q_max, w_octaves=min(W_OCTAVES, max(0.25, spread)))

    def q_pos(self, v: float) -> float:
        return min(1.0, max(0.0, v / self.q_max))

    def w_pos(self, v: float) -> float:
        octave = math.log2(max(v, 2**-self.w_octaves))
        return min(1.0, max(0.0, 0.5 + 0.5 * octave / self.w_octaves))


_LUTS: dict[str, list[str]] = {}


def colour(cmap: str, pos: float) -> str:
    """The colour at ``pos`` in [0, 1] of a matplotlib colormap, as #rrggbb."""
    if cmap not in _LUTS:
        import matplotlib

        m = matplotlib.colormaps[cmap]
        _LUTS[cmap] = [matplotlib.colors.to_hex(m(i / 255)) for i in range(256)]
    return _LUTS[cmap][round(pos * 255)]


@functools.cache  # a page has ~10^5 cells and at most 2 x 256 colours
def ink(background: str) -> str:
    """Black or white text, whichever reads on ``background``."""
    r, g, b = (int(background[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return "#000" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "#fff"


def visible(token: str) -> str:
    """A token as drawn: line breaks and tabs as signs, an empty token as a dot."""
    return token.replace("\n", "\u21b5").replace("\t", "\u2192").replace("\r", "") or "\u00b7"


# ---- credit diagnostics (as the trainer logs them under train/replay/) ------------------------
def q_ratios(rec: dict) -> dict[str, list[float]]:
    """Each reward's ``q_t / mean_t q`` over the record's tokens (none where the mean is ~0)."""
    out = {}
    for name, row in rec["q"].items():
        mean = sum(row) / len(row) if row else 0.0
        if mean > 1e-8:
            out[name] = [v / mean for v in row]
    return out


def profile_cosine(rec: dict) -> float | None:
    """Mean pairwise cosine of the rewards' q profiles (None: fewer than two non-zero)."""
    rows = [r for r in rec["q"].values() if any(v > 0 for v in r)]
    norms = [math.sqrt(sum(v * v for v in r)) for r in rows]
    pairs = [
        sum(a * b for a, b in zip(rows[i], rows[j])) / (norms[i] * norms[j])
        for i in range(len(rows))
        for j in range(i + 1, len(rows))
    ]
    return sum(pairs) / len(pairs) if pairs else None


def energy(rec: dict) -> dict[str, float]:
    """The reallocated credit's energy (sum of squares) per segment and ``other``."""
    realloc, segs = rec.get("realloc"), rec.get("segments")
    if realloc is None or segs is None:
        return {}
    out, seen = {}, set()
    for name, idx in segs.items():
        mine = [i for i in idx if i not in seen]
        out[name] = sum(realloc[i] ** 2 for i in mine)
        seen.update(mine)
    out["other"] = sum(v * v for i, v in enumerate(realloc) if i not in seen)
    return out


def diagnostics(records: list[dict]) -> dict[str, Any]:
    """q / mean q quantiles (p50, p99, max) per reward, mean profile cosine, energy shares."""
    import numpy as np  # its quantile: linear between the two nearest ranks

    ratios: dict[str, list[float]] = {}
    cosines, energies = [], {}
    for rec in records:
        for name, vals in q_ratios(rec).items():
            ratios.setdefault(name, []).extend(vals)
        c = profile_cosine(rec)
        if c is not None:
            cosines.append(c)
        for name, e in energy(rec).items():
            energies[name] = energies.get(name, 0.0) + e
    total = sum(energies.values())
    return {
        "q_ratio": {
            n: (*np.quantile(v, [0.5, 0.99]).tolist(), max(v)) for n, v in ratios.items() if v
        },
        "cosine": sum(cosines) / len(cosines) if cosines else None,
        "energy": {n: e / total for n, e in energies.items()} if total > 0 else {},
    }


# ---- the page (templates/relevance.html.j2) --------------------------------------------------
#: autoescaped: model text is text, a token or prompt holding <script> stays text
_PAGE = MARKDOWN.overlay(autoescape=True, lstrip_blocks=True, keep_trailing_newline=False)


def _cells(rec: dict, name: str, kind: str, scales: Scales) -> list[tuple[str, str]]:
    """(style, text) of each token of one reward's q or w row."""
    cmap, pos = (Q_CMAP, scales.q_pos) if kind == "q" else (W_CMAP, scales.w_pos)
    bgs = [colour(cmap, pos(v)) for v in rec[kind][name]]
    return [(f"background:{bg};color:{ink(bg)}", visible(t)) for bg, t in zip(bgs, rec["tokens"])]


def _record(rec: dict, scales: Scales) -> dict[str, Any]:
    """One response on the page: head, diagnostics, prompt, a q and a w row per reward."""
    rewards = rec.get("rewards", {})
    pairs = [
        {"name": n, "reward": "none" if rewards.get(n) is None else f"{rewards[n]:g}",
         "q": json.dumps(rec["q"][n]), "w": json.dumps(rec.get("w", {}).get(n, [])),
         "rows": [(k, _cells(rec, n, k, scales)) for k in ("q", "w") if rec[k].get(n) is not None]}
        for n in rec["q"]
    ]  # fmt: skip
    return {"step": int(rec.get("step", 0)), "id": rec.get("id", "?"), "beta": rec.get("beta"),
            "diag": diagnostics([rec]), "tokens": json.dumps(rec["tokens"], ensure_ascii=False),
            "prompt": str(rec.get("prompt", "")), "pairs": pairs}  # fmt: skip


def _legends(scales: Scales) -> list[dict[str, Any]]:
    """The q and w colour bars: gradient stops and (% position, label) ticks."""
    o = scales.w_octaves
    q_ticks = [(i / 4, f"{scales.q_max * i / 4:.3g}") for i in range(5)]
    w_ticks = [(scales.w_pos(2.0**e), f"{2.0**e:.3g}") for e in (-o, -o / 2, 0.0, o / 2, o)]
    return [
        {"kind": kind, "stops": ",".join(colour(cmap, i / 10) for i in range(11)),
         "ticks": [(f"{p * 100:.1f}", text) for p, text in ticks]}
        for kind, cmap, ticks in (("q", Q_CMAP, q_ticks), ("w", W_CMAP, w_ticks))
    ]  # fmt: skip


def render_html(records: list[dict], title: str, notes: Sequence[str] = ()) -> str:
    """The page for ``records`` (all on one scale), with ``notes`` (what was left out)."""
    scales = Scales.of(records)
    return _PAGE.get_template("relevance.html.j2").render(
        title=title,
        legends=_legends(scales),
        steps=sorted({int(r.get("step", 0)) for r in records}),
        rewards=list(dict.fromkeys(n for r in records for n in r["q"])),
        notes=list(notes),
        summary=diagnostics(records),
        records=[_record(r, scales) for r in records],
    )


# ---- the picture ------------------------------------------------------------------------------
def pick(records: list[dict]) -> dict:
    """The PNG's response: most rewards replayed, then met and unmet mixed, then latest step."""

    def key(r):
        vals = [v for v in r.get("rewards", {}).values() if isinstance(v, (int, float))]
        mixed = 0 < sum(1 for v in vals if v > 0) < len(vals)
        return (len(r["q"]), mixed, int(r.get("step", 0)))

    return max(records, key=key)


def render_png(rec: dict, scales: Scales, path: Path, width: int = 24, limit: int = 240) -> None:
    """One response, a q and a w row per reward, ``width`` tokens a line, on the page's scales."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    toks = [visible(t) for t in rec["tokens"][:limit]]
    rows = [(n, k) for n in rec["q"] for k in ("q", "w") if rec[k].get(n) is not None]
    lines = max(1, math.ceil(len(toks) / width))
    height = len(rows) + 1  # a blank row between lines of tokens
    size = (min(width, len(toks)) * 0.62 + 2.6, lines * height * 0.3 + 2)
    fig, (ax, q_bar, w_bar) = plt.subplots(
        3, 1, figsize=size, gridspec_kw={"height_ratios": [lines * height, 0.35, 0.35]}
    )
    for line in range(lines):
        for r, (name, kind) in enumerate(rows):
            y = line * height + r
            cmap, pos = (Q_CMAP, scales.q_pos) if kind == "q" else (W_CMAP, scales.w_pos)
            values = rec[kind][name]
            for c, t in enumerate(range(line * width, min(len(toks), (line + 1) * width))):
                bg = colour(cmap, pos(values[t]))
                ax.add_patch(plt.Rectangle((c, y), 1, 1, facecolor=bg, edgecolor="white", lw=0.5))
                ax.text(c + 0.5, y + 0.5, toks[t], ha="center", va="center", fontsize=6,
                        color=ink(bg), family="monospace", parse_math=False)  # fmt: skip
            ax.text(-0.2, y + 0.5, f"{name} {kind}", ha="right", va="center", fontsize=7,
                    parse_math=False)  # fmt: skip
    ax.set_xlim(0, min(width, len(toks)))
    ax.set_ylim(lines * height - 1, 0)
    ax.axis("off")
    cut = f" (first {limit} of {len(rec['tokens'])} tokens)" if len(rec["tokens"]) > limit else ""
    ax.set_title(f"step {rec.get('step', 0)}, prompt {rec.get('id', '?')}{cut}", fontsize=9,
                 parse_math=False)  # fmt: skip
    _colourbars(fig, q_bar, w_bar, scales)
    fig.subplots_adjust(hspace=0.9)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=130, bbox_inches="tight")
    plt.close(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, buf.getvalue())


def _colourbars(fig, q_axes, w_axes, scales: Scales) -> None:
    """The page's two scales as colour bars, each on its own axes."""
    from matplotlib import cm, colors, ticker

    o = scales.w_octaves
    q = cm.ScalarMappable(norm=colors.Normalize(0, scales.q_max), cmap=Q_CMAP)
    w = cm.ScalarMappable(norm=colors.LogNorm(2.0**-o, 2.0**o), cmap=W_CMAP)
    fig.colorbar(q, cax=q_axes, orientation="horizontal", label="q (relevance)")
    bar = fig.colorbar(
        w, cax=w_axes, orientation="horizontal", label="w (token weight; 1 = an even share)"
    )
    bar.set_ticks([2.0**e for e in (-o, -o / 2, 0.0, o / 2, o)])
    bar.ax.xaxis.set_major_formatter(ticker.FormatStrFormatter("%.3g"))
    bar.ax.xaxis.set_minor_formatter(ticker.NullFormatter())


# ---- the command ------------------------------------------------------------------------------
def parse_steps(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError as exc:
        raise ValueError(f"--steps takes step numbers separated by commas, got {text!r}") from exc


def _parser():
    p = argparse.ArgumentParser(
        prog="python src/relevance.py",
        description="Render a run's relevance.jsonl (each reward's per-token relevance q and "
        "weight w) as an HTML page (one colour scale, legend, hover values, step and reward "
        "filters) and a PNG of one response.",
    )
    p.add_argument("run", help="a run folder (or its relevance.jsonl)")
    p.add_argument("--out", type=Path, help="folder for relevance.html and relevance.png "
                   "(default: the folder holding relevance.jsonl)")  # fmt: skip
    p.add_argument("--steps", help="only these steps, e.g. 1,51,101")
    p.add_argument("--max-steps", type=int, default=25,
                   help="without --steps, at most this many evenly spaced steps (default 25)")  # fmt: skip
    p.add_argument("--max-per-step", type=int, default=8,
                   help="at most this many responses of a step, its first ones (default 8; "
                   "the trainer writes callbacks.relevance_dump.num = 4 a step)")  # fmt: skip
    return p


def _notes(notes: list[str], problems: list[str], limit: int) -> list[str]:
    """``notes`` and the first ``limit`` lines left out, then how many more."""
    more = [f"... and {len(problems) - limit} more lines left out"] * (len(problems) > limit)
    return [*notes, *problems[:limit], *more]


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    for flag, value in (("--max-steps", a.max_steps), ("--max-per-step", a.max_per_step)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    try:
        path = find_file(a.run)
        records, notes, problems = load_records(
            path, parse_steps(a.steps), a.max_steps, a.max_per_step
        )
    except (OSError, ValueError) as exc:
        print(f"error: {exc}")
        return 2
    for n in _notes(notes, problems, 20):
        print(f"note: {n}")
    out = a.out or path.parent
    page, png = out / "relevance.html", out / "relevance.png"
    title = path.parent.name if path.name == FILE else path.name
    try:
        for target in (page, png):
            check_output(target)  # both refused before either is written
        out.mkdir(parents=True, exist_ok=True)
        write_file(page, render_html(records, title, _notes(notes, problems, 5)))
        render_png(pick(records), Scales.of(records), png)
    except UnsafeOutput as exc:
        print(f"error: {exc}")
        return 2
    except OSError as exc:
        print(f"error: cannot write {exc.filename}: {exc.strerror}; give --out <a writable "
              "folder>")  # fmt: skip
        return 2
    print(f"wrote {page} ({len(records)} responses) and {png}")
    return 0
