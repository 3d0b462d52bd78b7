"""Toy replication of the paper's claims, on a CPU (docs/replication.md).

    make replicate                       # quick: K=4, 5 seeds, grpo/gdpo/mrtpo/mrtpo_shuffle/mrtpo_joint
    make replicate ARGS=--full           # K = 2, 4, 8; 8 seeds; + mrtpo@beta=0.25/0.75, cort, opsd
    python scripts/replicate.py --methods gdpo,mrtpo,mrtpo@beta=0.25   # a method with overrides
    python scripts/replicate.py --report-only --logdir logs/replicate/<run>   # redo the report
    python scripts/replicate.py --report-only --logdir <run> --docs /tmp/out  # ... elsewhere

The harness is the package beside this file, ``scripts/replication``; this file only reads
the command line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from mrtpo.config import CONFIG_DIR
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
from replication.harness import main as replicate


def parse_args(argv: Sequence[str] | None = None) -> Options:
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
        help="comma-separated method specs, <method>[@<key>=<value>[,...]] with ';' between "
        "specs when one has several overrides (default: the mode's)",
    )  # fmt: skip
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
    p.add_argument("--relevance-prompts", type=int, default=32)
    p.add_argument("--override", action="append", default=[], help="extra RL config override")
    p.add_argument(
        "--sft-override", action="append", default=[], help="extra override for both SFT passes"
    )
    a = p.parse_args(argv)
    if a.methods is None:
        methods = available_methods(a.full)
    else:
        sep = ";" if ";" in a.methods else ","
        methods = [m.strip() for m in a.methods.split(sep) if m.strip()]
    try:
        names = {parse_method(m)[0] for m in methods}
    except ValueError as exc:
        p.error(str(exc))
    unknown = sorted(names - {f.stem for f in (CONFIG_DIR / "method").glob("*.yaml")})
    if unknown:
        p.error(f"unknown method(s) {unknown}; see configs/method/")
    if a.report_only and a.logdir is None:
        p.error("--report-only needs --logdir")
    ks = [int(x) for x in a.ks.split(",")] if a.ks else list(FULL_K if a.full else QUICK_K)
    seeds = a.seeds if a.seeds is not None else FULL_SEEDS if a.full else QUICK_SEEDS
    return Options(
        k_values=ks, seeds=seeds, methods=methods, steps=a.steps, threshold=a.threshold,
        sft_max_steps=a.sft_max_steps, sft_seed=a.sft_seed, workers=a.workers,
        threads=a.threads, logdir=a.logdir, docs=a.docs, report_only=a.report_only,
        relevance_prompts=a.relevance_prompts, override=a.override,
        sft_override=a.sft_override, full=a.full, determinism=not a.no_determinism,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    return replicate(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
