"""Toy replication of MRTPO's learning-speed claim, on a CPU, in minutes.

    make replicate                       # quick: K=4, 5 seeds, grpo/gdpo/mrtpo/mrtpo_shuffle/mrtpo_joint
    make replicate ARGS=--full           # K = 2, 4 and 8
    python scripts/replicate.py --report-only --logdir logs/replicate/<run>   # redo the report
    python scripts/replicate.py --report-only --logdir <run> --docs /tmp/out  # ... elsewhere

The harness is mrtpo.analysis.replication; this file only reads the command line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from mrtpo.analysis.replication import METHODS, ROOT, Options
from mrtpo.analysis.replication import main as replicate
from mrtpo.config import CONFIG_DIR


def parse_args(argv: Sequence[str] | None = None) -> Options:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--full", action="store_true", help="K = 2, 4 and 8 (default: K = 4 only)")
    p.add_argument(
        "--ks", type=str, default=None, help="comma-separated K values (overrides --full)"
    )
    p.add_argument("--seeds", type=int, default=5, help="seeds per method (default 5)")
    p.add_argument("--methods", type=str, default=",".join(METHODS))
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
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - {f.stem for f in (CONFIG_DIR / "method").glob("*.yaml")})
    if unknown:
        p.error(f"unknown method(s) {unknown}; see configs/method/")
    if a.report_only and a.logdir is None:
        p.error("--report-only needs --logdir")
    ks = [int(x) for x in a.ks.split(",")] if a.ks else [2, 4, 8] if a.full else [4]
    return Options(
        k_values=ks, seeds=a.seeds, methods=methods, steps=a.steps, threshold=a.threshold,
        sft_max_steps=a.sft_max_steps, sft_seed=a.sft_seed, workers=a.workers,
        threads=a.threads, logdir=a.logdir, docs=a.docs, report_only=a.report_only,
        relevance_prompts=a.relevance_prompts, override=a.override,
        sft_override=a.sft_override, full=a.full,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    return replicate(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
