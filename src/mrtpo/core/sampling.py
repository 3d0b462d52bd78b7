"""How responses are sampled (``rollout.sampling``): one description of the sampling
distribution, shared by the rollout engines (``mrtpo.rollout``) and the batches that carry it
(``mrtpo.core.batch``). It imports nothing of the project, so both can use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SamplingConfig:
    """``rollout.sampling``: the one description of the sampling distribution. It travels with the
    rollout (``RolloutBatch.sampling``); old/reference log-probs, the ratio and replay read its
    temperature there. ``top_p``/``top_k``/``min_p`` truncate: evaluation may use them, RL training
    refuses them (``check_for_training``, docs/rollout.md).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    max_new_tokens: int = 64
    greedy: bool = False

    def __post_init__(self) -> None:
        def need(ok: bool, key: str, allowed: str) -> None:
            if not ok:
                raise ValueError(
                    f"rollout.sampling.{key}={getattr(self, key)!r} is not allowed: {allowed}"
                )

        need(
            isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
            "max_new_tokens",
            "an integer >= 1",
        )
        need(
            isinstance(self.temperature, (int, float)) and self.temperature >= 0,
            "temperature",
            ">= 0",
        )
        need(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p", "in (0, 1]")
        need(
            isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0,
            "top_k",
            "an integer >= 0 (0: off)",
        )
        need(isinstance(self.min_p, (int, float)) and 0 <= self.min_p < 1, "min_p", "in [0, 1)")

    @property
    def truncated(self) -> bool:
        """True when sampling drops part of the vocabulary (top-p, top-k or min-p)."""
        return self.top_p < 1 or self.top_k > 0 or self.min_p > 0

    def check_for_training(self) -> None:
        """Refuse what an on-policy RL update cannot represent exactly (``why``): a truncated
        sampler's renormalized nucleus moves every update and is cut differently in bf16."""
        why = (
            "RL training needs the sampling distribution to be softmax(logits / temperature) "
            "over the whole vocabulary, which the trainer reproduces exactly; a truncated "
            "sampler (top-p / top-k / min-p) makes every sample off-policy for the loss "
            "(see docs/rollout.md)"
        )
        for key, off, value in (
            ("top_p", "1.0", self.top_p < 1),
            ("top_k", "0", self.top_k > 0),
            ("min_p", "0.0", self.min_p > 0),
        ):
            if value:
                raise ValueError(
                    f"rollout.sampling.{key}={getattr(self, key)!r} is not allowed in RL "
                    f"training: set rollout.sampling.{key}={off}. {why}"
                )
        if self.greedy or self.temperature <= 0:
            raise ValueError(
                f"rollout.sampling.temperature={self.temperature!r} is not allowed in RL "
                "training: use a temperature > 0 (greedy decoding gives G identical samples "
                "and has no log-probabilities to optimize)"
            )


def vllm_sampling_fields(
    sampling: SamplingConfig, n: int, stop_ids, seed: int | None, logprobs: bool
) -> dict[str, Any]:
    """vLLM ``SamplingParams`` fields for one request (greedy: temperature 0), in-process or
    server. Every field that changes the distribution is set: no penalties, no minimum length,
    top-k / min-p off unless ``sampling`` asks (as the HF engine)."""
    greedy = sampling.greedy or sampling.temperature <= 0
    fields: dict[str, Any] = {
        "n": int(n),
        "temperature": 0.0 if greedy else float(sampling.temperature),
        "top_p": 1.0 if greedy else float(sampling.top_p),
        # -1 disables top-k in every vLLM release (recent ones also accept 0)
        "top_k": -1 if greedy or sampling.top_k <= 0 else int(sampling.top_k),
        "min_p": 0.0 if greedy else float(sampling.min_p),
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "min_tokens": 0,
        "max_tokens": int(sampling.max_new_tokens),
        "detokenize": False,  # the protocol returns token ids only
    }
    stops = sorted(set(stop_ids))
    if stops:
        fields["stop_token_ids"] = stops
    if seed is not None:
        fields["seed"] = int(seed)
    if logprobs:
        fields["logprobs"] = 0  # the sampled token's own log-prob only
    return fields
