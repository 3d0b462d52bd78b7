"""The concrete AdvantageMethod classes and their configs/method/*.yaml files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from tests.conftest import compose_config

from mrtpo.core.credit import (
    GDPO,
    GDPOSAW,
    GRPO,
    MRTPO,
    MRTPOSAW,
    AdvantageMethod,
    CreditInputs,
    MRTPOJoint,
    MRTPOShuffle,
    RelevanceRequest,
    gdpo_advantages,
    grpo_advantages,
    replay_mask,
    saw_weights,
)
from mrtpo.core.credit.methods import RewardSet

METHOD_DIR = Path(__file__).resolve().parents[2] / "configs" / "method"
NAN = float("nan")
NAMES = ("format", "runs", "match")


def make_inputs(seed: int = 0, joint: bool = False, step: int = 0) -> CreditInputs:
    gen = torch.Generator().manual_seed(seed)
    n, k, t = 12, 3, 7
    rewards = torch.randint(0, 2, (n, k), generator=gen).float()
    rewards[torch.rand(n, k, generator=gen) < 0.15] = NAN
    group = torch.arange(n) // 4
    mask = torch.arange(t)[None] < torch.randint(2, t + 1, (n, 1), generator=gen)
    replayed = replay_mask(rewards, group)
    if joint:
        replayed = replayed.any(-1, keepdim=True)
    q = torch.rand(n, replayed.shape[1], t, generator=gen) ** 2
    return CreditInputs(rewards, group, mask, step=step, q=q, replayed=replayed)


def test_every_config_instantiates_its_method() -> None:
    files = sorted(METHOD_DIR.glob("*.yaml"))
    assert len(files) >= 9
    for f in files:
        # as a run composes it (a preset may extend another with its defaults list)
        method = instantiate(compose_config("train.yaml", [f"method={f.stem}"]).method)
        assert isinstance(method, AdvantageMethod)
        assert type(method).config_name == f.stem
        method.setup(RewardSet(NAMES, False, info_in_prompt=True))  # (CoRT needs it)
        inputs = make_inputs(joint=method.relevance is not None and method.relevance.joint)
        out = method(inputs)
        assert out.advantages.shape == inputs.mask.shape
        assert not torch.isnan(out.advantages).any()
        assert {"mean", "std", "min", "max"} <= set(out.stats)


def test_reward_weights_from_config_override() -> None:
    cfg = OmegaConf.load(METHOD_DIR / "mrtpo.yaml")
    cfg.reward_weights = {"match": 2.0, "format": 0.5}
    cfg.beta = 0.0
    method = instantiate(cfg)
    method.setup(RewardSet(NAMES, False))
    inputs = make_inputs(8)
    ref = gdpo_advantages(inputs.rewards, inputs.group, [0.5, 1.0, 2.0])
    assert torch.equal(method(inputs).advantages[:, 0], ref)


def test_relevance_attribute() -> None:
    assert GRPO.relevance is None and GDPO.relevance is None and GDPOSAW.relevance is None
    per = RelevanceRequest("per_reward", "jsd")
    assert MRTPO.relevance == per and MRTPOSAW.relevance == per and MRTPOShuffle.relevance == per
    assert MRTPOJoint.relevance == RelevanceRequest("joint", "jsd")


@pytest.mark.parametrize("cls", [GDPOSAW, MRTPOSAW])
def test_saw_refuses_per_prompt_rewards(cls: type[AdvantageMethod]) -> None:
    method = cls()
    with pytest.raises(ValueError, match=f"method={cls.config_name} needs the same reward set"):
        method.setup(RewardSet(("c0", "c1"), True))
    with pytest.raises(ValueError, match="use method="):
        cls().setup(RewardSet(("c0", "c1"), True))
    cls().setup(RewardSet(NAMES, False))  # fine with a fixed reward set


def test_non_saw_methods_accept_per_prompt_rewards() -> None:
    for cls in (GRPO, GDPO, MRTPO, MRTPOShuffle, MRTPOJoint):
        cls().setup(RewardSet(("c0", "c1"), True))


def test_reward_weights_by_name() -> None:
    inputs = make_inputs(1)
    method = GDPO(reward_weights={"match": 2.0})
    method.setup(RewardSet(NAMES, False))
    got = method(inputs).advantages
    ref = gdpo_advantages(inputs.rewards, inputs.group, [1.0, 1.0, 2.0])
    assert torch.equal(got, torch.where(inputs.mask, ref[:, None].expand(got.shape), 0.0))
    with pytest.raises(ValueError, match=r"method.reward_weights names unknown reward\(s\)"):
        GDPO(reward_weights={"nope": 1.0}).setup(RewardSet(NAMES, False))
    grpo = GRPO(reward_weights={"format": 0.0})
    grpo.setup(RewardSet(NAMES, False))
    ref = grpo_advantages(inputs.rewards, inputs.group, [0.0, 1.0, 1.0])
    assert torch.equal(grpo(inputs).advantages[:, 0], ref)


def test_invalid_knobs_name_the_config_key() -> None:
    with pytest.raises(ValueError, match=r"method\.beta "):
        MRTPO(beta=1.5)
    # the paper's range is [0, 1): at 1 a token of zero relevance would lose all its credit
    for cls in (MRTPO, MRTPOSAW, MRTPOShuffle, MRTPOJoint):
        with pytest.raises(ValueError, match=r"method\.beta must be in \[0, 1\)"):
            cls(beta=1.0)
    assert MRTPO(beta=0.999).beta_max == 0.999
    with pytest.raises(ValueError, match=r"method\.beta_warmup_steps"):
        MRTPO(beta_warmup_steps=-1)
    with pytest.raises(ValueError, match=r"method\.eps"):
        GDPO(eps=-1.0)


def test_mrtpo_beta0_class_equals_gdpo_class_bit_for_bit() -> None:
    for seed in range(5):
        inputs = make_inputs(seed)
        gdpo = GDPO()(inputs).advantages
        for cls in (MRTPO, MRTPOShuffle):
            assert torch.equal(cls(beta=0.0)(inputs).advantages, gdpo)
        assert torch.equal(MRTPOJoint(beta=0.0)(make_inputs(seed, joint=True)).advantages, gdpo)
        # Step 0 of a warm-up is β = 0 too.
        assert torch.equal(MRTPO(beta=0.5, beta_warmup_steps=10)(inputs).advantages, gdpo)


def test_mrtpo_without_replay_is_uniform() -> None:
    inputs = make_inputs(2)
    inputs.q, inputs.replayed = None, None
    out = MRTPO(beta=0.5)(inputs)
    assert torch.equal(out.advantages, GDPO()(inputs).advantages)
    assert out.stats["replayed_share"] == 0.0 and out.stats["cap_s"] == 1.0


def test_mrtpo_stats_and_mean_credit() -> None:
    inputs = make_inputs(3, step=5)
    method = MRTPO(beta=0.5, beta_warmup_steps=10)
    out = method(inputs)
    assert out.stats["beta"] == pytest.approx(0.25)
    assert 0 < out.stats["cap_s"] <= 1
    present = int((~torch.isnan(inputs.rewards)).sum())
    assert out.stats["replayed_share"] == pytest.approx(int(inputs.replayed.sum()) / present)
    assert 0 <= out.stats["relevance_mean"] <= 1
    gdpo = GDPO()(inputs).advantages[:, 0]
    m = inputs.mask
    assert torch.allclose((out.advantages * m).sum(-1) / m.sum(-1), gdpo, atol=1e-6)
    assert not torch.allclose(out.advantages, GDPO()(inputs).advantages)


def test_replay_pairs() -> None:
    inputs = make_inputs(4)
    has_block = torch.rand(12, 3, generator=torch.Generator().manual_seed(0)) < 0.7
    per = MRTPO().replay_pairs(inputs.rewards, inputs.group, has_block)
    assert torch.equal(per, replay_mask(inputs.rewards, inputs.group, has_block))
    joint = MRTPOJoint().replay_pairs(inputs.rewards, inputs.group, has_block)
    assert joint.shape == (12, 1) and torch.equal(joint[:, 0], per.any(-1))
    with pytest.raises(NotImplementedError):
        GDPO().replay_pairs(inputs.rewards, inputs.group, has_block)


def test_relevance_shape_is_checked() -> None:
    with pytest.raises(ValueError, match=r"expects relevance q of shape \[N=12, 1, T\]"):
        MRTPOJoint()(make_inputs(0, joint=False))


def test_saw_methods_use_saw_weights() -> None:
    inputs = make_inputs(5)
    method = GDPOSAW()
    method.setup(RewardSet(NAMES, False))
    out = method(inputs)
    sw = saw_weights(inputs.rewards)
    ref = gdpo_advantages(inputs.rewards, inputs.group, sw)
    assert torch.equal(out.advantages[:, 0], ref)
    assert out.stats["saw_weight/match"] == pytest.approx(float(sw[2]))
    mrtpo_saw = MRTPOSAW(beta=0.0)
    mrtpo_saw.setup(RewardSet(NAMES, False))
    assert torch.equal(mrtpo_saw(inputs).advantages, out.advantages)


def test_saw_methods_use_the_tasks_reward_ranges() -> None:
    from mrtpo.tasks.text2sql.task import Text2SQLTask
    from mrtpo.tasks.toolcall.task import ToolCallTask

    assert ToolCallTask.reward_ranges == {"correctness": (-3.0, 3.0)}
    assert Text2SQLTask.reward_ranges == {}  # binary rewards: nothing to shift
    names = tuple(ToolCallTask.reward_names)
    # format 1, 1, 0, 1 (CV 0.5 / 0.75); correctness 3, -3, 3, -3 (+3: CV sqrt(12) / 3)
    rewards = torch.tensor([[1.0, 3.0], [1.0, -3.0], [0.0, 3.0], [1.0, -3.0]])
    inputs = CreditInputs(rewards, torch.tensor([0, 0, 1, 1]), torch.ones(4, 3, dtype=torch.bool))
    cv_f, cv_c = 0.5 / 0.75, 12**0.5 / 3
    for cls in (GDPOSAW, MRTPOSAW):
        method = cls()
        method.setup(RewardSet(names, False, ToolCallTask.reward_ranges))
        out = method(inputs)
        assert out.stats["saw_weight/format"] == pytest.approx(2 * cv_f / (cv_f + cv_c))
        assert out.stats["saw_weight/correctness"] == pytest.approx(2 * cv_c / (cv_f + cv_c))
    plain = GDPOSAW()
    plain.setup(RewardSet(names, False))  # no ranges: every reward counts from 0, as before
    assert plain(inputs).stats["saw_weight/correctness"] == pytest.approx(2.0)


def test_reward_ranges_are_validated() -> None:
    with pytest.raises(ValueError, match=r"unknown reward\(s\) \['nope'\]"):
        GDPOSAW().setup(RewardSet(NAMES, False, {"nope": (0.0, 1.0)}))
    with pytest.raises(ValueError, match="lowest above highest"):
        GDPOSAW().setup(RewardSet(NAMES, False, {"match": (1.0, 0.0)}))


def test_shuffle_uses_the_generator() -> None:
    inputs = make_inputs(6)
    inputs.generator = torch.Generator().manual_seed(0)
    a = MRTPOShuffle()(inputs).advantages
    inputs.generator = torch.Generator().manual_seed(0)
    b = MRTPOShuffle()(inputs).advantages
    inputs.generator = torch.Generator().manual_seed(1)
    c = MRTPOShuffle()(inputs).advantages
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(a, MRTPO()(inputs).advantages)


def test_joint_single_reward_class_equals_mrtpo() -> None:
    inputs = make_inputs(7)
    one = CreditInputs(
        inputs.rewards[:, :1], inputs.group, inputs.mask, q=inputs.q[:, :1],
        replayed=inputs.replayed[:, :1],
    )  # fmt: skip
    assert torch.allclose(MRTPOJoint()(one).advantages, MRTPO()(one).advantages, atol=1e-6)
