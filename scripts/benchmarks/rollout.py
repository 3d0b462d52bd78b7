"""Section 5: sampled tokens/s of ``rollout=vllm`` against ``rollout=hf`` on the same prompts,
and what a weight sync into vLLM costs.

Both engines are the project's own (``mrtpo.rollout.hf.HFEngine`` and
``mrtpo.rollout.vllm.VLLMEngine``), bound to the same policy in one process: vLLM's CPU build
on a CPU, its CUDA build on a GPU. For each model size, group size G and prompt shape, the
engines take turns round by round (the one that goes first alternates), and each round's
tokens/s is the number of tokens sampled (EOS included, so early stops count as what they
cost) over its wall time. Ratios are paired by round, then the median is taken.

Before every vLLM round the trainer's weights are pushed again, as after an optimizer step:
that resets vLLM's prefix cache, so a round never reuses the previous round's prompt blocks
(a training step would not either). Inside a round the cache works as in training: the G
samples of a prompt share its blocks, and a long preamble common to every prompt is computed
once. The sync itself is timed apart and reported per MB of parameters.

Prompt shapes: ``short`` (a few dozen tokens each, nothing shared across prompts) and
``long`` (a preamble shared by every prompt plus a short distinct tail, like a system prompt
with a task's schema). With ``prefix_off`` the long shape is also timed on a second vLLM
engine without prefix caching, which shows what the cache is worth.
"""

from __future__ import annotations

import random
import time
from typing import Any

from benchmarks.common import ensure_model, iqr, med

#: Filler words for the prompts (the synthetic task's vocabulary: one list in the project).
from mrtpo.tasks.synthetic.task import WORDS


def make_prompts(tok, count: int, length: int, shared: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens; the first ``shared`` are the same in all."""
    rng = random.Random(seed)

    def text_tokens(n: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            ids += tok.encode(
                " ".join(rng.choice(WORDS) for _ in range(64)), add_special_tokens=False
            )
        return ids[:n]

    preamble = text_tokens(shared)
    return [preamble + text_tokens(length - shared) for _ in range(count)]


def _timed(engine, prompts, group: int, sampling, seed: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    gens = engine.generate(prompts, group, sampling, seed)
    seconds = time.perf_counter() - t0
    if len(gens) != len(prompts) * group:
        raise RuntimeError(f"{type(engine).__name__} returned {len(gens)} samples")
    return seconds, sum(len(g.token_ids) for g in gens)


def _start_vllm(path, model, tok, eos, *, prefix: bool, max_len: int):
    from mrtpo.rollout.vllm import VLLMEngine

    engine = VLLMEngine(str(path), seed=0, enable_prefix_caching=prefix, max_model_len=max_len)
    t0 = time.perf_counter()
    engine.bind(model, tok, eos)
    return engine, time.perf_counter() - t0


def compare(engines: dict[str, Any], model, prompts, group: int, sampling, rounds: int) -> dict:
    """Alternate the engines ``rounds`` times on the same work (after one untimed warm-up
    each); vLLM engines get the weights pushed before each round, timed apart."""
    rate: dict[str, list[float]] = {k: [] for k in engines}
    syncs: list[dict[str, float]] = []
    for engine in engines.values():  # warm-up: first-call allocations, kernels
        _timed(engine, prompts, group, sampling, seed=999)
    for r in range(rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            engine = engines[name]
            if name != "hf":
                engine.sync_weights(model)
                s = engine.last_sync
                syncs.append({"seconds": s.seconds, "mb": s.num_bytes / 2**20, "mode": s.mode})
            seconds, tokens = _timed(engine, prompts, group, sampling, seed=r)
            rate[name].append(tokens / seconds)
    out: dict[str, Any] = {"tokens_per_s": {k: med(v) for k, v in rate.items()}}
    out["tokens_per_s_iqr"] = {k: iqr(v) for k, v in rate.items()}
    out["rounds"] = rate
    out["ratio_vllm_over_hf"] = med([v / h for v, h in zip(rate["vllm"], rate["hf"])])
    if "vllm_no_prefix" in rate:
        pairs = zip(rate["vllm"], rate["vllm_no_prefix"])
        out["ratio_prefix_cache"] = med([a / b for a, b in pairs])
    out["syncs"] = syncs
    return out


def run(
    size: str,
    *,
    prompts: int,
    groups: list[int],
    new_tokens: int,
    shapes: dict[str, dict[str, int]],
    rounds: int,
    prefix_off: bool = True,
) -> dict[str, Any]:
    """One model size: every (shape, G) case, plus the weight-sync timings."""
    import torch

    from mrtpo.core.models import eos_token_ids, load_policy
    from mrtpo.rollout.base import SamplingConfig
    from mrtpo.rollout.hf import HFEngine

    path = ensure_model(size)
    model, tok = load_policy(str(path), tiny=None)
    model.eval()
    eos = eos_token_ids(tok, model)
    longest = max(s["length"] for s in shapes.values()) + new_tokens + 16
    hf = HFEngine(batch_size=max(groups) * prompts)
    hf.bind(model, tok, eos)
    engines: dict[str, Any] = {"hf": hf}
    engines["vllm"], start_s = _start_vllm(path, model, tok, eos, prefix=True, max_len=longest)
    if prefix_off:
        engines["vllm_no_prefix"], _ = _start_vllm(
            path, model, tok, eos, prefix=False, max_len=longest
        )
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens)
    params = sum(p.numel() for p in model.parameters())
    res: dict[str, Any] = {
        "size": size,
        "parameters": params,
        "prompts": prompts,
        "new_tokens": new_tokens,
        "rounds": rounds,
        "vllm_start_s": start_s,
        "threads": torch.get_num_threads(),
        "cases": [],
    }
    try:
        for shape, spec in shapes.items():
            batch = make_prompts(tok, prompts, spec["length"], spec["shared"], seed=len(shape))
            for group in groups:
                use = {k: v for k, v in engines.items() if k != "vllm_no_prefix" or spec["shared"]}
                with torch.no_grad():
                    case = compare(use, model, batch, group, sampling, rounds)
                res["cases"].append({"shape": shape, **spec, "group": group, **case})
    finally:
        for name, engine in engines.items():
            if name != "hf":
                engine.shutdown()
    res["sync"] = _sync_summary([s for c in res["cases"] for s in c.pop("syncs")])
    return res


def _sync_summary(syncs: list[dict[str, Any]]) -> dict[str, Any]:
    """The weight syncs of every case: mode, size, median seconds and seconds per MB."""
    return {
        "mode": syncs[0]["mode"] if syncs else None,
        "mb": syncs[0]["mb"] if syncs else None,
        "seconds": med([s["seconds"] for s in syncs]),
        "s_per_mb": med([s["seconds"] / s["mb"] for s in syncs]),
        "count": len(syncs),
    }


def print_result(res: dict[str, Any]) -> None:
    s = res["sync"]
    print(
        f"   {res['size']} ({res['parameters'] / 1e6:.2f}M params, {res['threads']} threads): "
        f"vLLM start {res['vllm_start_s']:.1f}s; sync {s['seconds'] * 1e3:.0f} ms for "
        f"{s['mb']:.1f} MB ({s['mode']})",
        flush=True,
    )
    for c in res["cases"]:
        t = c["tokens_per_s"]
        extra = (
            f", prefix cache x{c['ratio_prefix_cache']:.2f}" if "ratio_prefix_cache" in c else ""
        )
        print(
            f"     {c['shape']:>5} prompts ({c['length']} tokens), G={c['group']}: "
            f"HF {t['hf']:.0f} tok/s, vLLM {t['vllm']:.0f} tok/s "
            f"(x{c['ratio_vllm_over_hf']:.2f}{extra})",
            flush=True,
        )
