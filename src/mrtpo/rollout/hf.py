"""Rollouts with Hugging Face ``generate``: the CPU / test engine.

It generates with the training model itself, so ``sync_weights`` has nothing to do.
"""

from __future__ import annotations

import torch

from mrtpo.rollout.base import Generation, RolloutEngine, SamplingConfig


class HFEngine(RolloutEngine):
    """Batched sampling with ``model.generate`` (left padding, stop at EOS)."""

    def __init__(self, batch_size: int = 64) -> None:
        self.batch_size = batch_size  # prompts x samples per generate call
        self.model = None
        self.tokenizer = None
        self.eos_ids: list[int] = []

    def bind(self, model, tokenizer, eos_ids: list[int]) -> None:
        self.model, self.tokenizer, self.eos_ids = model, tokenizer, list(eos_ids)

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model  # same parameters: nothing to copy

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int
    ) -> list[Generation]:
        if self.model is None:
            raise RuntimeError("HFEngine.bind(model, tokenizer, eos_ids) must be called first")
        model, pad = self.model, self.tokenizer.pad_token_id
        device = next(model.parameters()).device
        flat = [p for p in prompts for _ in range(n)]
        gen = torch.Generator(device="cpu").manual_seed(seed)
        was_training = model.training
        model.eval()
        out: list[Generation] = []
        try:
            for start in range(0, len(flat), self.batch_size):
                chunk = flat[start : start + self.batch_size]
                width = max(len(p) for p in chunk)
                ids = torch.full((len(chunk), width), pad, dtype=torch.long)
                attn = torch.zeros_like(ids)
                for i, p in enumerate(chunk):
                    ids[i, width - len(p) :] = torch.tensor(p)
                    attn[i, width - len(p) :] = 1
                # generate() samples from the global RNG; seed it from our generator so a
                # resumed run draws the same samples as an uninterrupted one.
                torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
                kwargs = (
                    {"do_sample": False}
                    if sampling.greedy
                    else {
                        "do_sample": True,
                        "temperature": sampling.temperature,
                        "top_p": sampling.top_p,
                        "top_k": 0,
                    }
                )
                seqs = model.generate(
                    input_ids=ids.to(device),
                    attention_mask=attn.to(device),
                    max_new_tokens=sampling.max_new_tokens,
                    eos_token_id=self.eos_ids,
                    pad_token_id=pad,
                    **kwargs,
                )
                for row in seqs[:, width:].tolist():
                    toks: list[int] = []
                    finished = False
                    for t in row:
                        toks.append(t)
                        if t in self.eos_ids:
                            finished = True
                            break
                    out.append(Generation(token_ids=toks, finished=finished))
        finally:
            model.train(was_training)
        return out
