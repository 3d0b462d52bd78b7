"""The advantage-method interface: one signature from a scored batch to token advantages.

Every method — GRPO, GDPO, SAW variants, MRTPO and its ablations — takes a ``CreditInputs``
and returns token advantages ``[N, T]``. The trainer never branches on a method's name: it
asks the method which relevance it needs (``relevance``) and which response–reward pairs
to replay (``replay_pairs``), and hands over whatever replay produced.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from mrtpo.core.credit.advantages import (
    compute_dtype,
    gdpo_advantages,
    global_row_index,
    grpo_advantages,
    replay_mask,
    saw_weights,
)
from mrtpo.core.credit.relevance import (
    beta_schedule,
    check_cap,
    mrtpo_advantages_from_weights,
    relevance_weights,
    shuffle_weights,
)


@dataclass
class CreditInputs:
    rewards: Tensor  # [N, K] float; NaN = reward does not apply to that response
    group: Tensor  # [N] long; responses with the same id were sampled from the same prompt
    mask: Tensor  # [N, T] bool; valid response tokens (EOS included when sampled)
    step: int = 0  # training iteration (0-based), for schedules
    q: Tensor | None = None  # [N, K, T] relevance (per_reward) or [N, 1, T] (joint); None if none
    replayed: Tensor | None = None  # [N, K] / [N, 1] bool; pairs whose q was computed
    process_group: Any = None  # torch.distributed group for global batch statistics
    # randomness of the shuffle ablation: the same on every rank (each response's permutation
    # is then keyed by its index in the global batch)
    generator: torch.Generator | None = None
    # what the method's own ``score_inputs`` hook computed for this batch (None without one)
    extra: Any = None


@dataclass(frozen=True)
class RelevanceRequest:
    """What a method needs from replay; the trainer hands it to the replayer without reading it.

    ``contexts``: ``"per_reward"`` (``P_all`` vs ``P_\\k``, ``q [N, K, T]``) or ``"joint"`` (vs no
    verifier information, ``q [N, 1, T]``). ``score``: ``"jsd"`` (Jensen–Shannon distance, base
    2, in [0, 1]) or ``"logp_diff"`` (signed ``log p(y_t | P_all) - log p(y_t | other)``).
    ``form`` (``method.context``): ``"delete"`` the text (the paper's) or ``"mask"`` its tokens.
    """

    contexts: str = "per_reward"
    score: str = "jsd"
    form: str = "delete"

    CONTEXTS: ClassVar[tuple[str, ...]] = ("per_reward", "joint")
    SCORES: ClassVar[tuple[str, ...]] = ("jsd", "logp_diff")
    FORMS: ClassVar[tuple[str, ...]] = ("delete", "mask")

    def __post_init__(self) -> None:
        if self.contexts not in self.CONTEXTS:
            raise ValueError(f"relevance contexts={self.contexts!r}; valid: {self.CONTEXTS}")
        if self.score not in self.SCORES:
            raise ValueError(f"relevance score={self.score!r}; valid: {self.SCORES}")
        if self.form not in self.FORMS:
            raise ValueError(f"method.context={self.form!r}: use one of {list(self.FORMS)}")

    @property
    def joint(self) -> bool:
        return self.contexts == "joint"


@dataclass(frozen=True)
class TeacherRequest:
    """A self-distillation method's frozen teacher (start-up checks read only that there is one).
    ``sampled``: teacher and student log-probs of the sampled tokens arrive as
    ``CreditInputs.extra``; ``full``: a divergence over full distributions joins each update
    micro-batch's loss (``token_loss``)."""

    sampled: bool = True
    full: bool = False


@dataclass
class MethodServices:
    """What the trainer lends a method once, when it is built (``AdvantageMethod.bind``)."""

    task: Any
    tokenizer: Any
    #: ``() -> (model, adapters_off)``: the policy's weights as they are at build time (the
    #: initial ones), frozen; under LoRA the policy itself, to be run with adapters off. A copy
    #: is made on the first call only.
    frozen_policy: Callable[[], tuple[torch.nn.Module, bool]]
    token_budget: int = 16384  # rows x padded length per no-grad forward (replay's)
    chunk: int = 256  # (row, position) pairs per float32 log-softmax (replay's jsd_chunk)
    shared_prompt: str = "auto"  # rl.shared_prompt_forward, for no-grad forwards of their own


@dataclass
class StepView:
    """This step's batch as a method's ``score_inputs`` hook sees it, before any update."""

    rollout: Any  # mrtpo.core.batch.RolloutBatch
    #: ``() -> [N, T]``: log-probs of the sampled tokens under the sampling parameters, at the
    #: sampling temperature, no grad (computed once, shared with the trainer's own use)
    student_logp: Callable[[], Tensor]
    device: Any = None


@dataclass
class CreditOutput:
    advantages: Tensor  # [N, T] token advantages, 0 on pads
    stats: dict[str, float] = field(default_factory=dict)  # logged under train/adv/...
    #: [N, T] the credit relevance moves, R_t / (sigma + eps) before any cap (0 on pads); None
    #: for a method without (the step's diagnostics read where its energy lands)
    realloc: Tensor | None = None
    #: [N, K|1, T] the per-token weights the method derived from ``q`` (``token_weights``,
    #: before any shuffle); the step records these rather than computing them again
    weights: Tensor | None = None


@dataclass(frozen=True)
class RewardSet:
    """What a method reads of a task in ``setup``: a ``Task`` has these attributes too, so
    either may be passed (tests and tools without a task pass this)."""

    reward_names: tuple[str, ...]
    rewards_vary_per_prompt: bool = False
    #: reward name -> (lowest, highest) value; names left out range over [0, 1]
    reward_ranges: Mapping[str, tuple[float, float]] | None = None
    #: the verifier information is part of the prompt (``Task.info_in_prompt``)
    info_in_prompt: bool = False


class AdvantageMethod(ABC):
    """Base class. Subclasses implement ``__call__``; relevance methods set ``relevance``. The
    optional hooks below bring a method's own signal without the step knowing it."""

    #: What replay must compute for this method (None: no replay).
    relevance: ClassVar[RelevanceRequest | None] = None
    #: A frozen teacher this method distils from (None: none); checked at start-up only.
    teacher: ClassVar[TeacherRequest | None] = None
    #: ``token_loss`` needs the policy's logits ``[n, T, V]`` in every update micro-batch.
    wants_logits: bool = False

    def setup(self, task, services: MethodServices | None = None) -> None:
        """Validate against ``task`` (a ``Task`` or a ``RewardSet``), raising a config error naming
        the method and the task: first before the model loads, without ``services`` (a bad
        combination fails cheaply), then with them, to bind to the step. Subclasses extend it."""
        self.reward_names = tuple(task.reward_names)
        ranges = getattr(task, "reward_ranges", None)
        self.reward_lower_bounds = _lower_bounds(self.reward_names, ranges)

    def replay_pairs(self, rewards: Tensor, group: Tensor, has_block: Tensor) -> Tensor:
        """bool ``[N, K]`` (or ``[N, 1]`` for joint): which pairs replay must score."""
        raise NotImplementedError(f"{type(self).__name__} does not use relevance")

    def replays(self, step: int) -> bool:
        """Whether step ``step`` needs replay (default: whenever the method asks for
        relevance; a method may skip steps where relevance cannot change its advantages)."""
        return self.relevance is not None

    def schedule(self, step: int) -> dict[str, float]:
        """The method's own scheduled values at ``step`` (logged as ``train/<key>``)."""
        return {}

    def score_inputs(self, view: StepView) -> Any:
        """Extra no-grad inputs for this step's advantages (``CreditInputs.extra``); None: none."""
        return None

    def token_weights(self, q: Tensor, mask: Tensor, replayed: Tensor, step: int) -> Tensor | None:
        """The per-token weights this method derives from replay's ``q`` (for the relevance
        dumps and pictures); None for a method without them."""
        return None

    def token_loss(
        self, logits: Tensor | None, batch, temperature: float, agg: str, denom: float, device=None
    ) -> tuple[Tensor, dict[str, float]] | None:
        """An extra loss term for one update micro-batch, added to the surrogate; None: none.
        ``logits [n, T, V]`` carry gradient (None unless ``wants_logits``); ``agg``/``denom`` as
        ``loss.aggregate``. Returns (the term, per-token statistics logged under ``train/``)."""
        return None

    @abstractmethod
    def __call__(self, inputs: CreditInputs) -> CreditOutput: ...


# ---- concrete methods, each selected by ``method=<config_name>`` (configs/method/<name>.yaml)


def checked_beta(
    beta: float, warmup_steps: int, below_one: bool = False, why: str = ""
) -> tuple[float, int]:
    """``method.beta`` in [0, 1] ([0, 1) with ``below_one``) and ``method.beta_warmup_steps``
    >= 0, or a config error (``why`` says what the range comes from)."""
    top = "1)" if below_one else "1]"
    if not (0.0 <= beta < 1.0 if below_one else 0.0 <= beta <= 1.0):
        raise ValueError(f"method.beta must be in [0, {top}{why}, got {beta}")
    if warmup_steps < 0:
        raise ValueError(f"method.beta_warmup_steps must be >= 0, got {warmup_steps}")
    return float(beta), int(warmup_steps)


class _BetaRamp:
    """A method whose token weights take a share ``beta`` of the credit, ramped in over
    ``beta_warmup_steps``; at beta = 0 (a warm-up's first step) relevance cannot change the
    advantages, so that step does not replay."""

    beta_max: float
    beta_warmup_steps: int

    def beta(self, step: int) -> float:
        """Share of the advantage that follows the token weights at ``step``."""
        return beta_schedule(self.beta_max, step, self.beta_warmup_steps)

    def replays(self, step: int) -> bool:
        return self.beta(step) > 0

    def schedule(self, step: int) -> dict[str, float]:
        return {"beta": float(self.beta(step))}


def _lower_bounds(
    reward_names: tuple[str, ...], reward_ranges: Mapping[str, tuple[float, float]] | None
) -> tuple[float, ...]:
    """Each reward's lowest value, in ``reward_names`` order (0 for names not listed)."""
    ranges = dict(reward_ranges or {})
    _refuse_unknown(ranges, reward_names, "the task's reward_ranges name", "its")
    out = []
    for name in reward_names:
        lo, hi = ranges.get(name, (0.0, 1.0))
        if not float(lo) <= float(hi):
            raise ValueError(f"reward_ranges[{name!r}] = ({lo}, {hi}): lowest above highest")
        out.append(float(lo))
    return tuple(out)


def _refuse_unknown(given, reward_names, what: str, whose: str) -> None:
    unknown = sorted(set(given) - set(reward_names))
    if unknown:
        raise ValueError(
            f"{what} unknown reward(s) {unknown}; {whose} rewards are {list(reward_names)}"
        )


def _broadcast(adv: Tensor, mask: Tensor) -> Tensor:
    """Response advantages ``[N]`` -> token advantages ``[N, T]`` (0 on pads)."""
    valid = mask.to(device=adv.device, dtype=torch.bool)
    return torch.where(valid, adv[:, None], torch.zeros((), dtype=adv.dtype, device=adv.device))


def _adv_stats(tok: Tensor, mask: Tensor) -> dict[str, float]:
    vals = tok[mask.to(torch.bool)]
    if vals.numel() == 0:
        return {"mean": 0.0, "std": 0.0, "min": 0.0, "max": 0.0}
    std = float(vals.std(unbiased=False)) if vals.numel() > 1 else 0.0
    return {
        "mean": float(vals.mean()),
        "std": std,
        "min": float(vals.min()),
        "max": float(vals.max()),
    }


def _check_q(q: Tensor | None, n: int, width: int, what: str) -> None:
    """Refuse relevance ``q`` (if given) that is not ``[n, width, T]``."""
    if q is not None and (q.dim() != 3 or q.shape[:2] != (n, width)):
        raise ValueError(f"{what} of shape [N={n}, {width}, T], got {tuple(q.shape)}")


def _replayed_share(inputs: CreditInputs, joint: bool) -> float:
    """Share of candidate pairs replayed: present (response, reward) pairs, or responses."""
    if inputs.replayed is None or inputs.q is None:
        return 0.0
    done = float(inputs.replayed.to(torch.bool).sum())
    total = inputs.rewards.shape[0] if joint else int((~torch.isnan(inputs.rewards)).sum())
    return done / total if total else 0.0


class _RewardWeighted(AdvantageMethod):
    """Shared knobs: ``eps`` and ``reward_weights`` ({reward name: c_k}, missing names get 1)."""

    config_name: ClassVar[str] = ""
    #: Multiply the reward coefficients by SAW's batch weights (``*_saw`` methods).
    saw: ClassVar[bool] = False

    def __init__(self, eps: float = 1e-4, reward_weights: Mapping[str, float] | None = None):
        if eps < 0:
            raise ValueError(f"method.eps must be >= 0, got {eps}")
        self.eps = float(eps)
        self.reward_weights = dict(reward_weights.items()) if reward_weights else None
        self.reward_names: tuple[str, ...] | None = None
        #: Each reward's lowest value (set by setup; None: every reward starts at 0).
        self.reward_lower_bounds: tuple[float, ...] | None = None
        self._c: list[float] | None = None

    def setup(self, task, services: MethodServices | None = None) -> None:
        super().setup(task, services)
        if self.saw and getattr(task, "rewards_vary_per_prompt", False):
            uniform = self.config_name.removesuffix("_saw")
            raise ValueError(
                f"method={self.config_name} needs the same reward set for every prompt (SAW "
                f"weights each reward by its spread over the batch), but this task gives each "
                f"prompt its own constraints (rewards_vary_per_prompt=True); use "
                + (f"method={uniform} or method=mrtpo" if uniform != "mrtpo" else "method=mrtpo")
                + " instead"
            )
        if self.reward_weights:
            _refuse_unknown(
                self.reward_weights, self.reward_names, "method.reward_weights names", "this task's"
            )
            self._c = [float(self.reward_weights.get(n, 1.0)) for n in self.reward_names]

    def _c_vector(self, k: int, dtype: torch.dtype, device) -> Tensor:
        """The configured ``c_k`` as a ``[K]`` tensor (ones when none are, or for another K)."""
        if self._c is not None and len(self._c) == k:
            return torch.tensor(self._c, dtype=dtype, device=device)
        return torch.ones(k, dtype=dtype, device=device)

    def _coefficients(self, inputs: CreditInputs) -> tuple[Tensor, dict[str, float]]:
        """``c_k [K]``: configured weights, times SAW's batch weights for ``*_saw`` methods."""
        rewards = inputs.rewards
        k = rewards.shape[1]
        dtype = compute_dtype(rewards)
        if self.reward_weights and self._c is None:
            raise RuntimeError("method.reward_weights is set but setup() was never called")
        if self._c is not None and len(self._c) != k:
            raise ValueError(f"setup() saw {len(self._c)} rewards but the batch has {k}")
        c = self._c_vector(k, dtype, rewards.device)
        stats: dict[str, float] = {}
        if self.saw:
            lower = self.reward_lower_bounds
            if lower is not None and len(lower) != k:
                raise ValueError(f"setup() saw {len(lower)} rewards but the batch has {k}")
            sw = saw_weights(rewards, inputs.process_group, lower)
            c = c * sw
            names = self.reward_names or tuple(str(i) for i in range(k))
            stats = {f"saw_weight/{n}": float(v) for n, v in zip(names, sw.tolist())}
        return c, stats


class GRPO(_RewardWeighted):
    """GRPO: one scalar reward ``sum_k c_k r_k`` (NaN as 0), normalized within its group; no
    per-reward or batch normalization, so a reward with a large spread drowns the others."""

    config_name = "grpo"

    def __call__(self, inputs: CreditInputs) -> CreditOutput:
        c, stats = self._coefficients(inputs)
        adv = grpo_advantages(inputs.rewards, inputs.group, c, self.eps)
        tok = _broadcast(adv, inputs.mask)
        return CreditOutput(tok, {**stats, **_adv_stats(tok, inputs.mask)})


class GDPO(_RewardWeighted):
    """GDPO: normalize each reward in its group, sum with ``c_k``, normalize over the batch.
    The reference point for every other method."""

    config_name = "gdpo"

    def __call__(self, inputs: CreditInputs) -> CreditOutput:
        c, stats = self._coefficients(inputs)
        adv = gdpo_advantages(inputs.rewards, inputs.group, c, self.eps, inputs.process_group)
        tok = _broadcast(adv, inputs.mask)
        return CreditOutput(tok, {**stats, **_adv_stats(tok, inputs.mask)})


class GDPOSAW(GDPO):
    """GDPO with SAW: each ``A_k`` scaled by its reward's coefficient-of-variation weight, from
    each global batch. Refused where the reward set changes per prompt."""

    config_name = "gdpo_saw"
    saw = True


class MRTPO(_BetaRamp, _RewardWeighted):
    """MRTPO: GDPO's response credit, each reward's share placed on the tokens relevant to it
    (``mrtpo.core.credit.relevance``; β = 0 *is* GDPO). Knobs and the cap: docs/method.md."""

    config_name = "mrtpo"
    relevance: ClassVar[RelevanceRequest | None] = RelevanceRequest("per_reward", "jsd")
    #: Permute each pair's weights over its valid tokens (the shuffle ablation).
    shuffle: ClassVar[bool] = False

    def __init__(
        self,
        beta: float = 0.5,
        beta_warmup_steps: int = 0,
        eps: float = 1e-4,
        reward_weights: Mapping[str, float] | None = None,
        cap: str = "batch",
        context: str = "delete",
    ):
        super().__init__(eps=eps, reward_weights=reward_weights)
        # method.context is RelevanceRequest.form
        self.relevance = replace(type(self).relevance, form=str(context))
        self.cap = check_cap(cap, "method.cap")
        self.beta_max, self.beta_warmup_steps = checked_beta(
            beta,
            beta_warmup_steps,
            below_one=True,
            why=" (the paper's range: every token keeps at least 1 - beta of its credit, "
            "so at beta = 1 a token with zero relevance would get none)",
        )

    def token_weights(self, q: Tensor, mask: Tensor, replayed: Tensor, step: int) -> Tensor:
        """``(1 - β) + β q / mean q`` per reward."""
        return relevance_weights(q, mask, replayed, self.beta(step))

    def replay_pairs(self, rewards: Tensor, group: Tensor, has_block: Tensor) -> Tensor:
        pairs = replay_mask(rewards, group, has_block)
        if self.relevance.joint:
            return pairs.any(-1, keepdim=True)
        return pairs

    def __call__(self, inputs: CreditInputs) -> CreditOutput:
        joint = self.relevance.joint
        beta = self.beta(inputs.step)
        c, stats = self._coefficients(inputs)
        n, k = inputs.rewards.shape
        q, replayed = inputs.q, inputs.replayed
        _check_q(q, n, 1 if joint else k, f"{self.config_name} expects relevance q")
        w = None if q is None else self.token_weights(q, inputs.mask, replayed, inputs.step)
        used = w
        if w is not None and self.shuffle:
            rows = global_row_index(n, inputs.process_group, inputs.rewards.device)
            used = shuffle_weights(w, inputs.mask, replayed, inputs.generator, rows)
        tok, cap_stats = mrtpo_advantages_from_weights(
            inputs.rewards,
            inputs.group,
            used,
            inputs.mask,
            c,
            self.eps,
            inputs.process_group,
            joint=joint,
            return_stats=True,
            cap=self.cap,
        )
        stats.update(_adv_stats(tok, inputs.mask))
        stats["beta"] = beta
        keys = ("cap_s", "cap_bound_share", "sign_flip_share", "credit_change")
        stats.update({key: cap_stats[key] for key in keys if key in cap_stats})
        stats["replayed_share"] = _replayed_share(inputs, joint)
        if q is not None and replayed is not None:
            sel = inputs.mask.to(torch.bool)[:, None, :] & replayed.to(torch.bool)[:, :, None]
            if bool(sel.any()):
                stats["relevance_mean"] = float(q.to(torch.float32)[sel].mean())
        return CreditOutput(tok, stats, cap_stats["realloc"], weights=w)


class MRTPOSAW(MRTPO):
    """MRTPO with SAW's batch weights in ``c_k``; refused where the reward set varies per prompt."""

    config_name = "mrtpo_saw"
    saw = True


class MRTPOShuffle(MRTPO):
    """Shuffle ablation: MRTPO's weights permuted within each response (same multiset, so the
    cap and per-response mean hold; which token is relevant is lost). ``CreditInputs.generator``."""

    config_name = "mrtpo_shuffle"
    shuffle = True


class MRTPOJoint(MRTPO):
    """Joint ablation: one relevance profile (all blocks vs. none, ``q [N, 1, T]``) weights
    GDPO's summed credit; a response is replayed when any of its rewards would be."""

    config_name = "mrtpo_joint"
    relevance: ClassVar[RelevanceRequest | None] = RelevanceRequest("joint", "jsd")
