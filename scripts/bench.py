"""`make bench`: what MRTPO's replay costs, and how our trainer compares with TRL.

    python scripts/bench.py                      # quick mode: CPU sizes, a few minutes
    python scripts/bench.py --full               # GPU sizes (bf16, bigger models and batches)
    python scripts/bench.py --only replay,trl    # some sections; the doc keeps the others
    python scripts/bench.py --render             # only rewrite docs/benchmarks.md from JSON

Sections (issue 9): 1 replay overhead, 2 relevance kernel, 3 against TRL, 4 scaling. Each
writes ``logs/bench/<section>.json``; the document ``docs/benchmarks.md`` is rendered from
whatever JSON is there. Timing rules: alternate the things compared, step by step, in one
process, and report medians and ratios; absolute seconds on a shared CPU are not stable.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import DOC, read_json, set_threads, write_json

SECTIONS = ("replay", "kernel", "trl", "scaling")

# ---- what each mode runs ----------------------------------------------------------------
QUICK: dict[str, Any] = {
    "replay": [
        dict(size="tiny", prompts=4, group=4, rewards=4, new_tokens=32, share=0.15, pairs=4),
        dict(size="small", prompts=2, group=4, rewards=4, new_tokens=32, share=0.15, pairs=6),
    ],
    "kernel": dict(
        vocab=[32768, 152064],
        lengths=[512, 2048],
        chunk=256,
        device="cpu",
        dtype="fp32",
        quick=True,  # one timed run per configuration
        # a CPU does ~40 positions/s at 152k: the quick mode runs what the claims need
        # (chunked and replay at every size; unchunked ~15 GiB at 152k x 2048: --full only)
        skip=[
            ("unchunked", 152064, 2048),
            ("candidate", 32768, 2048),
            ("candidate", 152064, 2048),
        ],
    ),
    "trl": [
        dict(size="tiny", prompts=4, group=4, rewards=4, new_tokens=32, steps=6),
        dict(size="mini", prompts=4, group=4, rewards=4, new_tokens=32, steps=5),
    ],
    "scaling": dict(
        size="mini",
        base=dict(prompts=4, group=4, rewards=4, new_tokens=32),
        group=[2, 4, 8],
        rewards=[1, 2, 4, 8],
        new_tokens=[16, 32, 64],
        share=0.15,
        pairs=2,
    ),
}
# GPU sizes: about 15 minutes on one H100/H200 (generation with HF `generate` dominates).
FULL: dict[str, Any] = {
    "replay": [
        dict(size="small", prompts=8, group=8, rewards=4, new_tokens=256, share=0.15, pairs=4),
        dict(size="medium", prompts=8, group=8, rewards=4, new_tokens=256, share=0.15, pairs=4),
        dict(size="large", prompts=8, group=8, rewards=4, new_tokens=256, share=0.15, pairs=4),
    ],
    "kernel": dict(
        vocab=[32768, 152064],
        lengths=[512, 2048, 8192],
        chunk=256,
        device="cuda",
        dtype="bf16",
        skip=[],
    ),
    "trl": [
        dict(size="small", prompts=8, group=8, rewards=4, new_tokens=128, steps=6),
        dict(size="medium", prompts=8, group=8, rewards=4, new_tokens=128, steps=6),
    ],
    "scaling": dict(
        size="medium",
        base=dict(prompts=8, group=8, rewards=4, new_tokens=128),
        group=[4, 8, 16],
        rewards=[1, 2, 4, 8],
        new_tokens=[64, 128, 256],
        share=0.15,
        pairs=2,
    ),
}


# ---- sections ---------------------------------------------------------------------------
def section_replay(plan, gpu: bool) -> dict[str, Any]:
    from bench_steps import print_case, run_case

    print("1. replay overhead (MRTPO vs GDPO, same rollout, alternating)", flush=True)
    cases = []
    for c in plan:
        c = dict(c)
        size = c.pop("size")
        res = run_case(size, **c, profile=True, gpu=gpu)
        print_case(res)
        cases.append(res)
    return {"cases": cases}


def section_kernel(plan, threads: int) -> dict[str, Any]:
    import bench_kernel

    print("2. relevance kernel (JSD over the full vocabulary)", flush=True)
    p = dict(plan)
    skip = {tuple(x) for x in p.pop("skip", [])}
    device = p["device"]
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            device = "cpu"
            p["dtype"] = "fp32"
    p["device"] = device
    results = bench_kernel.run_all(**p, threads=threads, skip=skip)
    return {"plan": {**p, "skip": sorted(skip)}, "results": results}


def section_trl(plan, gpu: bool) -> dict[str, Any]:
    from bench_trl import print_result, run

    print("3. against TRL's GRPOTrainer (same work, alternating steps)", flush=True)
    cases = []
    for c in plan:
        c = dict(c)
        size = c.pop("size")
        res = run(size, **c, gpu=gpu)
        print_result(res)
        cases.append(res)
    return {"cases": cases}


def section_scaling(plan, gpu: bool) -> dict[str, Any]:
    from bench_steps import print_case, run_case

    print("4. scaling with G, K and response length (MRTPO vs GDPO)", flush=True)
    base = plan["base"]
    out: dict[str, list] = {}
    for axis, key in (("group", "group"), ("rewards", "rewards"), ("new_tokens", "new_tokens")):
        rows = []
        for value in plan[axis]:
            args = {**base, key: value}
            res = run_case(
                plan["size"],
                **args,
                share=plan["share"],
                pairs=plan["pairs"],
                floor=False,
                fused=False,
                gpu=gpu,
            )
            print_case(res)
            res.pop("records", None)
            rows.append({"value": value, **res})
        out[axis] = rows
    return {"size": plan["size"], "share": plan["share"], "axes": out}


# ---- rendering ----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
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

    only = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = sorted(set(only) - set(SECTIONS))
    if bad:
        ap.error(f"--only: unknown section(s) {bad}; choose from {list(SECTIONS)}")
    plan = FULL if args.full else QUICK
    if args.plan:
        for s in only:
            print(s, plan[s])
        return 0
    if not args.render:
        run_sections(only, plan, args)
    from bench_render import render

    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(render({s: read_json(s) for s in SECTIONS}))
    print(f"wrote {DOC}")
    return 0


def run_sections(only: list[str], plan: dict[str, Any], args) -> None:
    import torch

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "transformers", "trl", "mrtpo"):
        logging.getLogger(name).setLevel(logging.ERROR)
    gpu = torch.cuda.is_available() and args.full
    threads = args.threads or (torch.get_num_threads() if gpu else 1)
    set_threads(threads)
    mode = "full" if args.full else "quick"
    import importlib.util

    for s in only:
        t0 = time.perf_counter()
        if s == "trl" and importlib.util.find_spec("trl") is None:
            print(
                "3. skipped: TRL is not installed (`.venv/bin/pip install -e '.[bench]'`); "
                "the document keeps the last TRL results, if any",
                flush=True,
            )
            continue
        if s == "replay":
            data = section_replay(plan["replay"], gpu)
        elif s == "kernel":
            data = section_kernel(plan["kernel"], threads)
        elif s == "trl":
            data = section_trl(plan["trl"], gpu)
        else:
            data = section_scaling(plan["scaling"], gpu)
        data["mode"] = mode
        data["wall_s"] = time.perf_counter() - t0
        path = write_json(s, data)
        print(f"   ({data['wall_s']:.0f}s) -> {path}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
