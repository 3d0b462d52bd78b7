"""The pieces of the vLLM check (``benchmarks.gpu_vllm``) that build and measure: the random
checkpoint and its EOS calibration, prompts, the trainer's log-probs, a REINFORCE step, and
the statistics that compare two sets of log-probs or samples."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

# Words for filler text: the synthetic task's vocabulary (one list in the project).
from mrtpo.tasks.synthetic.task import WORDS

# "cpu" only for rehearsing this script's plumbing without a GPU (vLLM needs CUDA).
DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


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
    import torch

    from mrtpo.core.forward import response_logits

    emb = model.get_input_embeddings().weight
    eos = tok.eos_token_id
    row = emb[eos].detach().clone()
    p_ids, p_mask, r_ids, r_mask = _own_continuations(model, tok, cont)
    tried: dict[float, float] = {}

    def finish_prob(c: float) -> float:
        with torch.no_grad():
            emb[eos] = row * c
            logits = response_logits(model, p_ids, p_mask, r_ids, r_mask)
            p = torch.softmax(logits.float(), -1)[..., eos]  # [n, cont]
        tried[c] = float((1 - torch.prod(1 - p, dim=-1)).mean())
        return tried[c]

    _search_scale(finish_prob, target)
    best = min(tried, key=lambda c: abs(tried[c] - target))
    with torch.no_grad():
        emb[eos] = row * best
    return {
        "target_finish_within": {"tokens": cont, "share": target},
        "scale": round(best, 4),
        "finish_share": round(tried[best], 4),
        "tried": {f"{k:.3f}": round(v, 4) for k, v in sorted(tried.items())},
    }


def _own_continuations(model, tok, cont: int):
    """16 prompts and ``cont`` tokens the model samples after each (EOS blocked), padded:
    ``(prompt ids, prompt mask, response ids, response mask)``."""
    import torch

    from mrtpo.core.forward import pad_left, pad_right

    device = model.get_input_embeddings().weight.device
    eos = tok.eos_token_id
    prompts = make_prompts(tok, 16, seed=3)
    p_ids, p_mask = pad_left(prompts, tok.pad_token_id)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            input_ids=p_ids.to(device),
            attention_mask=p_mask.long().to(device),
            do_sample=True,
            top_k=0,
            max_new_tokens=cont,
            min_new_tokens=cont,
            eos_token_id=eos,
            pad_token_id=tok.pad_token_id,
        )
    r_ids, r_mask = pad_right(out[:, p_ids.shape[1] :].cpu().tolist(), tok.pad_token_id)
    return p_ids, p_mask, r_ids, r_mask


def _search_scale(finish_prob, target: float) -> None:
    """Scan both signs of the EOS row's scale for the first that reaches ``target``, then
    bisect that bracket (geometrically); ``finish_prob`` records every scale it is given."""
    import math

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
