"""The GPU check of the trainer itself: one command, under 8 minutes, on a bare GPU machine.

Written for the machine a cluster or a cloud image hands out: a CUDA torch, transformers,
lightning, peft, rich and torchmetrics preinstalled, no network, no Hydra, no vLLM. It runs
from the source tree (``PYTHONPATH=src``) and imports nothing that needs Hydra or OmegaConf:
the trainer is built by hand here (``PolicyModule``, ``PromptDataModule``, a Lightning
``Trainer``), the methods from their classes' defaults (``gpu_method``; a harness test checks
that they equal what Hydra composes from ``configs/method/``).

Stages, each timed and each allowed to fail without stopping the others (the JSON report is
rewritten after every stage, so a crash still leaves what ran):

1. ``environment``: GPU, versions (and the project's declared ranges), free memory;
2. ``model``: a random-weight Qwen2 with Qwen2.5-0.5B's shape (vocabulary 151,936) in bf16;
3. ``steps``: MRTPO against GDPO training steps on one fixed rollout with long contexts
   (1-2k-token prompts with verifier blocks appended, as text-to-SQL has, a few hundred
   response tokens), rewards controlled to a replayed share of ~15%: median step ratio,
   replay time against its forward floor, tokens/s, peak memory;
4. ``numerics``: relevance q of the same pairs in bf16 against float32 (max and mean
   difference, rank correlation), and the shared-prefix path against the plain path;
5. ``jsd_memory``: the chunked JSD and replay's scoring at V = 151,936 for T = 1k and 4k
   (peak memory should be flat in T), one process per configuration (``benchmarks.kernel``);
6. ``generation``: the HF engine's tokens/s at a realistic batch;
7. ``vllm``: ``benchmarks.gpu_vllm`` (weight sync proven by log-prob agreement) in a
   subprocess, only when vLLM is importable; otherwise recorded as "not installed".

A stage whose torch / transformers feature is missing is skipped with the feature named.
``--dry-run`` runs every stage at toy size on the CPU (seconds) and writes its report to a
temporary folder: the test suite runs it, so this file cannot rot unnoticed.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import QWEN25_05B, ROOT, child_pythonpath, muted_libraries
from benchmarks.gpu_setup import (  # NEEDS: what each stage needs (tests patch it here)
    DRY,
    FULL,
    NEEDS,
    REPORT_NAME,
    STAGES,
    SUMMARY_NAME,
    Report,
    Sizes,
    Skipped,
    _free,
    _importable,
    _sync,
    _version,
    require,
)
from benchmarks.gpu_trainer import (
    FixedEngine,
    _normal_token_range,
    _rl_config,
    _text_of,
    build_model,
    build_tokenizer,
    build_trainer,
    gpu_method,
    long_context_task,
)

__all__ = ["NEEDS", "REPORT_NAME", "STAGES", "SUMMARY_NAME", "gpu_method", "run"]


# ---- 1. environment ---------------------------------------------------------------------
def stage_environment(sizes: Sizes) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": sizes.device,
        "cpu_count": os.cpu_count(),
        "packages": {
            n: _version(n)
            for n in (
                "transformers",
                "lightning",
                "tokenizers",
                "peft",
                "rich",
                "torchmetrics",
                "hydra-core",
                "omegaconf",
                "vllm",
            )
        },
        "declared": _declared_ranges(),
        "commit": _git_commit(),
    }
    if sizes.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device (torch.cuda.is_available() is False)")
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        out.update(
            gpu=torch.cuda.get_device_name(0),
            capability=f"{props.major}.{props.minor}",
            memory_total_gib=round(total / 2**30, 1),
            memory_free_gib=round(free / 2**30, 1),
            bf16=torch.cuda.is_bf16_supported(),
        )
    return out


def _declared_ranges() -> dict[str, str]:
    """The project's dependency ranges (pyproject.toml), to compare with what is installed."""
    path = ROOT / "pyproject.toml"
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return {}
    try:
        deps = tomllib.loads(path.read_text())["project"]["dependencies"]
    except (OSError, KeyError):
        return {}
    out = {}
    for d in deps:
        name = d.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip()
        if name in ("torch", "transformers", "lightning", "hydra-core"):
            out[name] = d
    return out


def _git_commit() -> str | None:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            or None
        )
    except Exception:
        return None


def stage_model(sizes: Sizes, state: dict[str, Any]) -> dict[str, Any]:
    import torch

    require("model", sizes)
    tok = build_tokenizer()
    t0 = time.perf_counter()
    model = build_model(sizes, tok)
    _sync(sizes)
    state.update(tok=tok, model=model)
    return {
        "shape": "Qwen2.5-0.5B (random weights)" if sizes.shape is QWEN25_05B else "toy",
        "config": dict(sizes.shape),
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype),
        "build_seconds": round(time.perf_counter() - t0, 2),
        "tokenizer_size": len(tok),
        "memory_allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 2)
        if sizes.device == "cuda"
        else None,
    }


# ---- 3. steps --------------------------------------------------------------------------
def stage_steps(sizes: Sizes, state: dict[str, Any], workdir: Path) -> dict[str, Any]:
    from benchmarks.common import set_threads
    from benchmarks.steps import alternate, step_order, summarize

    require("steps", sizes)
    if "model" not in state:
        raise Skipped("the model stage failed")
    if sizes.device == "cpu":
        set_threads(1)
    order = step_order(["mrtpo", "gdpo"], sizes.rounds + 1)
    trainer, module, dm, _task = build_trainer(sizes, state, len(order), workdir / "steps")
    alt = alternate(trainer, module, dm, gpu_method("gdpo"), sizes.share, order, 1, True, False)
    state["scored"] = alt.last_replayed  # stage 4 replays the same pairs
    state["task"] = module.task
    summary = summarize(alt.records)
    roll = alt.last_replayed.rollout if alt.last_replayed is not None else None
    prompt_tokens = int(roll.prompt_mask.sum()) if roll is not None else 0
    resp_tokens = int(roll.response_mask.sum()) if roll is not None else 0
    for d in summary["variants"].values():
        d["tokens_per_s"] = (prompt_tokens + resp_tokens) / d["train"] if d["train"] else None
        d["response_tokens_per_s"] = resp_tokens / d["train"] if d["train"] else None
    m, g = summary["variants"]["mrtpo"], summary["variants"]["gdpo"]
    return {
        "case": {
            "B": sizes.prompts,
            "G": sizes.group,
            "K": sizes.rewards,
            "prompt_tokens_range": list(sizes.prompt_tokens),
            "mean_prompt_tokens": round(prompt_tokens / max(1, len(roll.examples)), 1)
            if roll is not None
            else None,
            "response_tokens": sizes.response_tokens,
            "target_share": sizes.share,
            "rl": _rl_config(sizes),
            "rounds": sizes.rounds,
            "rollout": "fixed seeded tokens (FixedEngine); generation is stage 6",
        },
        "headline": {
            "ratio_train_median_paired": m.get("ratio_train_paired"),
            "ratio_step_median_paired": m.get("ratio_step_paired"),
            "share": m.get("share"),
            "replay_s": m.get("replay"),
            "floor_s": m.get("floor"),
            "replay_over_floor": m.get("replay_over_floor"),
            "tokens_per_s_mrtpo": m.get("tokens_per_s"),
            "tokens_per_s_gdpo": g.get("tokens_per_s"),
            "peak_gib_mrtpo": m.get("peak_gib"),
            "peak_gib_gdpo": g.get("peak_gib"),
        },
        "summary": summary,
        "records": alt.records,
    }


# ---- 4. numerics -----------------------------------------------------------------------
def _rank(x):
    import torch

    r = torch.empty_like(x)
    r[x.argsort()] = torch.arange(len(x), dtype=x.dtype, device=x.device)
    return r


def spearman(a, b) -> float:
    """Rank correlation of two 1-D tensors (ties broken by position: q has few ties)."""
    import torch

    ra, rb = _rank(a.double()), _rank(b.double())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = torch.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / den) if den > 0 else float("nan")


def compare_q(a, b, replayed, mask) -> dict[str, Any]:
    """Differences between two relevance tensors [N, K, T] over the replayed, valid tokens."""
    sel = replayed[:, :, None] & mask[:, None, :]
    x, y = a[sel].double(), b[sel].double()
    if x.numel() == 0:
        return {"tokens": 0}
    d = (x - y).abs()
    return {
        "tokens": int(d.numel()),
        "max_abs": float(d.max()),
        "mean_abs": float(d.mean()),
        "mean_q": float(y.mean()),
        "spearman": spearman(x, y),
    }


def _scored_batch(sizes: Sizes, state: dict[str, Any]):
    """The batch and pairs stage 3 replayed, or (when it did not run) a rollout built the same
    way with the pairs MRTPO would replay: (task, batch, pairs)."""
    if state.get("scored") is not None:
        return state["task"], state["scored"], state["scored"].replayed
    import torch

    from benchmarks.common import controlled_task
    from mrtpo.core.batch import ScoredBatch, rewards_tensor
    from mrtpo.core.models import eos_token_ids
    from mrtpo.rollout.base import SamplingConfig
    from mrtpo.rollout.build import build_rollout

    tok = state["tok"]
    task = controlled_task(long_context_task(sizes, tok), sizes.share)
    low, high = _normal_token_range(tok)
    examples = list(task.examples("train"))[: sizes.prompts]
    roll = build_rollout(
        FixedEngine(sizes.response_tokens, low, high),
        tok,
        examples,
        sizes.group,
        SamplingConfig(max_new_tokens=sizes.response_tokens),
        0,
        eos_token_ids(tok),
    )
    scores = task.score_many(roll.examples, roll.texts)
    rewards = rewards_tensor(scores, tuple(task.reward_names))
    batch = ScoredBatch(roll, scores, tuple(task.reward_names), rewards)
    # the pairs MRTPO replays: rewards that vary within their group
    g = roll.group
    vary = torch.zeros_like(rewards, dtype=torch.bool)
    for p in g.unique():
        rows = (g == p).nonzero().flatten()
        vary[rows] = (rewards[rows].max(0).values != rewards[rows].min(0).values)[None, :]
    return task, batch, vary


def stage_numerics(sizes: Sizes, state: dict[str, Any]) -> dict[str, Any]:
    import copy

    import torch

    from mrtpo.core.replay import Replayer

    require("numerics", sizes)
    if "model" not in state:
        raise Skipped("the model stage failed")
    task, batch, pairs = _scored_batch(sizes, state)
    if pairs is None or not pairs.any():
        raise RuntimeError("no replayed pairs to compare")
    tok, model = state["tok"], state["model"]
    mask = batch.rollout.response_mask

    def replay(m, share_prefix: bool):
        # "always": the shared path wherever a prefix is shared (the comparison)
        rep = Replayer(tok, shared_prompt="always" if share_prefix else "off")
        _sync(sizes)
        t0 = time.perf_counter()
        res = rep.run(m, task, batch, pairs, "per_reward")
        _sync(sizes)
        return res, time.perf_counter() - t0

    out: dict[str, Any] = {"pairs": int(pairs.sum()), "responses": int(pairs.any(-1).sum())}
    # the same weights in bf16 (the policy's own, or a copy) and in float32 (a copy; bf16
    # values are exact in float32)
    if next(model.parameters()).dtype == torch.bfloat16:
        low_model, hi_model = model, copy.deepcopy(model).to(torch.float32)
    else:
        low_model = copy.deepcopy(model).to(torch.bfloat16)
        hi_model = copy.deepcopy(low_model).to(torch.float32)
    try:
        low, t_low = replay(low_model, True)
        plain, t_plain = replay(low_model, False)
        hi, _ = replay(hi_model, True)
        hi_plain, _ = replay(hi_model, False)
    finally:
        del low_model, hi_model
        _free(sizes)
    out["seconds_bf16_shared_prefix"] = round(t_low, 3)
    out["seconds_bf16_plain"] = round(t_plain, 3)
    out["shared_prefix_batches"] = low.stats.get("shared_prefix_batches")
    out["bf16_vs_fp32"] = compare_q(low.q, hi.q, low.replayed, mask)
    out["shared_vs_plain_bf16"] = compare_q(low.q, plain.q, low.replayed, mask)
    out["shared_vs_plain_fp32"] = compare_q(hi.q, hi_plain.q, hi.replayed, mask)
    return out


# ---- 5. JSD and replay memory ----------------------------------------------------------------
def stage_jsd_memory(sizes: Sizes) -> dict[str, Any]:
    from benchmarks import kernel

    require("jsd_memory", sizes)
    dtype = "bf16" if sizes.device == "cuda" else "fp32"
    results = kernel.run_all(
        vocab=[sizes.jsd_vocab],
        lengths=list(sizes.jsd_lengths),
        chunk=sizes.jsd_chunk,
        device=sizes.device,
        dtype=dtype,
        threads=1 if sizes.device == "cpu" else (os.cpu_count() or 1),
        quick=sizes.device == "cpu",
        one_process=sizes.jsd_one_process,
    )
    flat = {}
    for impl in ("chunked", "replay", "unchunked"):
        rs = sorted(
            (r for r in results if r.get("impl") == impl and "peak_extra_bytes" in r),
            key=lambda r: r["T"],
        )
        if len(rs) >= 2:
            flat[impl] = {
                "T": [r["T"] for r in rs],
                "peak_mib": [round(r["peak_extra_bytes"] / 2**20, 1) for r in rs],
                "growth": rs[-1]["peak_extra_bytes"] / max(rs[0]["peak_extra_bytes"], 1),
            }
    errors = [r for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"{len(errors)} kernel worker(s) failed: {errors[0]['error'][-300:]}")
    return {
        "V": sizes.jsd_vocab,
        "chunk": sizes.jsd_chunk,
        "dtype": dtype,
        "flat": flat,
        "results": results,
    }


# ---- 6. generation -------------------------------------------------------------------------
def stage_generation(sizes: Sizes, state: dict[str, Any]) -> dict[str, Any]:
    from mrtpo.core.chat import chat_ids
    from mrtpo.core.models import eos_token_ids
    from mrtpo.rollout.base import SamplingConfig
    from mrtpo.rollout.hf import HFEngine

    require("generation", sizes)
    if "model" not in state:
        raise Skipped("the model stage failed")
    tok, model = state["tok"], state["model"]
    rng = random.Random(1)
    prompts = [
        chat_ids(tok, [{"role": "user", "content": _text_of(tok, sizes.gen_prompt_tokens, rng)}])
        for _ in range(sizes.gen_prompts)
    ]
    engine = HFEngine(batch_size=sizes.gen_prompts * sizes.gen_samples)
    engine.bind(model, tok, eos_token_ids(tok, model))
    was = model.training
    model.eval()
    try:
        engine.generate(prompts[:2], 2, SamplingConfig(max_new_tokens=4), seed=0)  # warm-up
        samp = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=sizes.gen_new_tokens)
        _sync(sizes)
        t0 = time.perf_counter()
        gens = engine.generate(prompts, sizes.gen_samples, samp, seed=1)
        _sync(sizes)
        sec = time.perf_counter() - t0
    finally:
        model.train(was)
    n_tok = sum(len(g.token_ids) for g in gens)
    return {
        "engine": "mrtpo.rollout.hf.HFEngine (one batch)",
        "prompts": sizes.gen_prompts,
        "samples_per_prompt": sizes.gen_samples,
        "batch": sizes.gen_prompts * sizes.gen_samples,
        "mean_prompt_tokens": round(sum(map(len, prompts)) / len(prompts), 1),
        "max_new_tokens": sizes.gen_new_tokens,
        "tokens": n_tok,
        "seconds": round(sec, 3),
        "tokens_per_s": round(n_tok / sec, 1),
        "finished_frac": round(sum(g.finished for g in gens) / max(1, len(gens)), 4),
    }


# ---- 7. vLLM ---------------------------------------------------------------------------
def stage_vllm(sizes: Sizes, out_dir: Path, dry_run: bool, mode: str) -> dict[str, Any]:
    """``benchmarks.gpu_vllm`` in a subprocess (its engine claims GPU memory of its own)."""
    if mode == "off":
        raise Skipped("--vllm off")
    if not _importable("vllm"):
        return {"status": "not installed"}
    if dry_run:
        return {"status": "installed; not run in --dry-run"}
    path = out_dir / "vllm_check.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu_vllm", "--out", str(path), "--no-trainer-smoke"]
    env = dict(os.environ, PYTHONPATH=child_pythonpath())
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=sizes.vllm_timeout_s, env=env, cwd=ROOT
        )
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as exc:
        rc, tail = "timeout", str(exc)[-3000:]
    sub = json.loads(path.read_text()) if path.exists() else {}
    out = {
        "status": sub.get("status", "no report"),
        "returncode": rc,
        "report": str(path),
        "agreement": sub.get("agreement"),
        "throughput": sub.get("throughput"),
        "weight_sync_mode": (sub.get("engine") or {}).get("weight_sync_mode"),
        "output_tail": tail,
    }
    if rc != 0:
        raise RuntimeError(f"the vLLM check exited with {rc} (status {out['status']}); see {path}")
    return out


# ---- the run -------------------------------------------------------------------------------
def run(
    out_dir: Path,
    *,
    dry_run: bool = False,
    stages: tuple[str, ...] = STAGES,
    vllm: str = "auto",
    sizes: Sizes | None = None,
) -> dict[str, Any]:
    """Run ``stages`` and write ``gpu_report.json`` and ``gpu_report.md`` into ``out_dir``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # the steps stage's trainer writes under a scratch folder, removed when the run ends
    with muted_libraries(), tempfile.TemporaryDirectory(prefix="mrtpo-gpu-") as work:
        return _run(out_dir, Path(work), dry_run=dry_run, stages=stages, vllm=vllm, sizes=sizes)


def _run(out_dir, workdir: Path, *, dry_run, stages, vllm, sizes) -> dict[str, Any]:
    sizes = sizes or (DRY if dry_run else FULL)
    bad = sorted(set(stages) - set(STAGES))
    if bad:
        raise ValueError(f"unknown stage(s) {bad}; choose from {list(STAGES)}")
    out_dir = Path(out_dir)
    report = Report(
        out_dir / REPORT_NAME,
        {"dry_run": dry_run, "stages_requested": list(stages), "sizes": dataclasses.asdict(sizes)},
    )
    data = report.data
    state: dict[str, Any] = {}
    t0 = time.perf_counter()
    want = set(stages)
    if "steps" in want or "numerics" in want or "generation" in want:
        want.add("model")
    for name in STAGES:
        if name not in want:
            continue
        with report.stage(name) as rec:
            if name == "environment":
                data["environment"] = stage_environment(sizes)
            elif name == "model":
                data["model"] = stage_model(sizes, state)
            elif name == "steps":
                data["steps"] = stage_steps(sizes, state, workdir)
            elif name == "numerics":
                data["numerics"] = stage_numerics(sizes, state)
            elif name == "jsd_memory":
                state.pop("scored", None)
                _free(sizes)
                data["jsd_memory"] = stage_jsd_memory(sizes)
            elif name == "generation":
                data["generation"] = stage_generation(sizes, state)
            elif name == "vllm":
                state.clear()  # the vLLM check needs the GPU memory the models held
                _free(sizes)
                data["vllm"] = stage_vllm(sizes, out_dir, dry_run, vllm)
            rec["done"] = True
    status = {s["status"] for s in data["stages"].values()}
    data["status"] = "failed" if "failed" in status else "ok"
    data["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    data["total_seconds"] = round(time.perf_counter() - t0, 1)
    report.write()
    (out_dir / SUMMARY_NAME).write_text(summary_markdown(data))
    return data


def _fmt(x, nd: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{nd}g}" if abs(x) < 1e-2 else f"{x:.{nd}f}"
    return str(x)


def summary_markdown(data: dict[str, Any]) -> str:
    """A short Markdown summary of the report (every number from the JSON)."""
    lines = _summary_head(data)
    for key, note in SUMMARY_NOTES:
        if data.get(key):
            lines += [note(data[key]), ""]
    return "\n".join(lines)


def _summary_head(data: dict[str, Any]) -> list[str]:
    """The title, the machine and the table of stages."""
    env = data.get("environment") or {}
    pk = env.get("packages") or {}
    lines = [
        "# GPU check" + (" (dry run, toy sizes on CPU)" if data.get("dry_run") else ""),
        "",
        f"Generated by `scripts/gpu_check.py` ({data.get('finished')}, "
        f"{data.get('total_seconds')} s, commit {env.get('commit')}). Full report: "
        f"`{REPORT_NAME}`.",
        "",
        f"- Machine: {env.get('gpu') or env.get('device')}, "
        f"{env.get('memory_free_gib', '–')} of {env.get('memory_total_gib', '–')} GiB free; "
        f"Python {env.get('python')}, torch {env.get('torch')} (CUDA {env.get('cuda')}), "
        f"transformers {pk.get('transformers')}, lightning {pk.get('lightning')}; "
        f"hydra-core {pk.get('hydra-core') or 'not installed'}, "
        f"vLLM {pk.get('vllm') or 'not installed'}.",
        "",
        "| stage | status | seconds | note |",
        "|---|---|---|---|",
    ]
    for name, rec in data.get("stages", {}).items():
        note = rec.get("reason") or rec.get("error") or ""
        lines.append(f"| {name} | {rec['status']} | {rec['seconds']} | {note[:160]} |")
    lines.append("")
    return lines


def _steps_note(st: dict[str, Any]) -> str:
    h = st["headline"]
    c = st["case"]
    return (
        f"**Steps** (B={c['B']}, G={c['G']}, K={c['K']}, prompts ~{c['mean_prompt_tokens']} "
        f"tokens, {c['response_tokens']} response tokens, replayed share "
        f"{_fmt(h['share'])}): MRTPO/GDPO training time **×{_fmt(h['ratio_train_median_paired'])}** "
        f"(median of paired rounds; with the fixed rollout's generation ×"
        f"{_fmt(h['ratio_step_median_paired'])}); replay {_fmt(h['replay_s'])} s against a "
        f"no-grad forward floor of {_fmt(h['floor_s'])} s (×{_fmt(h['replay_over_floor'])}); "
        f"tokens/s MRTPO {_fmt(h['tokens_per_s_mrtpo'], 0)}, GDPO "
        f"{_fmt(h['tokens_per_s_gdpo'], 0)}; peak memory MRTPO {_fmt(h['peak_gib_mrtpo'])} "
        f"GiB, GDPO {_fmt(h['peak_gib_gdpo'])} GiB."
    )


def _numerics_note(nu: dict[str, Any]) -> str:
    a, b = nu["bf16_vs_fp32"], nu["shared_vs_plain_bf16"]
    return (
        f"**Replay numerics** ({nu['pairs']} pairs): q in bf16 against "
        f"float32 max |Δ| {_fmt(a.get('max_abs'))}, mean |Δ| {_fmt(a.get('mean_abs'))} "
        f"(mean q {_fmt(a.get('mean_q'))}), Spearman {_fmt(a.get('spearman'), 4)}; "
        f"shared-prefix against plain max |Δ| {_fmt(b.get('max_abs'))} in bf16 "
        f"(float32: {_fmt(nu['shared_vs_plain_fp32'].get('max_abs'))}); "
        f"{_fmt(nu.get('shared_prefix_batches'))} batch(es) took the shared path."
    )


def _jsd_note(jm: dict[str, Any]) -> str:
    parts = [
        f"{impl} {' → '.join(f'{p} MiB' for p in d['peak_mib'])} (T {' → '.join(map(str, d['T']))})"
        for impl, d in jm["flat"].items()
    ]
    return f"**JSD peak memory** at V={jm['V']} ({jm['dtype']}): " + "; ".join(parts) + "."


def _generation_note(ge: dict[str, Any]) -> str:
    return (
        f"**HF generation**: {ge['tokens_per_s']} tokens/s at batch {ge['batch']} "
        f"({ge['mean_prompt_tokens']}-token prompts, {ge['max_new_tokens']} new tokens)."
    )


#: The stages whose results the summary describes, in order, each by its note.
SUMMARY_NOTES = (
    ("steps", _steps_note),
    ("numerics", _numerics_note),
    ("jsd_memory", _jsd_note),
    ("generation", _generation_note),
    ("vllm", lambda vl: f"**vLLM**: {vl.get('status')}."),
)
