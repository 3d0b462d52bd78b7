"""Section 3: our ``method=gdpo`` step against TRL's ``GRPOTrainer`` on the same work.

Both trainers run in one process, taking turns step by step: TRL in the main thread, our
Lightning run in a worker thread, a baton passed at step boundaries (inside a callback, so
the side that waits does no work meanwhile). Each side's step time runs from receiving the
baton to handing it back, so it includes everything its loop does per step (generation,
rewards, advantages, forward/backward, optimizer, logging, fetching the next batch).

Same work: the same model (two copies of the same weights), prompts, the synthetic task's
K constraint rewards (our task object scores for both), G, max new tokens, temperature 1,
top-p 1, no top-k; fp32 on CPU, bf16 on GPU; HF ``generate`` with a KV cache in both; one optimizer update per
step over all B x G responses in one forward/backward (no micro-batching on either side);
token-mean loss (TRL ``loss_type="dapo"``), clip 0.2 / 0.28, no KL and no reference model;
GDPO advantages (TRL ``multi_objective_aggregation="normalize_then_sum"``); AdamW, lr 1e-6,
grad-norm clip 1.0; no gradient checkpointing. One difference is TRL's own design: with one
update per generation it skips the old-policy forward (the ratio is 1 by construction); ours
runs it. The report shows our time with and without that phase.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import lightning as L

from benchmarks.common import bench_dir, compose, ensure_model, med, model_overrides, model_path

WAIT_S = 1800.0


class Baton:
    def __init__(self) -> None:
        self.ours = threading.Event()
        self.trl = threading.Event()
        self.error: BaseException | None = None

    def give(self, to: str) -> None:
        (self.ours if to == "ours" else self.trl).set()

    def take(self, me: str) -> None:
        ev = self.ours if me == "ours" else self.trl
        if not ev.wait(WAIT_S):
            raise TimeoutError(f"{me} waited {WAIT_S}s for the other trainer")
        ev.clear()
        if self.error is not None and me == "trl":
            raise RuntimeError("our trainer failed") from self.error


class OursTurns(L.Callback):
    """Waits for the baton before each step; hands it back at the start of the next one."""

    def __init__(self, baton: Baton) -> None:
        self.baton = baton
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.phases: list[dict[str, float]] = []
        self.t_go = self.c_go = 0.0

    def _hand_back(self, module) -> None:
        if self.t_go:
            self.times.append(time.perf_counter() - self.t_go)
            self.cpu.append(time.thread_time() - self.c_go)
            self.phases.append(dict(module.timings))
        self.baton.give("trl")

    def on_train_batch_start(self, trainer, module, batch, batch_idx: int) -> None:
        if batch_idx > 0:
            self._hand_back(module)
        self.baton.take("ours")
        self.t_go, self.c_go = time.perf_counter(), time.thread_time()

    def on_train_end(self, trainer, module) -> None:
        self._hand_back(module)


def _trl_callback(baton: Baton):
    from transformers import TrainerCallback

    class TrlTurns(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.cpu: list[float] = []
            self.lengths: list[float] = []
            self.t_go = self.c_go = 0.0

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(float(logs["completions/mean_length"]))

        def on_train_begin(self, args, state, control, **kw):
            self.t_go, self.c_go = time.perf_counter(), time.thread_time()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t_go)
            self.cpu.append(time.thread_time() - self.c_go)
            baton.give("ours")
            baton.take("trl")
            self.t_go, self.c_go = time.perf_counter(), time.thread_time()

    return TrlTurns()


def _reward_funcs(task) -> list:
    """One TRL reward function per constraint slot, scoring with our task's own checker."""
    from mrtpo.tasks.synthetic.task import response_words

    def make(kind: str):
        def fn(prompts, completions, example_id, **kw) -> list[float]:
            out = []
            for comp, eid in zip(completions, example_id, strict=True):
                text = comp[-1]["content"] if isinstance(comp, list) else comp
                cons = next(c for c in task.by_id[eid].data["constraints"] if c.kind == kind)
                out.append(float(cons.check(response_words(text))[0]))
            return out

        fn.__name__ = f"constraint_{kind}"
        return fn

    return [make(k) for k in task.reward_names]


def long_text(size: str, tokens: int) -> str:
    """Filler words that make about ``tokens`` tokens for the bench model's tokenizer."""
    import random

    from transformers import AutoTokenizer

    from mrtpo.tasks.synthetic.task import WORDS

    tok = AutoTokenizer.from_pretrained(model_path(size))
    rng, words = random.Random(0), []
    while len(tok.encode(" ".join(words), add_special_tokens=False)) < tokens:
        words += [rng.choice(WORDS) for _ in range(32)]
    return " ".join(words)


def run(
    size: str,
    *,
    prompts: int,
    group: int,
    rewards: int,
    new_tokens: int,
    steps: int,
    warmup: int = 1,
    gpu: bool = False,
    system_tokens: int = 0,
) -> dict[str, Any]:
    """``system_tokens`` > 0: every prompt starts with a system message of about that many
    tokens (the paper's kind of work: a text-to-SQL prompt carries its database schema)."""
    import trl  # noqa: F401  (a missing TRL fails here, before anything is built)

    ensure_model(size)
    n = prompts * group
    total = steps + warmup
    run_dir = (
        bench_dir() / "runs" / (f"trl-{size}" + (f"-sys{system_tokens}" if system_tokens else ""))
    )
    overrides = _our_overrides(size, prompts, group, rewards, new_tokens, total, gpu, system_tokens)
    trainer, module, dm, log_times = _ours(overrides, run_dir)
    baton = Baton()
    ours_cb = OursTurns(baton)
    trainer.callbacks.insert(0, ours_cb)

    # TRL: its own copy of the same weights, the same prompts and checkers.
    task = module.task
    examples = list(task.examples("train"))
    task.by_id = {e.id: e for e in examples}
    shape = dict(run_dir=run_dir, n=n, group=group, new_tokens=new_tokens, total=total, gpu=gpu)
    tok, grpo, trl_cb, gen_times = _trl_trainer(size, task, examples, shape, baton)
    _take_turns(trainer, module, dm, grpo, baton)
    case = {
        "model": size,
        "B": prompts,
        "G": group,
        "K": rewards,
        "max_new_tokens": new_tokens,
        "steps": steps,
        "warmup": warmup,
        "system_tokens": system_tokens,
        # prompt tokens as both trainers tokenize them (chat template, generation prompt)
        "mean_prompt_tokens": _mean_prompt_tokens(tok, examples, n),
    }
    return {
        "case": case,
        "trl_times": trl_cb.times,
        "ours_times": ours_cb.times,
        "trl_cpu": trl_cb.cpu,
        "ours_cpu": ours_cb.cpu,
        "ours_phases": ours_cb.phases,
        "summary": _summary(trl_cb, ours_cb, warmup, log_times, gen_times, module),
    }


def _our_overrides(size, prompts, group, rewards, new_tokens, total, gpu, system_tokens):
    """Our side's config: ``method=gdpo`` with TRL's settings (see the module's docstring)."""
    n = prompts * group
    return [
        *model_overrides(size),
        "task=synthetic",
        f"task.num_constraints={rewards}",
        *([f"+task.system_prompt='{long_text(size, system_tokens)}'"] if system_tokens else []),
        "method=gdpo",
        f"rl.prompts_per_step={prompts}",
        f"rl.group_size={group}",
        f"rl.mini_batch_size={n}",
        f"rl.micro_batch_size={n}",
        "rl.ppo_epochs=1",
        "rl.clip_low=0.2",
        "rl.clip_high=0.28",
        "rl.kl_coef=0.0",
        "rl.loss_agg=token-mean",
        "rl.max_grad_norm=1.0",
        "optim.lr=1e-6",
        f"rollout.sampling.max_new_tokens={new_tokens}",
        "rollout.sampling.temperature=1.0",
        "rollout.sampling.top_p=1.0",
        f"rollout.engine.batch_size={n}",
        f"trainer.max_steps={total}",
        "++trainer.enable_progress_bar=false",
        "++trainer.enable_checkpointing=false",
        *(["trainer=gpu", "model.dtype=bf16"] if gpu else []),
    ]


def _ours(overrides: list[str], run_dir):
    """Our trainer from the composed config, its metric logging timed: (trainer, module,
    datamodule, {"log_step": seconds of each step's RLStep.result, "publish": of each step's
    Lightning log_dict calls}). Both run after the step's own timer stops."""
    from mrtpo.lightning.pipeline import build

    trainer, module, dm = build(compose(overrides, run_dir))
    log_times: dict[str, list[float]] = {"log_step": [], "publish": []}

    def timed(fn, times: list[float]):
        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                times.append(time.perf_counter() - t0)

        return run

    # the step's metrics over ranks, then Lightning's per-key self.log (a visible cost here)
    module.step.result = timed(module.step.result, log_times["log_step"])
    module._publish = timed(module._publish, log_times["publish"])
    return trainer, module, dm, log_times


def _trl_args(run_dir, n: int, group: int, new_tokens: int, total: int, gpu: bool):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(run_dir / "trl"),
        per_device_train_batch_size=n,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=group,
        max_completion_length=new_tokens,
        num_iterations=1,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        multi_objective_aggregation="normalize_then_sum",
        scale_rewards="group",
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        optim="adamw_torch",
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_steps=total,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=gpu,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=not gpu,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        log_completions=False,
    )


def _trl_trainer(size: str, task, examples, shape: dict[str, Any], baton: Baton):
    """TRL's ``GRPOTrainer`` on its own copy of the weights, the same prompts and checkers,
    its ``generate`` timed: (tokenizer, trainer, turns callback, generate seconds). ``shape``:
    the arguments of ``_trl_args``."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOTrainer

    n, total = shape["n"], shape["total"]
    ds = datasets.Dataset.from_list(
        [{"prompt": e.messages, "example_id": e.id} for e in examples[: max(64, n * total)]]
    )
    tok = AutoTokenizer.from_pretrained(model_path(size))
    tok.padding_side = "left"
    dtype = torch.bfloat16 if shape["gpu"] else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_path(size), dtype=dtype)
    args = _trl_args(**shape)
    gen_times: list[float] = []
    generate = model.generate

    def timed_generate(*a, **kw):  # TRL calls the model's own generate (no wrapper here)
        t0 = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            gen_times.append(time.perf_counter() - t0)

    model.generate = timed_generate
    trl_cb = _trl_callback(baton)
    grpo = GRPOTrainer(
        model=model,
        reward_funcs=_reward_funcs(task),
        args=args,
        train_dataset=ds,
        processing_class=tok,
        callbacks=[trl_cb],
    )
    grpo.remove_callback(PrinterCallback)  # logs are still computed every step, not printed
    grpo.remove_callback(ProgressCallback)
    return tok, grpo, trl_cb, gen_times


def _take_turns(trainer, module, dm, grpo, baton: Baton) -> None:
    """Our trainer in a worker thread, TRL's in this one, the baton passing between them."""

    def ours() -> None:
        try:
            trainer.fit(module, datamodule=dm)
        except BaseException as exc:  # hand the failure to the main thread
            baton.error = exc
            baton.give("trl")

    th = threading.Thread(target=ours, name="mrtpo-trainer", daemon=True)
    th.start()
    grpo.train()
    th.join(WAIT_S)
    if baton.error is not None:
        raise RuntimeError("our trainer failed") from baton.error


def _mean_prompt_tokens(tok, examples, n: int) -> float:
    """Mean prompt tokens of the first ``n`` examples, as both trainers tokenize them."""
    return (
        sum(
            len(tok(text, add_special_tokens=False).input_ids)
            for text in (
                tok.apply_chat_template(e.messages, add_generation_prompt=True, tokenize=False)
                for e in examples[:n]
            )
        )
        / n
    )


def _summary(trl_cb, ours_cb, warmup: int, log_times, gen_times, module) -> dict[str, Any]:
    """Medians after the warm-up steps, and the per-step ratios ours / TRL."""
    trl_t = trl_cb.times[warmup:]
    ours_t = ours_cb.times[warmup:]
    old = [p.get("old_logp", 0.0) for p in ours_cb.phases[warmup:]]
    ours_wo = [a - b for a, b in zip(ours_t, old)]
    paired = [a / b for a, b in zip(ours_t, trl_t)]
    paired_wo = [a / b for a, b in zip(ours_wo, trl_t)]
    cpu_paired = [a / b for a, b in zip(ours_cb.cpu[warmup:], trl_cb.cpu[warmup:])]
    trl_len = trl_cb.lengths[warmup:]
    phases = {
        k: med([p.get(k, 0.0) for p in ours_cb.phases[warmup:]])
        for k in ("rollout", "reward", "old_logp", "update", "step")
    }
    phases.update({k: med(v[warmup:]) for k, v in log_times.items()})
    return {
        "trl": med(trl_t),
        "ours": med(ours_t),
        "ours_without_old_logp": med(ours_wo),
        "ratio": med(ours_t) / med(trl_t),
        "ratio_paired": med(paired),
        "ratio_without_old_logp_paired": med(paired_wo),
        "trl_generate": med(gen_times[warmup:]),
        "trl_cpu": med(trl_cb.cpu[warmup:]),
        "ours_cpu": med(ours_cb.cpu[warmup:]),
        "ratio_cpu_paired": med(cpu_paired),
        "ours_phases": phases,
        "trl_mean_completion_len": med(trl_len) if trl_len else None,
        "ours_mean_completion_len": float(module.last.rollout.response_mask.sum(-1).float().mean())
        if module.last is not None
        else None,
    }


def print_result(res: dict[str, Any]) -> None:
    c, s = res["case"], res["summary"]
    print(
        f"  {c['model']} B{c['B']} G{c['G']} K{c['K']} T{c['max_new_tokens']}: TRL "
        f"{s['trl']:.3f}s  ours {s['ours']:.3f}s  ours/TRL x{s['ratio_paired']:.3f} "
        f"(without our old-logp pass x{s['ratio_without_old_logp_paired']:.3f}; CPU time "
        f"x{s['ratio_cpu_paired']:.3f})",
        flush=True,
    )
