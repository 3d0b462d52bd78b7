"""OPSD on the tiny model: two training steps of each variant through the real pipeline, the
teacher's sampled-token scores against an obvious unpadded forward, updates that move the
student toward the teacher on a repeated batch, and the start-up refusal on text-to-SQL."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from tests.task_fixtures import make_public_data

from mrtpo.core.chat import chat_ids
from mrtpo.core.credit import CreditInputs, generalized_jsd_chunked
from mrtpo.core.forward import response_logits
from mrtpo.core.loss import policy_loss
from mrtpo.lightning.pipeline import build, metrics_csv
from mrtpo.rollout.base import SamplingConfig
from mrtpo.rollout.build import build_rollout
from mrtpo.rollout.hf import HFEngine

OPSD_SMALL = ("method=opsd", "task=synthetic", "rollout.sampling.temperature=1.0")


def _rows(trainer) -> list[dict[str, str]]:
    with open(metrics_csv(trainer)) as f:
        return list(csv.DictReader(f))


def _num(row, key) -> float:
    v = row.get(key)
    return float("nan") if v in (None, "") else float(v)


@pytest.mark.parametrize("variant", ["full", "sampled"])
def test_two_training_steps(train_cfg, variant):
    cfg = train_cfg(*OPSD_SMALL, f"method.variant={variant}")
    trainer, module, dm = build(cfg)
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    trainer.fit(module, datamodule=dm)
    assert module.iteration == 2 and trainer.global_step == 2
    rows = _rows(trainer)
    assert [r["step"] for r in rows] == ["0", "1"]
    for r in rows:
        assert math.isfinite(_num(r, "train/loss"))
        if variant == "full":
            assert _num(r, "train/distill/divergence") > 0
            assert 0.0 <= _num(r, "train/distill/teacher_agree") <= 1.0
            assert math.isfinite(_num(r, "train/distill/logp_gap"))
            assert _num(r, "train/adv/abs_mean") == 0.0  # no reward credit
        else:
            assert _num(r, "train/adv/teacher_share") == 1.0  # every synthetic example
            assert 0.0 <= _num(r, "train/adv/teacher_agree") <= 1.0
            assert _num(r, "train/adv/divergence") == pytest.approx(-_num(r, "train/adv/logp_gap"))
    # the student trained; the teacher (the initial weights) did not
    after = module.policy.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    teacher = module.method.frozen.model.state_dict()
    assert all(torch.equal(before[k], teacher[k].cpu()) for k in before)
    assert not any(k.startswith("teacher") for k in module.state_dict())  # not checkpointed


def test_teacher_scores_equal_an_unpadded_forward(tiny):
    from mrtpo.core.credit import OPSD
    from mrtpo.core.credit.teacher import Teacher
    from mrtpo.tasks.synthetic.task import SyntheticTask

    model, tok = tiny
    model.eval()
    task = SyntheticTask(num_constraints=2)
    engine = HFEngine()
    eos = [tok.eos_token_id]
    engine.bind(model, tok, eos)
    roll = build_rollout(
        engine, tok, task.examples("train")[:2], 3, SamplingConfig(max_new_tokens=10), 0, eos
    )
    student = torch.zeros(roll.response_ids.shape)
    # a small budget: several packed forwards
    got = Teacher(model, tok, token_budget=64).score(task, roll, student, chunk=5)
    assert bool(got.rows.all())
    for j in range(roll.n):
        k = int(roll.response_mask[j].sum())
        y = roll.response_ids[j, :k].tolist()
        ids = torch.tensor([chat_ids(tok, task.teacher_messages(roll.examples[j])) + y])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        p = ids.shape[1] - k
        lp = torch.log_softmax(logits[p - 1 : p - 1 + k], -1)
        want = lp.gather(-1, torch.tensor(y)[:, None])[:, 0]
        torch.testing.assert_close(got.logp[j, :k], want, atol=2e-5, rtol=0)
        assert torch.equal(got.top1[j, :k], lp.argmax(-1) == torch.tensor(y))
        assert bool((got.logp[j, k:] == 0).all())
    assert (
        OPSD(variant="sampled")(
            CreditInputs(
                rewards=torch.zeros(roll.n, 1),
                group=roll.group,
                mask=roll.response_mask,
                extra=got,
            )
        ).advantages.shape
        == roll.response_ids.shape
    )


@pytest.mark.parametrize("variant", ["full", "sampled"])
def test_updates_move_the_student_toward_the_teacher(train_cfg, variant):
    torch.manual_seed(0)
    cfg = train_cfg(*OPSD_SMALL, f"method.variant={variant}")
    _, module, _ = build(cfg)
    policy, tok, task = module.policy, module.tokenizer, module.task
    eos = [tok.eos_token_id]
    engine = HFEngine()
    engine.bind(policy, tok, eos)
    roll = build_rollout(
        engine, tok, task.examples("train")[:2], 4, SamplingConfig(max_new_tokens=12), 0, eos
    )
    mask = roll.response_mask
    tokens = float(mask.sum())

    def gaps() -> tuple[float, float]:
        """(generalized JSD per token, mean |log p_s(y) - log p_t(y)|) on the fixed samples."""
        with torch.no_grad():
            logits = response_logits(
                policy, roll.prompt_ids, roll.prompt_mask, roll.response_ids, mask
            )
            t_logits, _ = module.method.frozen.logits(task, roll)
            div, t_y, s_y, _ = generalized_jsd_chunked(
                logits, t_logits, mask, roll.response_ids, beta=0.5
            )
        return float(div[mask].mean()), float((s_y - t_y)[mask].abs().mean())

    d0, g0 = gaps()
    assert d0 > 0 and g0 > 0  # the reference in the teacher's context moves the tiny model
    # the random tiny model barely separates teacher and student (JSD ~2e-5 nats): small steps
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-5)
    policy.train()
    for _ in range(6):
        opt.zero_grad(set_to_none=True)
        if variant == "full":
            logp, logits = module.step.updater.policy_logprobs(
                roll, 1.0, module.method.wants_logits
            )
            loss, _ = module.method.token_loss(logits, roll, 1.0, "token-mean", tokens)
        else:
            old = module.step.passes.logprobs(policy, roll, micro=8)
            scores = module.method.frozen.score(task, roll, old)
            adv = module.method(
                CreditInputs(
                    rewards=torch.zeros(roll.n, 1), group=roll.group, mask=mask, extra=scores
                )
            ).advantages
            logp, logits = module.step.updater.policy_logprobs(
                roll, 1.0, module.method.wants_logits
            )
            assert logits is None
            loss, _ = policy_loss(logp, logp.detach(), adv, mask, denom=tokens)
        loss.backward()
        opt.step()
    d1, g1 = gaps()
    if variant == "full":
        assert d1 < 0.6 * d0, (d0, d1)
    else:
        assert g1 < 0.6 * g0, (g0, g1)


def test_opsd_on_text_to_sql_needs_reference_solutions(train_cfg, tmp_path):
    data = make_public_data(tmp_path / "data")
    small = ("method=opsd", "task=text2sql", f"paths.data_dir={data}")
    with pytest.raises(ValueError, match=r"method=opsd .*task\.reference_solutions"):
        build(train_cfg(*small))
    # OmniSQL's layout: accepted, and the teacher reads the solution in the answer format
    _, module, _ = build(
        train_cfg(
            *small, f"task.reference_solutions={data}/omnisql/train_spider_enhanced_with_cot.json"
        )
    )
    try:
        ex = module.task.examples("train")[0]
        msgs = module.task.teacher_messages(ex)
        assert msgs[-2]["role"] == "assistant" and msgs[-2]["content"].startswith("<think>\nStep 1")
        assert ex.data["query"] in msgs[-2]["content"]
        # the gold fallback is the task's own reference response
        module.task.solutions = type(module.task.solutions)("gold")
        assert module.task.teacher_messages(ex)[-2]["content"] == ex.reference
    finally:
        module.task.close()


@pytest.mark.parametrize("variant", ["full", "sampled"])
def test_under_lora_the_teacher_is_the_base_with_adapters_off(train_cfg, variant):
    from mrtpo.core.lora import is_lora

    cfg = train_cfg(*OPSD_SMALL, f"method.variant={variant}", "model.lora.r=4", "optim.lr=0.02")
    trainer, module, dm = build(cfg)
    assert is_lora(module.policy) and module.method.frozen.model is module.policy
    assert module.method.frozen.adapters_off
    trainer.fit(module, datamodule=dm)
    assert module.iteration == 2
    rows = _rows(trainer)
    key = "train/distill/divergence" if variant == "full" else "train/adv/divergence"
    assert all(math.isfinite(_num(r, key)) for r in rows)
    # the adapters moved the policy, so the teacher (adapters off) now differs from it
    tok, task = module.tokenizer, module.task
    eos = [tok.eos_token_id]
    engine = HFEngine()
    engine.bind(module.policy, tok, eos)
    roll = build_rollout(
        engine, tok, task.examples("train")[:1], 2, SamplingConfig(max_new_tokens=6), 0, eos
    )
    with torch.no_grad():
        with module.policy.disable_adapter():
            base = response_logits(
                module.policy, *_ctx(tok, task, roll), roll.response_ids, roll.response_mask
            )
        adapted = response_logits(
            module.policy, *_ctx(tok, task, roll), roll.response_ids, roll.response_mask
        )
    t_logits, _ = module.method.frozen.logits(task, roll)
    t_all = (
        t_logits if isinstance(t_logits, torch.Tensor) else t_logits(0, roll.response_ids.shape[1])
    )
    torch.testing.assert_close(t_all.float(), base.float(), atol=1e-4, rtol=0)
    assert not torch.allclose(t_all.float(), adapted.float(), atol=1e-4)


def _ctx(tok, task, roll):
    from mrtpo.core.forward import pad_left

    return pad_left(
        [chat_ids(tok, task.teacher_messages(e)) for e in roll.examples], tok.pad_token_id
    )
