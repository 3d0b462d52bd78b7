"""Toy replication of the paper's claims, on a CPU (docs/replication.md).

    make replicate                       # quick: K=4, 5 seeds, grpo/gdpo/mrtpo/mrtpo_shuffle/mrtpo_joint
    make replicate ARGS=--full           # K = 2, 4, 8; 8 seeds; + mrtpo@beta=0.25/0.75, cort, opsd,
                                         #   and gdpo/mrtpo@one_step_off at K = 4
    python scripts/replicate.py --methods gdpo,mrtpo,mrtpo@beta=0.25   # a method with overrides
    python scripts/replicate.py --methods gdpo,gdpo@one_step_off       # ... or a rollout schedule
    python scripts/replicate.py --report-only --logdir logs/replicate/<run>   # redo the report
    python scripts/replicate.py --report-only --logdir <run> --docs /tmp/out  # ... elsewhere
    make replicate ARGS=--long           # the long toy: a free part of 0 and 60 words at K=2
    make replicate ARGS="--long --full"  # K = 4 at 0, 20, 60 words, K = 2, 4, 8 at 60, 8 seeds (replication_long.md)
    make replicate ARGS="--long --warm-from logs/replicate_long/<run>"  # RL only, its warm starts
    make replicate ARGS="--long --credit --warm-from <run>"   # issue 49: cap x context at K=8, P5
    python scripts/replicate.py --long --credit --dry-run     # ... its plan and minutes, no run

The harness is the package beside this file, ``scripts/replication``; this file only reads
the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from mrtpo.run.config import CONFIG_DIR
from replication.harness import (
    FULL_K,
    FULL_SEEDS,
    QUICK_K,
    QUICK_SEEDS,
    ROOT,
    Options,
    available_methods,
    parse_method,
)
from replication.long import LongOptions
from replication.toy_report import main as replicate


def long_options(a: argparse.Namespace, methods: list[str] | None) -> LongOptions:
    """The long toy's options: its mode's defaults, then what the command line sets."""
    from replication import long as L

    opts = LongOptions(
        cells=list(L.FULL_CELLS if a.full else L.QUICK_CELLS),
        seeds=L.FULL_SEEDS if a.full else L.QUICK_SEEDS,
        steps=L.FULL_STEPS if a.full else L.QUICK_STEPS,
        full=a.full, workers=a.workers, threads=a.threads, logdir=a.logdir, docs=a.docs,
        report_only=a.report_only, override=a.override, sft_override=a.sft_override,
        sft_max_steps=a.sft_max_steps, sft_seed=a.sft_seed, warm_from=a.warm_from,
        credit=a.credit, dry_run=a.dry_run, recheck=a.recheck,
    )  # fmt: skip
    if a.credit:
        from replication.credit import SEEDS

        opts.seeds = SEEDS
    if a.cells:
        opts.cells = [tuple(int(x) for x in c.split(":")) for c in a.cells.split(",")]
    for key in ("seeds", "steps", "threshold"):
        if getattr(a, key) is not None:
            setattr(opts, key, getattr(a, key))
    if methods is not None:
        opts.methods = methods
    return opts


def _long_arguments(p: argparse.ArgumentParser) -> None:
    """The long toy's options (``--long`` and what only it reads)."""
    p.add_argument(
        "--long", action="store_true",
        help="the long toy: a free part before the answer, a rare `mark` (replication_long.md)",
    )  # fmt: skip
    p.add_argument(
        "--cells", type=str, default=None,
        help="--long: comma-separated K:free cells, e.g. 4:0,4:60 (default: the mode's)",
    )  # fmt: skip
    p.add_argument(
        "--warm-from", type=Path, default=None,
        help="--long: reuse the warm starts of an earlier --long run folder (same SFT options)",
    )  # fmt: skip
    p.add_argument(
        "--credit", action="store_true",
        help="--long: issue 49's experiment, cap x context at K = 8 and P5 at the new defaults",
    )  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="--long --credit: print the plan only")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--full", action="store_true",
        help=f"K = {FULL_K}, {FULL_SEEDS} seeds, every method (default: K = {QUICK_K})",
    )  # fmt: skip
    p.add_argument(
        "--ks", type=str, default=None, help="comma-separated K values (overrides --full)"
    )
    p.add_argument(
        "--seeds", type=int, default=None,
        help=f"seeds per method (default {QUICK_SEEDS}; --full: {FULL_SEEDS})",
    )  # fmt: skip
    p.add_argument(
        "--methods", type=str, default=None,
        help="comma-separated method specs, <method>[@<key>=<value>[,...]] (method keys) or "
        "<method>@one_step_off (the rollout schedule), with ';' between specs when one has "
        "several overrides (default: the mode's)",
    )  # fmt: skip
    _long_arguments(p)
    p.add_argument("--no-determinism", action="store_true", help="skip the rerun check")
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the preset's)")
    p.add_argument(
        "--threshold", type=float, default=None,
        help="success rate for 'steps to' (default 0.5; --report-only: the run's)",
    )  # fmt: skip
    p.add_argument("--sft-max-steps", type=int, default=None, help="SFT step limit")
    p.add_argument("--sft-seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--logdir", type=Path, default=None, help="default: logs/replicate/<time>")
    p.add_argument(
        "--docs", "--out", type=Path, default=ROOT / "docs", help="where the report and figures go"
    )
    p.add_argument("--report-only", action="store_true", help="rebuild the report from --logdir")
    p.add_argument(
        "--recheck", action="store_true",
        help="--report-only: first rerun every method's seed 0 and the short warm-start passes at "
        "this code and compare every logged value with the runs (recheck.json, in the report)",
    )  # fmt: skip
    p.add_argument("--relevance-prompts", type=int, default=32)
    p.add_argument("--override", action="append", default=[], help="extra RL config override")
    p.add_argument(
        "--sft-override", action="append", default=[], help="extra override for both SFT passes"
    )
    return p


def _check_long(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse a long-toy option given without ``--long`` (and ``--dry-run`` without
    ``--credit``)."""
    if a.cells and not a.long:
        p.error("--cells is a --long option")
    if a.warm_from is not None and not a.long:
        p.error("--warm-from is a --long option")
    if (a.credit and not a.long) or (a.dry_run and not a.credit):
        p.error("--credit is a --long option, and --dry-run a --credit one")


def parse_args(argv: Sequence[str] | None = None) -> Options | LongOptions:
    p = _parser()
    a = p.parse_args(argv)
    given = None
    if a.methods is not None:
        sep = ";" if ";" in a.methods else ","
        given = [m.strip() for m in a.methods.split(sep) if m.strip()]
    methods = available_methods(a.full) if given is None else given
    try:
        names = {parse_method(m)[0] for m in methods}
    except ValueError as exc:
        p.error(str(exc))
    unknown = sorted(names - {f.stem for f in (CONFIG_DIR / "method").glob("*.yaml")})
    if unknown:
        p.error(f"unknown method(s) {unknown}; see configs/method/")
    if a.report_only and a.logdir is None:
        p.error("--report-only needs --logdir")
    if a.recheck and not a.report_only:
        p.error("--recheck is a --report-only option: it reruns part of a finished run folder")
    _check_long(p, a)
    if a.long:
        try:
            return long_options(a, given)
        except ValueError as exc:
            p.error(f"--cells {a.cells!r}: expected K:free pairs such as 4:0,4:60 ({exc})")
    ks = [int(x) for x in a.ks.split(",")] if a.ks else list(FULL_K if a.full else QUICK_K)
    seeds = a.seeds if a.seeds is not None else FULL_SEEDS if a.full else QUICK_SEEDS
    return Options(
        k_values=ks, seeds=seeds, methods=methods, steps=a.steps, threshold=a.threshold,
        sft_max_steps=a.sft_max_steps, sft_seed=a.sft_seed, workers=a.workers,
        threads=a.threads, logdir=a.logdir, docs=a.docs, report_only=a.report_only,
        relevance_prompts=a.relevance_prompts, override=a.override,
        sft_override=a.sft_override, full=a.full, determinism=not a.no_determinism,
        recheck=a.recheck,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    if isinstance(opts, LongOptions) and opts.report_only and not opts.credit:
        run = Path(opts.logdir) / "run.json"
        opts.credit = run.exists() and bool(json.loads(run.read_text()).get("credit"))
    if isinstance(opts, LongOptions) and opts.credit:
        from replication.credit_report import main as replicate_credit

        return replicate_credit(opts)
    if isinstance(opts, LongOptions):
        from replication.long_report import main as replicate_long

        return replicate_long(opts)
    return replicate(opts)


if __name__ == "__main__":
    sys.exit(main())
