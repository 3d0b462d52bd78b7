"""`make bench`: what MRTPO's replay costs, and how our trainer compares with TRL.

    python scripts/bench.py                      # quick mode: CPU sizes, a few minutes
    python scripts/bench.py --full               # GPU sizes (bf16, bigger models and batches)
    python scripts/bench.py --only replay,trl    # some sections; the doc keeps the others
    python scripts/bench.py --render             # only rewrite docs/benchmarks.md from JSON

The harness is the package beside this file, ``scripts/benchmarks`` (sections, timing,
rendering); this file parses the flags.
"""

from __future__ import annotations

import argparse

from benchmarks.harness import SECTIONS, main


def cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--full", action="store_true", help="GPU sizes (bf16 on CUDA)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: 1 on CPU, see docs/benchmarks.md; all on GPU)",
    )
    ap.add_argument("--render", action="store_true", help="only re-render the doc from JSON")
    ap.add_argument("--plan", action="store_true", help="print what would run, run nothing")
    args = ap.parse_args(argv)
    try:
        return main(
            args.only,
            full=args.full,
            threads=args.threads,
            render_only=args.render,
            plan_only=args.plan,
        )
    except ValueError as exc:  # a bad --only
        ap.error(str(exc))


if __name__ == "__main__":
    raise SystemExit(cli())
