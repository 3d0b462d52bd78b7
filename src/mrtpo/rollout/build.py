"""Turn examples into a ``RolloutBatch``: apply the chat template once, sample, pad."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mrtpo.core.batch import RolloutBatch
from mrtpo.core.chat import prompt_ids
from mrtpo.core.forward import pad_left, pad_right
from mrtpo.rollout.base import Generation, RolloutEngine, SamplingConfig
from mrtpo.tasks.base import Example


def build_rollout(
    engine: RolloutEngine,
    tokenizer,
    examples: Sequence[Example],
    n: int,
    sampling: SamplingConfig,
    seed: int,
    eos_ids: Sequence[int] = (),
) -> RolloutBatch:
    """Sample ``n`` responses for each example (prompt-major order); the batch carries the
    sampling description and, when the engine reports them, its log-probs."""
    prompts = [prompt_ids(tokenizer, e) for e in examples]
    gens = engine.generate(prompts, n, sampling, seed)
    return assemble(tokenizer, examples, prompts, gens, n, sampling, eos_ids)


def assemble(
    tokenizer,
    examples: Sequence[Example],
    prompts: list[list[int]],
    gens: Sequence[Generation],
    n: int,
    sampling: SamplingConfig,
    eos_ids: Sequence[int] = (),
    version: int | None = None,
) -> RolloutBatch:
    """The padded batch of ``gens`` (``n`` per prompt, prompt-major). ``version``: the
    trainer step whose weights sampled them (``RolloutBatch.versions``), None under sync.
    Tokenizing and decoding stay here, in the trainer's thread: a fast tokenizer is not
    safe to share with a thread that generates ahead."""
    if len(gens) != len(prompts) * n:
        raise RuntimeError(f"engine returned {len(gens)} samples for {len(prompts)} x {n}")
    pad = tokenizer.pad_token_id
    p_ids, p_mask = pad_left([p for p in prompts for _ in range(n)], pad)
    r_ids, r_mask = pad_right([g.token_ids for g in gens], pad)
    engine_logp = None
    if gens and all(g.logprobs is not None for g in gens):
        engine_logp = torch.zeros(r_ids.shape, dtype=torch.float32)
        for i, g in enumerate(gens):
            if len(g.logprobs) != len(g.token_ids):
                raise RuntimeError(
                    f"engine returned {len(g.logprobs)} log-probs for {len(g.token_ids)} tokens"
                )
            if g.logprobs:
                engine_logp[i, : len(g.logprobs)] = torch.tensor(g.logprobs, dtype=torch.float32)
    eos = set(eos_ids)
    texts = [
        tokenizer.decode([t for t in g.token_ids if t not in eos], skip_special_tokens=True)
        for g in gens
    ]
    return RolloutBatch(
        examples=[e for e in examples for _ in range(n)],
        group=torch.arange(len(examples)).repeat_interleave(n),
        prompt_ids=p_ids,
        prompt_mask=p_mask,
        response_ids=r_ids,
        response_mask=r_mask,
        texts=texts,
        finished=torch.tensor([g.finished for g in gens], dtype=torch.bool),
        sampling=sampling,
        engine_logp=engine_logp,
        versions=None if version is None else torch.full((len(gens),), int(version)),
    )
