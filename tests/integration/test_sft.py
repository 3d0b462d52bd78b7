"""The SFT stage on the synthetic task: prompt masking, loss, target stop, RL from the result."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from mrtpo.lightning.pipeline import build, metrics_csv
from mrtpo.lightning.sft import IGNORE, SavePolicy, collate_sft, read_summary


def _fit(cfg):
    trainer, module, dm = build(cfg)
    trainer.fit(module, datamodule=dm)
    return trainer, module


def _losses(trainer) -> list[float]:
    with open(metrics_csv(trainer)) as f:
        return [float(r["sft/loss"]) for r in csv.DictReader(f) if r.get("sft/loss")]


def _sft(train_cfg, tmp_path, *overrides: str):
    return train_cfg(
        "stage=sft",
        "model=toy",
        "stage.sft.batch_size=8",
        "stage.sft.eval_prompts=8",
        "stage.sft.eval_max_new_tokens=8",
        f"stage.sft.save_dir={tmp_path}/policy",
        *overrides,
    )


def test_prompt_tokens_carry_no_loss():
    batch = collate_sft([[1, 2, 3], [4]], [[7, 8, 0], [9, 0]], pad_id=5)
    assert batch.input_ids.tolist() == [[1, 2, 3, 7, 8, 0], [4, 9, 0, 5, 5, 5]]
    assert batch.labels.tolist() == [
        [IGNORE, IGNORE, IGNORE, 7, 8, 0],
        [IGNORE, 9, 0, IGNORE, IGNORE, IGNORE],
    ]
    assert batch.attention_mask.tolist() == [[1] * 6, [1, 1, 1, 0, 0, 0]]
    assert batch.n_targets == 5


def test_sft_lowers_the_loss_and_saves_a_loadable_policy(train_cfg, tmp_path):
    cfg = _sft(train_cfg, tmp_path, "trainer.max_steps=20", "stage.sft.lr=3e-3")
    trainer, module = _fit(cfg)
    losses = _losses(trainer)
    assert len(losses) == 20
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 1.0, (first, last)
    # held-out metrics were logged, and the policy and its summary were saved
    summary = read_summary(tmp_path / "policy")
    assert summary["steps"] == 20 and summary["task"] == "synthetic"
    assert [h["step"] for h in summary["history"]] == [10.0, 20.0]
    assert summary["history"][-1]["loss"] < summary["history"][0]["loss"]
    assert (tmp_path / "policy" / "config.json").exists()

    # RL starts from it: same weights, through the ordinary model config keys
    rl = train_cfg(f"model.name_or_path={tmp_path}/policy", "model.tiny=null", "method=mrtpo")
    trainer, rl_module, dm = build(rl)
    for (name, a), b in zip(
        module.policy.state_dict().items(), rl_module.policy.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, msg=f"{name} differs after save/load")
    trainer.fit(rl_module, datamodule=dm)
    assert rl_module.iteration == 2


@pytest.mark.parametrize("stop_when", ["above", "below"])
def test_sft_stops_at_the_target_rate(train_cfg, tmp_path, stop_when):
    # success >= 0 and (for an untrained policy) success <= 0 hold at the first check after
    # min_steps: training must stop there, not at max_steps
    cfg = _sft(
        train_cfg,
        tmp_path,
        "trainer.max_steps=50",
        "stage.sft.target_success=0.0",
        f"stage.sft.stop_when={stop_when}",
        "stage.sft.eval_every=2",
        "stage.sft.min_steps=3",
    )
    trainer, _ = _fit(cfg)
    assert trainer.global_step == 4
    info = json.loads((tmp_path / "policy" / SavePolicy.FILE).read_text())
    assert info["reached"] is True and info["reached_at_step"] == 4
    assert info["stop_when"] == stop_when
    assert [h["step"] for h in info["history"]] == [4.0]  # no checks before min_steps


def test_unknown_sft_key_is_named(train_cfg, tmp_path):
    cfg = _sft(train_cfg, tmp_path, "+stage.sft.learning_rate=1e-3")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['learning_rate'\] in 'stage.sft'"):
        build(cfg)


def test_unknown_target_metric_lists_the_task_metrics(train_cfg, tmp_path):
    cfg = _sft(
        train_cfg,
        tmp_path,
        "trainer.max_steps=2",
        "stage.sft.eval_every=1",
        "stage.sft.target_success=0.5",
        "stage.sft.target_metric=accuracy",
    )
    with pytest.raises(ValueError, match=r"stage.sft.target_metric='accuracy'.*success"):
        _fit(cfg)


def test_teacher_share_trains_on_the_teacher_context(train_cfg, tmp_path):
    """A seeded share of examples reads the task's teacher context; the target stays the
    reference."""
    from mrtpo.core.chat import chat_ids

    cfg = _sft(train_cfg, tmp_path, "stage.sft.teacher_share=0.5")
    _, module, dm = build(cfg)
    dm.setup("fit")
    examples = dm.train_examples[:200]
    batch_forms = []
    for e in examples:
        ctx = module.context(e)
        teacher = module.task.teacher_messages(e)
        assert ctx in (e.messages, teacher)
        batch_forms.append(ctx == teacher)
        # the same example always gets the same form (the token cache relies on it)
        assert module.context(e) == ctx
    share = sum(batch_forms) / len(batch_forms)
    assert 0.35 < share < 0.65, share
    # the encoded batch holds those contexts, then the reference and EOS
    e = next(x for x, t in zip(examples, batch_forms, strict=True) if t)
    sft = module.encode([e])
    n_ctx = len(chat_ids(module.tokenizer, module.task.teacher_messages(e)))
    assert sft.input_ids[0, :n_ctx].tolist() == chat_ids(
        module.tokenizer, module.task.teacher_messages(e)
    )
    assert (sft.labels[0, :n_ctx] == IGNORE).all() and sft.n_targets > 0

    none = build(_sft(train_cfg, tmp_path, "stage.sft.teacher_share=0.0"))[1]
    assert all(none.context(x) == x.messages for x in examples)
    with pytest.raises(ValueError, match=r"stage.sft.teacher_share"):
        build(_sft(train_cfg, tmp_path, "stage.sft.teacher_share=1.5"))


def test_a_loose_generation_config_of_the_starting_model_does_not_fail_the_save(
    train_cfg, tmp_path, cache_dir, tiny
):
    """A starting model whose generation_config sets ``top_k`` without ``do_sample``
    (transformers warns on load, refuses on save) used to train, then crash saving the warm
    start. The saved policy keeps the token ids; the user's folder is only read."""
    import hashlib
    import shutil

    start = tmp_path / "loose"
    shutil.copytree(cache_dir / "models" / "tiny-qwen2", start)
    (start / "mrtpo_tiny.json").unlink()  # a model of the user's, not one the project built
    gen_file = start / "generation_config.json"
    loose = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    loose.update(do_sample=False, top_k=5)
    gen_file.write_text(json.dumps(loose))

    def digest() -> str:
        h = hashlib.sha256()
        for p in sorted(start.rglob("*")):
            if p.is_file():
                h.update(p.name.encode() + p.read_bytes())
        return h.hexdigest()

    before = digest()
    cfg = _sft(
        train_cfg,
        tmp_path,
        f"model.name_or_path={start}",
        "model.tiny=null",
        "trainer.max_steps=2",
    )
    _, module = _fit(cfg)
    saved = json.loads((tmp_path / "policy" / "generation_config.json").read_text())
    assert "top_k" not in saved or saved["top_k"] in (None, 50)
    assert saved.get("eos_token_id") == module.policy.generation_config.eos_token_id
    assert module.policy.generation_config.top_k == 5  # the model's own is put back
    assert digest() == before
