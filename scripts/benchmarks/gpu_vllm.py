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
# "cpu" only for rehearsing this script's plumbing without a GPU (vLLM needs CUDA).
DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")

SMOKE_SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
# Words for filler text: the synthetic task's vocabulary (one list in the project).
from mrtpo.tasks.synthetic.task import WORDS  # noqa: E402


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


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


def build_tokenizer():
    """The project's byte-level tokenizer; an inline equivalent if that is not available."""
    try:
        from mrtpo.core.models import build_tokenizer as project_builder

        return project_builder(1024)
    except Exception as exc:
        log(f"mrtpo.core.models.build_tokenizer unavailable ({exc}); training one inline")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([" ".join(WORDS)] * 8, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
        "'<|im_end|>' + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    return fast


def make_prompts(tok, count: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16)))
        msgs = [{"role": "user", "content": f"Write about: {text}"}]
        rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        out.append(list(tok(rendered, add_special_tokens=False)["input_ids"]))
    return out


def build_checkpoint(
    path: Path, tok, shape: dict, eos_target: float | None, vocab_size: int | None
):
    """Random Qwen2 on the GPU, saved in bf16; returns (fp32 model with the same values,
    EOS calibration or None)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        **{**shape, "vocab_size": vocab_size or shape.get("vocab_size") or len(tok)},
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.device(DEVICE):
        model = Qwen2ForCausalLM(cfg)
    calibration = calibrate_eos(model, tok, eos_target) if eos_target else None
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    model.to(torch.float32)  # bf16 values are exact in fp32: trainer == checkpoint
    return model, calibration


def calibrate_eos(model, tok, target: float, cont: int = 64) -> dict:
    """Scale the EOS embedding row until about ``target`` of the model's own continuations
    would end within ``cont`` tokens.

    A random model almost never samples one given token out of 150k, so without this no
    response would finish and neither the finished flag nor the EOS token would be
    checked. The model first samples ``cont`` tokens per prompt (EOS blocked); for a
    candidate factor, a forward pass over those sequences gives P(EOS) at every position
    and so the chance each continuation would have stopped. The row is tied to the LM head
    and its sign relative to the hidden states is arbitrary: both signs are scanned, then
    the first bracket is bisected.
    """
    import math

    import torch

    from mrtpo.core.forward import pad_left, pad_right, response_logits

    emb = model.get_input_embeddings().weight
    eos = tok.eos_token_id
    row = emb[eos].detach().clone()
    prompts = make_prompts(tok, 16, seed=3)
    p_ids, p_mask = pad_left(prompts, tok.pad_token_id)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            input_ids=p_ids.to(emb.device),
            attention_mask=p_mask.long().to(emb.device),
            do_sample=True,
            top_k=0,
            max_new_tokens=cont,
            min_new_tokens=cont,
            eos_token_id=eos,
            pad_token_id=tok.pad_token_id,
        )
    r_ids, r_mask = pad_right(out[:, p_ids.shape[1] :].cpu().tolist(), tok.pad_token_id)
    tried: dict[float, float] = {}

    def finish_prob(c: float) -> float:
        with torch.no_grad():
            emb[eos] = row * c
            logits = response_logits(model, p_ids, p_mask, r_ids, r_mask)
            p = torch.softmax(logits.float(), -1)[..., eos]  # [n, cont]
        tried[c] = float((1 - torch.prod(1 - p, dim=-1)).mean())
        return tried[c]

    bracket = None
    for sign in (1.0, -1.0):
        low = 0.0
        for mag in (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0):
            if finish_prob(sign * mag) >= target:
                bracket = (sign * (low or mag / 2), sign * mag)
                break
            low = mag
        if bracket is not None:
            break
    if bracket is not None:
        lo, hi = bracket
        for _ in range(5):
            mid = math.copysign(math.sqrt(abs(lo * hi)), hi)
            if finish_prob(mid) >= target:
                hi = mid
            else:
                lo = mid
    best = min(tried, key=lambda c: abs(tried[c] - target))
    with torch.no_grad():
        emb[eos] = row * best
    return {
        "target_finish_within": {"tokens": cont, "share": target},
        "scale": round(best, 4),
        "finish_share": round(tried[best], 4),
        "tried": {f"{k:.3f}": round(v, 4) for k, v in sorted(tried.items())},
    }


def eos_ids_of(tok, model) -> list[int]:
    try:
        from mrtpo.core.models import eos_token_ids

        return eos_token_ids(tok, model)
    except Exception:
        return [int(tok.eos_token_id)]


def trainer_logprobs(model, tok, prompts, responses, micro: int = 8, bf16: bool = False):
    """The trainer's log-probs of each response token (the project's forward pass)."""
    import torch

    try:
        from mrtpo.core.forward import pad_left, pad_right, response_logprobs
    except Exception:
        response_logprobs = None
    out: list[list[float]] = []
    was_training = model.training
    model.eval()
    try:
        for s in range(0, len(prompts), micro):
            ps, rs = prompts[s : s + micro], responses[s : s + micro]
            with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=bf16):
                if response_logprobs is not None:
                    p_ids, p_mask = pad_left(ps, tok.pad_token_id)
                    r_ids, r_mask = pad_right(rs, tok.pad_token_id)
                    lp = response_logprobs(model, p_ids, p_mask, r_ids, r_mask).float().cpu()
                    out.extend(lp[i, : len(r)].tolist() for i, r in enumerate(rs))
                    continue
                for p, r in zip(ps, rs):  # fallback: one sequence at a time
                    ids = torch.tensor([p + r], device=DEVICE)
                    logits = model(input_ids=ids).logits[0, len(p) - 1 : len(p) - 1 + len(r)]
                    lp = torch.log_softmax(logits.float(), -1)
                    tgt = torch.tensor(r, device=DEVICE)[:, None]
                    out.append(lp.gather(-1, tgt).squeeze(-1).tolist())
    finally:
        model.train(was_training)
    return out


@contextlib.contextmanager
def swapped_params(model, values):
    """Temporarily give ``model`` other parameter values (no copies: data pointers swap)."""
    params = list(model.parameters())
    saved = [p.data for p in params]
    for p, v in zip(params, values):
        p.data = v
    try:
        yield
    finally:
        for p, v in zip(params, saved):
            p.data = v


def diff_stats(a: list[list[float]], b: list[list[float]]) -> dict:
    import torch

    x = torch.tensor([v for row in a for v in row], dtype=torch.float64)
    y = torch.tensor([v for row in b for v in row], dtype=torch.float64)
    if x.numel() == 0:
        return {"tokens": 0}
    d = (x - y).abs()
    return {
        "tokens": int(d.numel()),
        "max_abs": round(float(d.max()), 6),
        "mean_abs": round(float(d.mean()), 6),
        "p99_abs": round(float(torch.quantile(d, 0.99)) if d.numel() > 1 else float(d[0]), 6),
        "mean_logprob_engine": round(float(x.mean()), 4),
    }


def gen_stats(gens, eos_ids) -> dict:
    finished = [g for g in gens if g.finished]
    return {
        "samples": len(gens),
        "mean_len": round(sum(len(g.token_ids) for g in gens) / max(1, len(gens)), 2),
        "finished_frac": round(len(finished) / max(1, len(gens)), 4),
        # vLLM keeps the stop token in token_ids; every finished sample must end with EOS
        "finished_ending_in_eos_frac": (
            round(
                sum(g.token_ids[-1] in eos_ids for g in finished if g.token_ids) / len(finished), 4
            )
            if finished
            else None
        ),
    }


def pg_step(model, opt, tok, prompts, gens, group: int, seed: int) -> dict:
    """One REINFORCE step with group-centred rewards.

    The rewards are seeded random numbers: the step changes the policy (so the stale-weights
    control has something to tell apart) without steering it anywhere. A consistent reward
    (ending with EOS) collapsed a random model onto EOS in a single step in a rehearsal,
    leaving nothing to compare afterwards.
    """
    import torch

    from mrtpo.core.forward import pad_left, pad_right, response_logprobs

    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(len(gens), generator=g).view(-1, group)
    adv = (rewards - rewards.mean(dim=1, keepdim=True)).flatten()
    total = max(1, sum(len(g.token_ids) for g in gens))
    model.train()
    opt.zero_grad(set_to_none=True)
    micro = 8
    for s in range(0, len(gens), micro):
        rs = [g.token_ids for g in gens[s : s + micro]]
        p_ids, p_mask = pad_left(prompts[s : s + micro], tok.pad_token_id)
        r_ids, r_mask = pad_right(rs, tok.pad_token_id)
        lp = response_logprobs(model, p_ids, p_mask, r_ids, r_mask)
        a = adv[s : s + micro].to(lp.device)
        loss = -(a[:, None] * lp).sum() / total
        loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {"reward_mean": round(float(rewards.mean()), 4), "grad_norm": round(grad_norm, 4)}


def run_check(args, report: Report) -> None:
    import torch

    from mrtpo.rollout.base import SamplingConfig

    data = report.data
    state: dict = {}

    data["notes"] = [
        "trainer: a REINFORCE step with AdamW on seeded random rewards, written in this "
        "script so each sync can be inspected; src/train.py rollout=vllm runs in trainer_smoke",
        "vLLM computes in bf16, the trainer in fp32 (and bf16 autocast): small differences "
        "are expected; the stale-weights control shows what a missed sync would look like",
    ]
    with report.stage("environment") as st:
        data["env"] = versions()
        if DEVICE == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
    if not st["ok"]:
        return

    workdir = Path(args.workdir)
    with report.stage("build_model") as st:
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
    if not st["ok"]:
        return
    tok, model, eos_ids = state["tok"], state["model"], state["eos_ids"]

    engine = None
    with report.stage("vllm_start") as st:
        from mrtpo.rollout.vllm import VLLMEngine

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
            engine = start(args.sleep_mode)
        except Exception as exc:
            if not args.sleep_mode:
                raise
            data["sleep_mode_start_error"] = f"{type(exc).__name__}: {exc}"
            log(f"vLLM did not start with sleep mode ({exc}); retrying without it")
            engine = start(False)
        data["engine"] = {
            "startup_seconds": round(engine.startup_seconds or 0.0, 2),
            "weight_sync_mode": engine.weight_sync.mode if engine.weight_sync else None,
            "sleep_mode": engine.enable_sleep_mode,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "enforce_eager": args.enforce_eager,
        }

    if engine is not None:
        with report.stage("throughput"):
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
            _cuda_sync()
            t0 = time.perf_counter()
            v_gens = engine.generate(prompts, args.tp_n, samp, seed=1)
            _cuda_sync()
            v_sec = time.perf_counter() - t0
            v_tok = sum(len(g.token_ids) for g in v_gens)
            tp = {
                "prompts": len(prompts),
                "n": args.tp_n,
                "max_new_tokens": args.tp_max_new,
                "vllm": {
                    "tokens": v_tok,
                    "seconds": round(v_sec, 3),
                    "tokens_per_s": round(v_tok / v_sec, 1),
                    **gen_stats(v_gens, eos_ids),
                },
            }
            data["throughput"] = tp
            report.write()

            import copy

            hf_model = copy.deepcopy(model).to(torch.bfloat16).eval()
            try:
                from mrtpo.rollout.hf import HFEngine

                hf = HFEngine(batch_size=len(prompts) * args.tp_n)
                hf.bind(hf_model, tok, eos_ids)
                hf_name = "mrtpo.rollout.hf.HFEngine (bf16 copy, one batch)"
            except Exception as exc:
                raise RuntimeError(f"mrtpo.rollout.hf.HFEngine unavailable: {exc}") from exc
            hf.generate(prompts[:4], 2, SamplingConfig(max_new_tokens=8), seed=0)  # warm-up
            _cuda_sync()
            t0 = time.perf_counter()
            h_gens = hf.generate(prompts, args.tp_n, samp, seed=1)
            _cuda_sync()
            h_sec = time.perf_counter() - t0
            h_tok = sum(len(g.token_ids) for g in h_gens)
            tp["hf"] = {
                "engine": hf_name,
                "tokens": h_tok,
                "seconds": round(h_sec, 3),
                "tokens_per_s": round(h_tok / h_sec, 1),
                **gen_stats(h_gens, eos_ids),
            }
            tp["ratio_vllm_over_hf"] = round(
                tp["vllm"]["tokens_per_s"] / tp["hf"]["tokens_per_s"], 2
            )
            del hf, hf_model
            _cuda_empty_cache()

        with report.stage("train_and_sync_check"):
            run_sync_checks(args, report, engine, model, tok, eos_ids)

    if args.trainer_smoke:
        with report.stage("trainer_smoke"):
            run_trainer_smoke(args, report, tok, workdir)


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
        gens, v_lp = engine.generate_with_logprobs(prompts, group, samp, seed=1000 + k)
        responses = [g.token_ids for g in gens]
        entry["samples"] = gen_stats(gens, eos_ids)
        entry["trainer_fp32"] = diff_stats(
            v_lp, trainer_logprobs(model, tok, flat_prompts, responses)
        )
        entry["trainer_bf16_autocast"] = diff_stats(
            v_lp, trainer_logprobs(model, tok, flat_prompts, responses, bf16=True)
        )
        if old_values is not None:
            with swapped_params(model, old_values):
                stale = trainer_logprobs(model, tok, flat_prompts, responses)
            entry["stale_control_fp32"] = diff_stats(v_lp, stale)
        checks.append(entry)
        log(
            f"sync {k}: |vLLM - trainer| mean {entry['trainer_fp32'].get('mean_abs')} "
            f"max {entry['trainer_fp32'].get('max_abs')}"
            + (
                f"; stale weights mean {entry['stale_control_fp32'].get('mean_abs')}"
                if "stale_control_fp32" in entry
                else ""
            )
        )
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
        # The reported colocated failure: weights synced, engine put to sleep and woken,
        # and generation silently back on the weights it had before the sync.
        engine.sleep()
        engine.wake_up()
        gens, v_lp = engine.generate_with_logprobs(prompts, group, samp, seed=2000)
        data["after_sleep_wake_cycle"] = {
            "trainer_fp32": diff_stats(
                v_lp, trainer_logprobs(model, tok, flat_prompts, [g.token_ids for g in gens])
            )
        }
    data["finished_without_eos"] = engine.finished_without_eos
    summarize(args, data)


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
