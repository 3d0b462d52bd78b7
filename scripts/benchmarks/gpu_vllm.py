"""GPU check for ``rollout=vllm``: weight sync proven by log-prob agreement, and tokens/s.

On one CUDA GPU, with no downloads:
1. builds a randomly initialised Qwen2 with Qwen2.5-0.5B's shape (config only) and a
   byte-level tokenizer, and saves it as the checkpoint vLLM starts from;
2. starts the project's ``VLLMEngine`` next to the trainer's copy of the model (fp32, AdamW);
3. measures generation tokens/s of vLLM and of the project's Hugging Face engine on the
   same prompts and sampling settings;
4. runs 3 policy-gradient steps (a plain REINFORCE update written here, not the project's
   trainer, so every sync can be inspected); after each ``sync_weights`` it samples with
   vLLM (``SamplingParams(logprobs=0)``) and compares vLLM's log-prob of every sampled token
   with the trainer's (``mrtpo.core.forward.response_logprobs``) — and, as a control, with the
   weights from before the step, which a missed sync would match instead;
5. optionally (``--trainer-smoke``) runs ``src/train.py rollout=vllm`` for 3 steps on a small
   checkpoint, in a subprocess, and records its exit code and output tail.

Every stage is caught and timed; the JSON report is rewritten after each stage, so a crash
still leaves what ran. ``scripts/gpu_check.py`` runs it as its ``vllm`` stage when vLLM is
importable; on its own: ``PYTHONPATH=src:scripts python -m benchmarks.gpu_vllm`` (see
docs/gpu/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

from benchmarks.common import QWEN25_05B, ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The trainer initialises CUDA before vLLM starts; a forked engine process could not use it.
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

from benchmarks.gpu_vllm_model import (
    DEVICE,
    build_checkpoint,
    build_tokenizer,
    diff_stats,
    eos_ids_of,
    gen_stats,
    log,
    make_prompts,
    pg_step,
    swapped_params,
    trainer_logprobs,
)

SMOKE_SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


class Report:
    """The JSON report, rewritten atomically after every stage."""

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        self.path = path
        self.data: dict = {
            "schema": 1,
            "what": "rollout=vllm GPU check: log-prob agreement after each weight sync, tokens/s",
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "status": "running",
            "args": vars(args),
            "stages": {},
        }
        self.write()

    @contextlib.contextmanager
    def stage(self, name: str):
        log(f">> {name}")
        t0 = time.perf_counter()
        rec = {"ok": False, "seconds": None, "error": None}
        self.data["stages"][name] = rec
        state = {"ok": False}
        try:
            yield state
            rec["ok"] = state["ok"] = True
        except Exception as exc:  # a failed stage is recorded, the script goes on
            rec["error"] = f"{type(exc).__name__}: {exc}"
            rec["traceback"] = traceback.format_exc()[-4000:]
            log(f"!! {name} failed: {rec['error']}")
        finally:
            rec["seconds"] = round(time.perf_counter() - t0, 2)
            log(f"<< {name} ({rec['seconds']} s, {'ok' if rec['ok'] else 'FAILED'})")
            self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        tmp.replace(self.path)


def versions() -> dict:
    import torch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "device": DEVICE,
    }
    for name in ("transformers", "vllm", "peft"):
        try:
            out[name] = __import__(name).__version__
        except Exception as exc:
            out[name] = f"unavailable ({type(exc).__name__})"
    try:
        out["mrtpo_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except Exception:
        out["mrtpo_commit"] = None
    return out


NOTES = [
    "trainer: a REINFORCE step with AdamW on seeded random rewards, written in this "
    "script so each sync can be inspected; src/train.py rollout=vllm runs in trainer_smoke",
    "vLLM computes in bf16, the trainer in fp32 (and bf16 autocast): small differences "
    "are expected; the stale-weights control shows what a missed sync would look like",
]


def run_check(args, report: Report) -> None:
    import torch

    data = report.data
    state: dict = {}

    data["notes"] = NOTES
    with report.stage("environment") as st:
        data["env"] = versions()
        if DEVICE == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
    if not st["ok"]:
        return

    workdir = Path(args.workdir)
    with report.stage("build_model") as st:
        _build_model(args, data, state, workdir)
    if not st["ok"]:
        return
    tok, model, eos_ids = state["tok"], state["model"], state["eos_ids"]

    with report.stage("vllm_start") as st:
        _start_vllm(args, data, state, workdir)
    engine = state.get("engine")

    if engine is not None:
        with report.stage("throughput"):
            _throughput(args, report, engine, model, tok, eos_ids)

        with report.stage("train_and_sync_check"):
            run_sync_checks(args, report, engine, model, tok, eos_ids)

    if args.trainer_smoke:
        with report.stage("trainer_smoke"):
            run_trainer_smoke(args, report, tok, workdir)


def _build_model(args, data: dict, state: dict, workdir: Path) -> None:
    """The random Qwen2.5-0.5B-shaped checkpoint vLLM starts from, and the trainer's copy."""
    tok = build_tokenizer()
    model, calibration = build_checkpoint(
        workdir / "qwen25-05b-random", tok, QWEN25_05B, args.eos_target, None
    )
    state.update(tok=tok, model=model, eos_ids=eos_ids_of(tok, model))
    data["model"] = {
        "shape": "Qwen2.5-0.5B (random init, config only)",
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokenizer_size": len(tok),
        "eos_ids": state["eos_ids"],
        "eos_calibration": calibration,
        "trainer_dtype": "float32",
        "path": str(workdir / "qwen25-05b-random"),
    }


def _start_vllm(args, data: dict, state: dict, workdir: Path) -> None:
    """The project's ``VLLMEngine`` bound to the trainer's model (``state["engine"]``), with
    sleep mode when asked and, if vLLM refuses it, without."""
    from mrtpo.rollout.vllm import VLLMEngine

    tok, model, eos_ids = state["tok"], state["model"], state["eos_ids"]

    def start(sleep_mode: bool):
        eng = VLLMEngine(
            model=str(workdir / "qwen25-05b-random"),
            gpu_memory_utilization=args.gpu_memory_utilization,
            dtype="bfloat16",
            max_model_len=1024,
            seed=0,
            enable_sleep_mode=sleep_mode,
            enforce_eager=args.enforce_eager,
            # the random model's 152k vocabulary is larger than the 1k tokenizer's, and
            # the engine returns token ids only
            engine_kwargs={"skip_tokenizer_init": True},
        )
        eng.bind(model, tok, eos_ids)  # starts vLLM; the first generate syncs weights
        return eng

    try:
        state["engine"] = engine = start(args.sleep_mode)
    except Exception as exc:
        if not args.sleep_mode:
            raise
        data["sleep_mode_start_error"] = f"{type(exc).__name__}: {exc}"
        log(f"vLLM did not start with sleep mode ({exc}); retrying without it")
        state["engine"] = engine = start(False)
    data["engine"] = {
        "startup_seconds": round(engine.startup_seconds or 0.0, 2),
        "weight_sync_mode": engine.weight_sync.mode if engine.weight_sync else None,
        "sleep_mode": engine.enable_sleep_mode,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enforce_eager": args.enforce_eager,
    }


def _throughput(args, report: Report, engine, model, tok, eos_ids) -> None:
    """Tokens/s of vLLM, then of the project's HF engine on the same prompts and sampling."""
    from mrtpo.rollout.base import SamplingConfig

    data = report.data
    prompts = make_prompts(tok, args.tp_prompts, seed=1)
    samp = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=args.tp_max_new)
    engine.generate(
        prompts[:4], 2, SamplingConfig(max_new_tokens=16), seed=0
    )  # warm-up + first sync
    if engine.last_sync is not None:
        s = engine.last_sync
        data["engine"]["initial_sync"] = {
            "seconds": round(s.seconds, 3),
            "tensors": s.num_tensors,
            "mb": round(s.num_bytes / 2**20, 1),
        }
    tp = {
        "prompts": len(prompts),
        "n": args.tp_n,
        "max_new_tokens": args.tp_max_new,
        "vllm": _timed_generation(engine, prompts, args.tp_n, samp, eos_ids),
    }
    data["throughput"] = tp
    report.write()
    tp["hf"] = _hf_throughput(args, model, tok, eos_ids, prompts, samp)
    tp["ratio_vllm_over_hf"] = round(tp["vllm"]["tokens_per_s"] / tp["hf"]["tokens_per_s"], 2)
    _cuda_empty_cache()


def _timed_generation(engine, prompts, n: int, samp, eos_ids) -> dict:
    _cuda_sync()
    t0 = time.perf_counter()
    gens = engine.generate(prompts, n, samp, seed=1)
    _cuda_sync()
    sec = time.perf_counter() - t0
    tokens = sum(len(g.token_ids) for g in gens)
    return {
        "tokens": tokens,
        "seconds": round(sec, 3),
        "tokens_per_s": round(tokens / sec, 1),
        **gen_stats(gens, eos_ids),
    }


def _hf_throughput(args, model, tok, eos_ids, prompts, samp) -> dict:
    """The HF engine on a bf16 copy of the model, in one batch (the copy is dropped after)."""
    import copy

    import torch

    from mrtpo.rollout.base import SamplingConfig

    hf_model = copy.deepcopy(model).to(torch.bfloat16).eval()
    try:
        from mrtpo.rollout.hf import HFEngine

        hf = HFEngine(batch_size=len(prompts) * args.tp_n)
        hf.bind(hf_model, tok, eos_ids)
        hf_name = "mrtpo.rollout.hf.HFEngine (bf16 copy, one batch)"
    except Exception as exc:
        raise RuntimeError(f"mrtpo.rollout.hf.HFEngine unavailable: {exc}") from exc
    hf.generate(prompts[:4], 2, SamplingConfig(max_new_tokens=8), seed=0)  # warm-up
    return {"engine": hf_name, **_timed_generation(hf, prompts, args.tp_n, samp, eos_ids)}


def run_sync_checks(args, report, engine, model, tok, eos_ids) -> None:
    import torch

    from mrtpo.rollout.base import SamplingConfig

    data = report.data
    prompts = make_prompts(tok, args.check_prompts, seed=2)
    group = args.check_n
    flat_prompts = [p for p in prompts for _ in range(group)]
    samp = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=args.check_max_new)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    checks: list[dict] = []
    data["sync_checks"] = checks
    old_values = None
    for k in range(args.steps + 1):
        entry: dict = {"sync": k, "after": "initial sync" if k == 0 else f"optimizer step {k}"}
        if k > 0 and engine.last_sync is not None:
            s = engine.last_sync
            entry["sync_stats"] = {
                "mode": s.mode,
                "seconds": round(s.seconds, 3),
                "tensors": s.num_tensors,
                "mb": round(s.num_bytes / 2**20, 1),
            }
        gens = _compare_logprobs(
            entry, engine, model, tok, (prompts, group, samp), eos_ids, old_values
        )
        checks.append(entry)
        _log_sync(k, entry)
        report.write()
        if k == args.steps:
            break
        engine.sleep()  # update phase (a no-op without sleep mode)
        old_values = [p.detach().clone() for p in model.parameters()]
        entry["update"] = pg_step(model, opt, tok, flat_prompts, gens, group, seed=k)
        entry["update"]["param_max_abs_change"] = round(
            max(
                float((p.detach() - o).abs().max()) for p, o in zip(model.parameters(), old_values)
            ),
            8,
        )
        engine.sync_weights(model)  # wakes the engine first when it sleeps

    if engine.enable_sleep_mode:
        data["after_sleep_wake_cycle"] = _after_sleep_wake(engine, model, tok, prompts, group, samp)
    data["finished_without_eos"] = engine.finished_without_eos
    summarize(args, data)


def _sample(engine, prompts, group, samp, seed):
    """(generations, vLLM's log-prob of each sampled token) from the engine's own generate,
    which attaches them at these settings (temperature 1, no truncation)."""
    gens = engine.generate(prompts, group, samp, seed)
    if any(g.logprobs is None for g in gens):
        raise RuntimeError(f"vLLM reported no sampled-token log-probs at {samp}")
    return gens, [g.logprobs for g in gens]


def _compare_logprobs(entry, engine, model, tok, sampling, eos_ids, old_values):
    """Sample with vLLM's log-probs, put the samples' statistics and the differences from the
    trainer's log-probs (fp32, bf16 autocast, and the weights before the step when given) in
    ``entry``; return the samples."""
    prompts, group, samp = sampling
    flat_prompts = [p for p in prompts for _ in range(group)]
    gens, v_lp = _sample(engine, prompts, group, samp, seed=1000 + entry["sync"])
    responses = [g.token_ids for g in gens]
    entry["samples"] = gen_stats(gens, eos_ids)
    entry["trainer_fp32"] = diff_stats(v_lp, trainer_logprobs(model, tok, flat_prompts, responses))
    entry["trainer_bf16_autocast"] = diff_stats(
        v_lp, trainer_logprobs(model, tok, flat_prompts, responses, bf16=True)
    )
    if old_values is not None:
        with swapped_params(model, old_values):
            stale = trainer_logprobs(model, tok, flat_prompts, responses)
        entry["stale_control_fp32"] = diff_stats(v_lp, stale)
    return gens


def _log_sync(k: int, entry: dict) -> None:
    log(
        f"sync {k}: |vLLM - trainer| mean {entry['trainer_fp32'].get('mean_abs')} "
        f"max {entry['trainer_fp32'].get('max_abs')}"
        + (
            f"; stale weights mean {entry['stale_control_fp32'].get('mean_abs')}"
            if "stale_control_fp32" in entry
            else ""
        )
    )


def _after_sleep_wake(engine, model, tok, prompts, group, samp) -> dict:
    """The reported colocated failure: weights synced, engine put to sleep and woken, and
    generation silently back on the weights it had before the sync."""
    flat_prompts = [p for p in prompts for _ in range(group)]
    engine.sleep()
    engine.wake_up()
    gens, v_lp = _sample(engine, prompts, group, samp, seed=2000)
    return {
        "trainer_fp32": diff_stats(
            v_lp, trainer_logprobs(model, tok, flat_prompts, [g.token_ids for g in gens])
        )
    }


def summarize(args, data) -> None:
    checks = data.get("sync_checks") or []
    after = [c for c in checks if c["sync"] > 0]
    verdict = {"tolerance_mean_abs": args.tol_mean, "syncs_checked": len(after)}
    ok = len(after) == args.steps
    for c in checks:
        mean = c["trainer_fp32"].get("mean_abs")
        c["within_tolerance"] = mean is not None and mean <= args.tol_mean
        ok = ok and c["within_tolerance"]
        if "stale_control_fp32" in c:
            stale = c["stale_control_fp32"].get("mean_abs") or 0.0
            c["closer_to_new_than_old_weights"] = mean is not None and mean < stale
            ok = ok and c["closer_to_new_than_old_weights"]
    if "after_sleep_wake_cycle" in data:
        mean = data["after_sleep_wake_cycle"]["trainer_fp32"].get("mean_abs")
        data["after_sleep_wake_cycle"]["within_tolerance"] = (
            mean is not None and mean <= args.tol_mean
        )
        ok = ok and data["after_sleep_wake_cycle"]["within_tolerance"]
    verdict["pass"] = ok
    data["agreement"] = verdict


def run_trainer_smoke(args, report, tok, workdir: Path) -> None:
    """``src/train.py rollout=vllm`` for a few steps on a small checkpoint (a subprocess)."""
    train_py = ROOT / "src" / "train.py"
    if not train_py.exists():
        raise FileNotFoundError("src/train.py is missing")
    smoke_dir = workdir / "smoke-qwen2"
    model, _ = build_checkpoint(smoke_dir, tok, SMOKE_SHAPE, None, vocab_size=len(tok))
    del model

    _cuda_empty_cache()
    cmd = [
        sys.executable,
        str(train_py),
        "model=tiny",
        f"model.name_or_path={smoke_dir}",
        "model.tiny=null",
        "rollout=vllm",
        "trainer=gpu",
        f"trainer.max_steps={args.steps}",
        "rollout.engine.gpu_memory_utilization=0.15",
        "rollout.engine.max_model_len=2048",
        "rollout.sampling.max_new_tokens=64",
        "callbacks=none",
        "print_config=false",
        "logger=csv",
        f"paths.log_dir={workdir / 'smoke-logs'}",
    ]
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.smoke_timeout, env=env
        )
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:  # its captured output arrives as bytes
        rc = "timeout"
        output = _text(exc.stdout) + _text(exc.stderr)
    report.data["trainer_smoke"] = {
        "command": " ".join(cmd[1:]),
        "returncode": rc,
        "seconds": round(time.perf_counter() - t0, 1),
        "output_tail": output[-6000:],
    }
    if rc != 0:
        raise RuntimeError(f"src/train.py rollout=vllm exited with {rc}")


def _cuda_sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _cuda_empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _text(x) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default_out = (
        Path(os.environ["OUT"]) / "vllm_check.json"
        if os.environ.get("OUT")
        else ROOT / "docs/gpu/vllm_check.json"
    )
    ap.add_argument("--out", type=Path, default=default_out)
    ap.add_argument("--workdir", default=str(ROOT / ".cache" / "gpu_check"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument(
        "--eos-target",
        type=float,
        default=0.5,
        help="share of the random model's 64-token continuations that should end with EOS",
    )
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--sleep-mode", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--check-prompts", type=int, default=8)
    ap.add_argument("--check-n", type=int, default=4)
    ap.add_argument("--check-max-new", type=int, default=128)
    ap.add_argument("--tp-prompts", type=int, default=32)
    ap.add_argument("--tp-n", type=int, default=8)
    ap.add_argument("--tp-max-new", type=int, default=256)
    ap.add_argument(
        "--tol-mean",
        type=float,
        default=0.05,
        help="largest mean |vLLM - trainer| log-prob difference that passes",
    )
    ap.add_argument("--trainer-smoke", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--smoke-timeout", type=int, default=240)
    args = ap.parse_args()

    report = Report(args.out, args)
    t0 = time.perf_counter()
    try:
        run_check(args, report)
    except Exception as exc:  # anything outside a stage
        report.data["error"] = f"{type(exc).__name__}: {exc}"
        report.data["traceback"] = traceback.format_exc()[-4000:]
    stages = report.data["stages"]
    all_ok = bool(stages) and all(s["ok"] for s in stages.values())
    passed = (report.data.get("agreement") or {}).get("pass", False)
    report.data["status"] = "ok" if all_ok and passed else "partial" if stages else "failed"
    report.data["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    report.data["total_seconds"] = round(time.perf_counter() - t0, 1)
    report.write()
    tp = report.data.get("throughput", {})
    log(
        f"status {report.data['status']}; agreement {report.data.get('agreement')}; "
        f"tokens/s vLLM/HF {tp.get('ratio_vllm_over_hf')}; report {args.out}"
    )
    return 0 if report.data["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
