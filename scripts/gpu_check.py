"""The GPU check: the trainer on one CUDA GPU, no network, under 8 minutes.

    PYTHONPATH=src timeout 600 python scripts/gpu_check.py            # writes docs/gpu/
    PYTHONPATH=src python scripts/gpu_check.py --dry-run              # toy sizes on CPU
    PYTHONPATH=src python scripts/gpu_check.py --stages environment,vllm   # the vLLM check

The stages and what they measure are in ``scripts/benchmarks/gpu.py`` and docs/gpu/README.md; this
file parses the flags. Exit code 0 when no stage failed (skipped stages do not fail).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from benchmarks.gpu import STAGES, run


def cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="every stage at toy size on the CPU")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="report folder (default: docs/gpu, or $OUT when set; --dry-run: a temp folder)",
    )
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma list of {STAGES}")
    ap.add_argument(
        "--vllm",
        choices=("auto", "off"),
        default="auto",
        help="auto: run the vLLM check when vLLM is importable (default); off: skip it",
    )
    args = ap.parse_args(argv)
    out = args.out
    if out is None:
        if args.dry_run:
            out = Path(tempfile.mkdtemp(prefix="mrtpo-gpu-dry-run-"))
        elif os.environ.get("OUT"):
            out = Path(os.environ["OUT"])
        else:
            out = Path(__file__).resolve().parents[1] / "docs" / "gpu"
    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
    try:
        data = run(out, dry_run=args.dry_run, stages=stages, vllm=args.vllm)
    except ValueError as exc:  # a bad --stages
        ap.error(str(exc))
    print(f"status {data['status']} in {data['total_seconds']} s; report {out}")
    return 0 if data["status"] == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(cli())
