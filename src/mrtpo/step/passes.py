"""No-grad log-prob passes of the step: pi_old, the KL reference, idle passes that keep
sharded ranks in step, and where the engine-trainer gap is measured. A sharded forward is a
collective, so uneven loops agree the busiest rank's count first and pad with a one-token
batch; DDP runs the same counts and numbers.
"""

from __future__ import annotations

import copy
import logging

import torch

from mrtpo.core.batch import RolloutBatch
from mrtpo.core.forward import response_logprobs
from mrtpo.core.lora import is_lora
from mrtpo.distributed import Ranks, dummy_batch

log = logging.getLogger(__name__)


def dropout_in(model: torch.nn.Module) -> str | None:
    """The first randomness of ``model`` in train mode only: a dropout layer, or a non-zero
    ``*dropout*`` (or router ``*jitter*``) rate of a Hugging Face config, which the model
    applies in train mode only; named. None if there is none."""
    configs = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.modules.dropout._DropoutNd) and mod.p > 0:
            return f"{name or type(mod).__name__} (p={mod.p})"
        cfg = getattr(mod, "config", None)
        if callable(getattr(cfg, "to_dict", None)):
            configs[id(cfg)] = cfg
    for cfg in configs.values():
        for key, v in cfg.to_dict().items():
            named = "dropout" in key or "jitter" in key
            if named and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                return f"{key}={v}"
    return None


class LogprobPasses:
    """The policy's (and the reference's) no-grad log-probs of sampled tokens."""

    def __init__(
        self,
        policy: torch.nn.Module,
        ref_policy: torch.nn.Module | None,
        pad_id: int,
        ranks: Ranks,
        shared_prompt: str,
    ) -> None:
        self.policy, self.ref_policy = policy, ref_policy
        self.pad_id, self.ranks, self.shared_prompt = pad_id, ranks, shared_prompt
        self._no_dropout: bool | None = None  # dropout_in(policy) is None; known on first use

    @torch.no_grad()
    def logprobs(self, model, roll: RolloutBatch, micro: int) -> torch.Tensor:
        """log-probs of the sampled tokens under ``model`` at the sampling temperature."""
        out = []
        # Several ranks: as many forwards as the busiest, agreed before the first one.
        count = -(-roll.n // micro)
        idle = 0 if self.ranks.world_size == 1 else self.ranks.max(count) - count
        for s in range(0, roll.n, micro):
            sub = roll.select(torch.arange(s, min(roll.n, s + micro)))
            args = (sub.prompt_ids, sub.prompt_mask, sub.response_ids, sub.response_mask)
            tau, share = roll.temperature, self.shared_prompt
            out.append(response_logprobs(model, *args, temperature=tau, shared_prompt=share).cpu())
        for _ in range(idle):
            response_logprobs(model, *dummy_batch(self.pad_id), temperature=roll.temperature)
        if not out:  # a sharded rank with no rows left to score
            return torch.zeros((0, roll.response_ids.shape[1]), dtype=torch.float32)
        return torch.cat(out)

    def old(self, roll: RolloutBatch, rel, micro: int) -> torch.Tensor:
        """log pi_old of the sampled tokens (at the sampling temperature), reusing replay's
        P_all pass where P_all is P0 (replay tempers its distributions alike)."""
        self.policy.eval()
        try:
            if rel.logp is None or not bool(rel.logp_rows.any()):
                return self.logprobs(self.policy, roll, micro)
            old = rel.logp.clone() * roll.response_mask
            rest = (~rel.logp_rows).nonzero().flatten()
            # several ranks: every rank takes part in the forwards, with rows to score or not
            if len(rest) or self.ranks.world_size > 1:
                old[rest] = self.logprobs(self.policy, roll.select(rest), micro)
            return old
        finally:
            self.policy.train()

    def reference(self, roll: RolloutBatch, micro: int) -> torch.Tensor:
        """log pi_ref of the sampled tokens: the frozen initial policy, which under LoRA is
        the policy with its adapters switched off."""
        if self.ref_policy is not None:
            return self.logprobs(self.ref_policy, roll, micro)
        self.policy.eval()
        try:
            with self.policy.disable_adapter():
                return self.logprobs(self.policy, roll, micro)
        finally:
            self.policy.train()

    def gap_in_update(self, several: bool, made: bool) -> bool:
        """Whether the update's forward gives pi_old's log-probs for the engine gap: one update per
        step (``several`` false), pi_old's not computed already (``made``) and no dropout. Decided
        jointly: under FSDP the old-policy pass is a collective."""
        if self._no_dropout is None:
            found = dropout_in(self.policy)
            self._no_dropout = found is None
            if found is not None:
                log.info(
                    "the policy is random in train mode (%s): the engine-trainer gap costs a "
                    "forward of its own in eval mode (rl.measure_logp_gap=false skips it when "
                    "rl.tis_cap is null)",
                    found,
                )
        own = not several and not made and self._no_dropout
        return not self.ranks.any(not own)

    def frozen_policy(self) -> tuple[torch.nn.Module, bool]:
        """(frozen model, adapters_off): the KL reference where there is one, the policy itself
        with adapters off under LoRA, else a copy kept outside the module (not checkpointed:
        it is model.name_or_path's weights)."""
        if self.ref_policy is not None:
            return self.ref_policy, False
        if is_lora(self.policy):
            return self.policy, True
        return copy.deepcopy(self.policy).eval().requires_grad_(False), False
