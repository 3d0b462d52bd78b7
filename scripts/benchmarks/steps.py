"""Sections 1 and 4: what replay adds to a training step, MRTPO against GDPO on the same work.

One Lightning run per case, built from the real configs. Every step trains on the *same*
scored rollout (generated once; a fresh generation is still run and timed each step, so the
rollout time is measured under the same load as the rest), and the method alternates
MRTPO, GDPO, GDPO, MRTPO, ... so that drift in machine load hits both alike. Rewards are
controlled (``benchmarks.common.controlled_task``) to fix the replayed share. After each MRTPO
step the same replays are run as plain no-grad forwards (the floor).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from benchmarks.common import (
    bench_dir,
    build_method,
    compose,
    controlled_task,
    ensure_model,
    med,
    model_overrides,
)
from mrtpo.core.forward import pad_left, response_logits
from mrtpo.lightning.callbacks.rollout import RolloutCallback
from mrtpo.rollout.build import build_rollout

PHASES = ("rollout", "reward", "old_logp", "replay", "update")


class FixedRollout(RolloutCallback):
    """Generates (and times) a rollout every step but trains on the first one each time."""

    fixed = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        roll = build_rollout(
            self.engine,
            pl_module.tokenizer,
            batch.examples,
            self.group_size,
            self.sampling,
            self._seed(trainer, pl_module, 0),
            self.eos_ids,
        )
        dt = time.perf_counter() - t0
        pl_module.timings["rollout_cpu"] = time.process_time() - c0
        if self.fixed is None:
            self.fixed = roll
        batch.rollout = self.fixed
        pl_module.timings["rollout"] = dt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def floor_time(
    replayer, model, task, scored, pairs, mode: str = "per_reward"
) -> tuple[float, float, int]:
    """Seconds of plain no-grad forwards over the replay's (context, response) sequences,
    packed as replay packs them; contexts are tokenized beforehand (not timed). ``mode``: the
    method's replay contexts (``"joint"``: one criteria-free context per response)."""
    jobs = replayer.plan(task, scored, pairs, mode)
    roll = scored.rollout
    batches = []
    tokens = 0
    for chunk in replayer._pack(jobs, roll.response_mask):
        rows = torch.tensor([j.response for j in chunk])
        rm = roll.response_mask[rows]
        t = max(1, int(rm.sum(-1).max()))
        ids, mask = pad_left([j.ids for j in chunk], replayer.tokenizer.pad_token_id)
        batches.append((ids, mask, roll.response_ids[rows, :t], rm[:, :t]))
        tokens += sum(len(j.ids) + int(roll.response_mask[j.response].sum()) for j in chunk)
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    _sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for b in batches:
            response_logits(model, *b)
    _sync(device)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    model.train(was)
    return dt, dc, tokens


def fuse_old_logp(module) -> None:
    """Replay run again *inside* the old-policy pass, for a noise check of the step's own
    order (replay before the old-policy pass, whose rows with P_all = P0 take replay's P_all
    log-probs): responses' old log-probs come from that replay, only the remaining rows run
    the old-policy pass, and the step's own replay then returns the same result. Toggle with
    ``module.fuse``."""
    from mrtpo.lightning.module import PolicyModule

    assert isinstance(module, PolicyModule)
    step = module.step
    score, logprobs = step.score, step.passes.logprobs

    def scored_first(rollout):
        module._scored, module._pre, module._pre_time = score(rollout), None, 0.0
        return module._scored

    def fused_logprobs(model, roll, micro):
        scored = module._scored
        if (
            not module.fuse
            or model is not step.policy
            or step.method.relevance is None
            or roll.n != scored.rollout.n  # the step's own rest-rows pass
        ):
            return logprobs(model, roll, micro)
        t0 = time.perf_counter()
        pairs = step.method.replay_pairs(scored.rewards, roll.group, step.has_info(scored))
        res = module._replayer.run(step.policy, step.task, scored, pairs, step.method.relevance)
        module._pre, module._pre_time = res, time.perf_counter() - t0
        out = res.logp.clone()
        rest = (~res.logp_rows).nonzero().flatten()
        if len(rest):
            out[rest] = logprobs(model, roll.select(rest), micro)
        return out

    class Cached:
        def __init__(self, module, inner):
            self.module, self.inner = module, inner

        def run(self, *args, **kwargs):
            pre = self.module._pre
            return pre if pre is not None else self.inner.run(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    step.score, step.passes.logprobs = scored_first, fused_logprobs
    module.fuse = False
    module._pre, module._pre_time = None, 0.0
    module._replayer = module.replayer
    module.replayer = Cached(module, module._replayer)


class TimedReplayer:
    """The module's replayer, also recording the CPU time of its last ``run``."""

    def __init__(self, inner) -> None:
        self.inner, self.last_cpu = inner, 0.0

    def run(self, *args, **kwargs):
        c0 = time.process_time()
        try:
            return self.inner.run(*args, **kwargs)
        finally:
            self.last_cpu = time.process_time() - c0

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Alternate(L.Callback):
    """Sets the variant before each step and records the step's timings after it."""

    def __init__(self, variants: dict[str, tuple], order: list[str], warmup: int, floor: bool):
        self.variants, self.order, self.warmup, self.floor = variants, order, warmup, floor
        self.records: list[dict[str, Any]] = []
        self.last_replayed = None  # the last scored batch of an MRTPO step (for profiling)

    def on_train_batch_start(self, trainer, module, batch, batch_idx: int) -> None:
        method, fused = self.variants[self.order[batch_idx]]
        module.method = method
        if hasattr(module, "fuse"):
            module.fuse = fused
        _sync(module.device)
        if module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(module.device)
        self.c0 = time.process_time()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx: int) -> None:
        _sync(module.device)
        cpu = time.process_time() - self.c0
        name = self.order[batch_idx]
        t = dict(module.timings)
        if getattr(module, "fuse", False) and module._pre is not None:
            # the replay ran inside the old-policy phase: book it as replay
            t["old_logp"] -= module._pre_time
            t["replay"] += module._pre_time
        scored = module.last
        rec: dict[str, Any] = {
            "step": batch_idx,
            "variant": name,
            "round": batch_idx // len(self.variants),
            "warmup": batch_idx < self.warmup,
        }
        rec.update({k: t.get(k, 0.0) for k in (*PHASES, "step")})
        rec["train"] = rec["step"] - rec["rollout"]  # everything but generation
        rec["other"] = rec["train"] - sum(rec[k] for k in PHASES[1:])  # advantages, logging
        # CPU seconds of this process (one torch thread: the work, whatever the load)
        rec["cpu_step"] = cpu
        rec["cpu_train"] = cpu - t.get("rollout_cpu", 0.0)
        rec["cpu_rollout"] = t.get("rollout_cpu", 0.0)
        if module.device.type == "cuda":
            rec["peak_gib"] = torch.cuda.max_memory_allocated(module.device) / 2**30
        mask = scored.rollout.response_mask
        rec["response_tokens"] = int(mask.sum())
        if scored.replayed is not None:
            mode = module.method.relevance.contexts
            if name.startswith("mrtpo"):
                self.last_replayed = scored
            # candidates: (response, reward) pairs, or responses for one joint context each
            present = (
                int((~scored.rewards.isnan()).sum()) if mode == "per_reward" else mask.shape[0]
            )
            rec["replayed_pairs"] = int(scored.replayed.sum())
            rec["share"] = rec["replayed_pairs"] / max(present, 1)
            rec["responses_replayed"] = int(scored.replayed.any(-1).sum())
            if self.floor and rec["replayed_pairs"] and not getattr(module, "fuse", False):
                replayer = getattr(module, "_replayer", module.replayer)
                rec["replay_cpu"] = module.replayer.last_cpu
                rec["floor"], rec["floor_cpu"], rec["replay_tokens"] = floor_time(
                    replayer, module.policy, module.task, scored, scored.replayed, mode
                )
        self.records.append(rec)


def _rl(module, key: str):
    """``module.rl``'s ``key``: a settings object (attributes) or, before that, a dict."""
    rl = module.rl
    return rl[key] if isinstance(rl, dict) else getattr(rl, key)


def step_order(labels: list[str], rounds: int) -> list[str]:
    """Every label once per round; the order rotates each round and reverses every other
    round, so no variant always follows the same one."""
    order: list[str] = []
    for r in range(rounds):
        rot = labels[r % len(labels) :] + labels[: r % len(labels)]
        order += rot if r % 2 == 0 else rot[::-1]
    return order


def alternate(
    trainer,
    module,
    dm,
    gdpo,
    share: float,
    order: list[str],
    warmup_pairs: int = 1,
    floor: bool = True,
    fused: bool = False,
    others: dict[str, Any] | None = None,
) -> Alternate:
    """Fit ``module`` (its method is MRTPO) for ``len(order)`` steps, switching between MRTPO,
    ``gdpo`` (/ the fused variant / the ``others`` methods, by name) as ``order`` says, on one
    fixed rollout, with rewards controlled to ``share``. The trainer's rollout callback is
    replaced by ``FixedRollout`` around the same engine. Returns the callback holding the
    per-step records."""
    module.task = controlled_task(module.task, share)
    module.replayer = TimedReplayer(module.replayer)
    variants = {"mrtpo": (module.method, False), "gdpo": (gdpo, False)}
    variants.update({name: (m, False) for name, m in (others or {}).items()})
    for name, (m, _) in variants.items():
        if name != "mrtpo":
            # with what the step lends its own method (OPSD builds its frozen teacher from
            # it, with the initial weights, as the module would have for that method)
            m.setup(module.task, module.step.method_services())
    if fused:
        fuse_old_logp(module)
        variants["mrtpo_fused"] = (module.method, True)
    for i, cb in enumerate(trainer.callbacks):
        if isinstance(cb, RolloutCallback):
            trainer.callbacks[i] = FixedRollout(
                cb.engine, sampling=vars(cb.sampling), group_size=cb.group_size
            )
    alt = Alternate(variants, order, len(variants) * warmup_pairs, floor)
    trainer.callbacks.insert(0, alt)
    trainer.fit(module, datamodule=dm)
    return alt


def run_case(
    size: str,
    *,
    prompts: int,
    group: int,
    rewards: int,
    new_tokens: int,
    share: float,
    pairs: int,
    warmup_pairs: int = 1,
    floor: bool = True,
    fused: bool = True,
    profile: bool = False,
    gpu: bool = False,
    extra: tuple[str, ...] = (),
    compare: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Rounds of MRTPO / GDPO (/ MRTPO with the proposed fused old-policy pass / the methods
    named in ``compare``, from their configs) steps on one fixed rollout, the order rotating
    every round; per-step records + summary."""
    ensure_model(size)
    others = {name: build_method(name) for name in compare}  # β schedules off
    labels = ["mrtpo", "gdpo", *others] + (["mrtpo_fused"] if fused else [])
    order = step_order(labels, pairs + warmup_pairs)
    run_dir = bench_dir() / "runs" / f"{size}-B{prompts}G{group}K{rewards}T{new_tokens}"
    overrides = _case_overrides(size, prompts, group, rewards, new_tokens, len(order), gpu)
    cfg = compose([*overrides, *extra], run_dir)
    from mrtpo.lightning.pipeline import build

    trainer, module, dm = build(cfg)
    alt = alternate(trainer, module, dm, build_method("gdpo"), share, order,
                    warmup_pairs, floor, fused, others)  # fmt: skip
    recs = alt.records
    # the last step may be GDPO's (the order rotates): profile the last MRTPO step's pairs
    prof = profile_replay(module, alt.last_replayed) if profile and alt.last_replayed else None
    return {
        "profile": prof,
        "case": {
            "model": size,
            "params_m": round(sum(p.numel() for p in module.policy.parameters()) / 1e6, 2),
            "vocab": int(module.policy.config.vocab_size),
            "B": prompts,
            "G": group,
            "K": rewards,
            "max_new_tokens": new_tokens,
            "target_share": share,
            "pairs": pairs,
            "micro_batch": int(_rl(module, "micro_batch_size")),
            "mini_batch": int(_rl(module, "mini_batch_size")),
        },
        "records": recs,
        "summary": summarize(recs),
    }


def _case_overrides(size, prompts, group, rewards, new_tokens, steps, gpu) -> list[str]:
    """The config of one case: MRTPO on the synthetic task, replay from the first step."""
    return [
        *model_overrides(size),
        "task=synthetic",
        f"task.num_constraints={rewards}",
        "method=mrtpo",
        "method.beta_warmup_steps=0",  # replay from the first step: the cost, not the schedule
        f"rl.prompts_per_step={prompts}",
        f"rl.group_size={group}",
        f"rollout.sampling.max_new_tokens={new_tokens}",
        f"trainer.max_steps={steps}",
        "++trainer.enable_progress_bar=false",
        "++trainer.enable_checkpointing=false",
        *(["trainer=gpu", "model.dtype=bf16"] if gpu else []),
    ]


def profile_replay(module, scored, reps: int = 3, top: int = 10) -> list[dict[str, Any]]:
    """cProfile of the replay of ``scored`` (an MRTPO step's batch, same pairs), top
    functions by own time."""
    import cProfile
    import pstats

    replayer = getattr(module, "_replayer", module.replayer)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        replayer.run(module.policy, module.task, scored, scored.replayed, "per_reward")
    prof.disable()
    st = pstats.Stats(prof)
    total = sum(v[2] for v in st.stats.values())
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    out = []
    for (file, line, fn), (_cc, nc, tt, _ct, _callers) in rows:
        where = fn if file == "~" else f"{Path(file).name}:{line}({fn})"
        out.append({"function": where, "calls": nc // reps, "share": tt / total})
    return out


def summarize(recs: list[dict[str, Any]]) -> dict[str, Any]:
    kept = [r for r in recs if not r["warmup"]]
    labels = list(dict.fromkeys(r["variant"] for r in recs))
    out: dict[str, Any] = {"variants": {}}
    by = {v: [r for r in kept if r["variant"] == v] for v in labels}
    for v, rs in by.items():
        d = {
            k: med([r[k] for r in rs])
            for k in (*PHASES, "other", "train", "step", "cpu_step", "cpu_train")
        }
        if any("peak_gib" in r for r in rs):
            d["peak_gib"] = max(r["peak_gib"] for r in rs)
        if v != "gdpo":
            d["share"] = med([r.get("share", 0.0) for r in rs])
            d["responses_replayed"] = med([r.get("responses_replayed", 0) for r in rs])
            # ratios to GDPO: of medians, and the median of per-round ratios
            g = {r["round"]: r for r in by["gdpo"]}
            for key in ("step", "train", "cpu_step", "cpu_train"):
                d[f"ratio_{key}"] = d[key] / med([r[key] for r in by["gdpo"]])
                d[f"ratio_{key}_paired"] = med(
                    [r[key] / g[r["round"]][key] for r in rs if r["round"] in g]
                )
            # The rollout is the same work for every variant (same model, same sizes; the
            # training step uses one fixed rollout): pooling its time over all steps removes
            # the generation noise from the comparison of what differs.
            for key, roll_key in (("step", "rollout"), ("cpu_step", "cpu_rollout")):
                pooled = med([r[roll_key] for r in kept])
                train_key = "train" if key == "step" else "cpu_train"
                d[f"ratio_{key}_pooled"] = (pooled + d[train_key]) / (
                    pooled + med([r[train_key] for r in by["gdpo"]])
                )
            floors = [r for r in rs if r.get("floor")]
            if floors:
                d["floor"] = med([r["floor"] for r in floors])
                d["replay_over_floor"] = med([r["replay"] / r["floor"] for r in floors])
                d["replay_over_floor_cpu"] = med(
                    [r["replay_cpu"] / r["floor_cpu"] for r in floors if r.get("floor_cpu")]
                )
                d["replay_tokens"] = med([r["replay_tokens"] for r in floors])
        out["variants"][v] = d
    out["response_tokens"] = med([r["response_tokens"] for r in kept])
    return out


def print_case(res: dict[str, Any]) -> None:
    c, v = res["case"], res["summary"]["variants"]
    line = f"  {c['model']} B{c['B']} G{c['G']} K{c['K']} T{c['max_new_tokens']}:"
    line += f" GDPO {v['gdpo']['step']:.3f}s"
    for name, d in v.items():
        if name == "gdpo":
            continue
        line += (
            f" | {name} {d['step']:.3f}s x{d['ratio_step_paired']:.3f}"
            f" (train x{d['ratio_train_paired']:.3f}, share {d['share']:.3f}"
        )
        if d.get("replay_over_floor"):
            line += f", replay/floor {d['replay_over_floor']:.2f}"
        line += ")"
    print(line, flush=True)
