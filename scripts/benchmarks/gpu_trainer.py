"""The trainer of the GPU check built by hand (no Hydra on its machine): a random Qwen2, the
project's tokenizer, a long-context task, an engine that returns fixed responses, the methods
from their classes' defaults, and the Lightning ``Trainer`` around them."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from benchmarks.gpu_setup import Sizes
from mrtpo.rollout.base import Generation, RolloutEngine

# Words for filler text: the synthetic task's vocabulary (one list in the project).
from mrtpo.tasks.synthetic.task import WORDS


def build_model(sizes: Sizes, tokenizer):
    """A random Qwen2 of ``sizes.shape`` on the device, in the policy dtype."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mrtpo.core.models import resolve_dtype

    torch.manual_seed(0)
    # the tokenizer's ids must all be rows of the embedding (the real vocabulary is larger)
    shape = {**sizes.shape, "vocab_size": max(sizes.shape["vocab_size"], len(tokenizer))}
    cfg = Qwen2Config(
        **shape,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.device(sizes.device):
        model = Qwen2ForCausalLM(cfg)
    model.to(resolve_dtype(sizes.dtype))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def build_tokenizer():
    from mrtpo.core.models import build_tokenizer as project_tokenizer

    return project_tokenizer(1024)


def _text_of(tok, n_tokens: int, rng: random.Random) -> str:
    """Words until the text is at least ``n_tokens`` tokens long."""
    words: list[str] = []
    while True:
        words += [rng.choice(WORDS) for _ in range(max(8, (n_tokens - len(words)) // 2))]
        text = " ".join(words)
        if len(tok(text, add_special_tokens=False)["input_ids"]) >= n_tokens:
            return text


def long_context_task(sizes: Sizes, tok):
    """A text-to-SQL-shaped task: a long schema-like prompt of 1-2k tokens, one verifier
    block per reward appended for replay (so contexts share a long prefix), K rewards. The
    reward values are replaced by ``controlled_task``; the blocks are what replay reads."""
    from mrtpo.tasks.base import Example, Score, Task

    rng = random.Random(0)
    lo, hi = sizes.prompt_tokens
    names = tuple(f"r{k}" for k in range(sizes.rewards))
    examples = [
        Example(
            id=f"long-{i}",
            messages=[
                {
                    "role": "user",
                    "content": "Schema:\n" + _text_of(tok, rng.randint(lo, hi), rng),
                }
            ],
        )
        for i in range(sizes.prompts * 4)
    ]
    blocks = {k: f"Verifier {k}: " + _text_of(tok, sizes.block_tokens, rng) for k in names}

    class LongContext(Task):
        name = "long_context"
        reward_names = names

        def examples(self, split):
            return examples

        def score(self, example, response):
            return Score(rewards=dict.fromkeys(names, 0.0), blocks=dict(blocks))

    return LongContext()


class FixedEngine(RolloutEngine):
    """An engine of the documented protocol, returning the same seeded random response tokens
    for a prompt every time: generation is not what stage 3 measures, and a random model's
    sampled lengths would make the steps differ."""

    def __init__(self, response_tokens: int, low: int, high: int) -> None:
        self.response_tokens, self.low, self.high = response_tokens, low, high

    def generate(self, prompts, n, sampling, seed):
        out = []
        for p in prompts:
            rng = random.Random(len(p) * 7919 + sum(p[:16]))
            for _ in range(n):
                ids = [rng.randrange(self.low, self.high) for _ in range(self.response_tokens)]
                out.append(Generation(token_ids=ids, finished=False))
        return out

    def sync_weights(self, model) -> None:
        pass


def _rl_config(sizes: Sizes) -> dict[str, Any]:
    n = sizes.prompts * sizes.group
    return {
        "prompts_per_step": sizes.prompts,
        "group_size": sizes.group,
        "ppo_epochs": 1,
        "mini_batch_size": n,
        "micro_batch_size": sizes.micro_batch,
    }


def _normal_token_range(tok) -> tuple[int, int]:
    special = set(tok.all_special_ids)
    low = max(special) + 1 if special and max(special) < 64 else 0
    return low, len(tok)


#: What ``configs/method/<name>.yaml`` sets apart from its class's defaults (the MRTPO preset
#: caps per token since issue 49; the class keeps cap=batch).
PRESETS: dict[str, dict[str, Any]] = {"mrtpo": {"cap": "token"}, "gdpo": {}}


def gpu_method(name: str):
    """MRTPO or GDPO as its preset makes it, with the β schedule off, as the bench builds it
    (``benchmarks.common.build_method``): this machine has no Hydra to compose
    ``configs/method/<name>.yaml``, so the class's defaults and ``PRESETS``; a test checks that
    both give the same method."""
    from benchmarks.common import schedule_off
    from mrtpo.core.credit.methods import GDPO, MRTPO

    return schedule_off({"mrtpo": MRTPO, "gdpo": GDPO}[name](**PRESETS[name]))


def build_trainer(sizes: Sizes, state: dict[str, Any], max_steps: int, root: Path):
    """(trainer, module, datamodule) built by hand, as ``pipeline.build`` would from a config."""
    import lightning as L

    from mrtpo.lightning.callbacks.rollout import RolloutCallback
    from mrtpo.lightning.data import PromptDataModule
    from mrtpo.lightning.module import PolicyModule

    tok, model = state["tok"], state["model"]
    task = long_context_task(sizes, tok)
    module = PolicyModule(model, tok, task, gpu_method("mrtpo"), rl=_rl_config(sizes), seed=0)
    dm = PromptDataModule(
        task,
        prompts_per_step=sizes.prompts,
        seed=0,
        max_prompt_tokens=sizes.prompt_tokens[1] + 64,
        tokenizer=tok,
    )
    low, high = _normal_token_range(tok)
    engine = FixedEngine(sizes.response_tokens, low, high)
    rollout = RolloutCallback(
        engine, sampling={"max_new_tokens": sizes.response_tokens}, group_size=sizes.group
    )
    trainer = L.Trainer(
        accelerator="gpu" if sizes.device == "cuda" else "cpu",
        devices=1,
        precision="bf16-true" if sizes.dtype == "bf16" else "32-true",
        max_steps=max_steps,
        max_epochs=-1,
        logger=False,
        callbacks=[rollout],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=str(root),
    )
    return trainer, module, dm, task
