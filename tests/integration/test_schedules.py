"""Rollout schedules (issue 39): one_step_off and async with the HF engine's own copy.

The HF engine with ``rollout.engine.own_copy=true`` is a real engine with weights of its own,
so the schedules run here without vLLM: batch t+1 is generated in a worker thread while the
trainer updates on batch t. The vLLM server's runs are in tests/vllm/test_vllm_server.py.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from mrtpo.lightning.pipeline import build, resume_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


COMMON = (
    "method=mrtpo",
    "method.beta_warmup_steps=2",
    "optim.lr=1e-3",
    "rl.group_size=4",
    "logger=csv",
    "rollout.engine.own_copy=true",
    "callbacks.sample_table=null",
    "callbacks.relevance_dump=null",
)


def _fit(cfg):
    trainer, module, dm = build(cfg)
    trainer.fit(module, datamodule=dm, ckpt_path=resume_checkpoint(cfg))
    return trainer, module


def _rows(out: Path) -> list[dict[str, float]]:
    with open(out / "csv" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/iteration")]
    return [{k: float(v) for k, v in r.items() if v != ""} for r in rows]


def _source(trainer):
    return next(c for c in trainer.callbacks if hasattr(c, "source")).source


def test_one_step_off_trains_on_batches_one_step_stale(train_cfg, tmp_path):
    out = tmp_path / "run"
    trainer, _ = _fit(
        train_cfg(
            *COMMON,
            "rollout.schedule=one_step_off",
            "trainer.max_steps=4",
            f"paths.output_dir={out}",
        )
    )
    rows = _rows(out)
    assert [r["train/iteration"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    assert [r["train/rollout/staleness/max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["train/rollout/dropped"] == 0.0 for r in rows)
    # step 0 was sampled by the trainer's weights: its gap is numerics only (an fp32 copy)
    assert rows[0]["train/rollout/logp_gap/max"] <= 1e-4
    # later steps are corrected and logged apart
    assert all("train/rollout/stale/tis_weight/mean" in r for r in rows[1:])
    assert all(0.5 < r["train/rollout/stale/tis_weight/mean"] <= 2.0 for r in rows[1:])
    source = _source(trainer)
    assert source.version == 4 and not source._ahead  # the worker was stopped at the end


def test_a_resumed_one_step_off_run_equals_an_uninterrupted_one(train_cfg, tmp_path):
    common = (
        *COMMON,
        "rollout.schedule=one_step_off",
        "callbacks.model_checkpoint.every_n_train_steps=1",
    )
    full = tmp_path / "full"
    _fit(train_cfg(*common, "trainer.max_steps=4", f"paths.output_dir={full}"))
    part = tmp_path / "part"
    _fit(train_cfg(*common, "trainer.max_steps=2", f"paths.output_dir={part}"))
    ckpt = part / "checkpoints" / "step000002.ckpt"
    state = torch.load(ckpt, weights_only=True)["callbacks"]
    [ahead] = [v for k, v in state.items() if "RolloutCallback" in k]
    # the batch generated ahead (step 2's, by step 1's weights) is in the checkpoint
    assert [a["index"] for a in ahead["ahead"]] == [2] and ahead["ahead"][0]["version"] == 1
    resumed = tmp_path / "resumed"
    _fit(
        train_cfg(
            *common, "trainer.max_steps=4", f"paths.output_dir={resumed}", f"ckpt_path={ckpt}"
        )
    )
    want, got = _rows(full)[2:], _rows(resumed)
    assert [r["train/iteration"] for r in got] == [3.0, 4.0]
    skip = ("train/time/", "train/tokens_per_s", "train/rollout/generate_s", "train/rollout/push_s")
    for w, g in zip(want, got, strict=True):
        for k, v in w.items():
            if k.startswith(skip) or k in ("epoch", "step"):
                continue
            # a key the resumed run never logged is NaN in the full run's table (absent there)
            got = g.get(k, float("nan"))
            assert got == pytest.approx(v, rel=1e-6, abs=1e-6, nan_ok=True), k


def test_async_keeps_staleness_within_its_bound(train_cfg, tmp_path):
    out = tmp_path / "run"
    _fit(
        train_cfg(
            *COMMON,
            "rollout.schedule=async",
            "rollout.max_staleness=2",
            "trainer.max_steps=5",
            f"paths.output_dir={out}",
        )
    )
    rows = _rows(out)
    lag = [r["train/rollout/staleness/max"] for r in rows]
    assert len(lag) == 5 and lag[0] == 0.0
    assert all(0 <= x <= 2 for x in lag)
    assert max(lag) >= 1  # batches were generated ahead
    assert all(r["train/rollout/dropped"] == 0.0 for r in rows)


def test_a_staler_batch_than_allowed_is_generated_again(train_cfg):
    trainer, module, dm = build(train_cfg(*COMMON, "rollout.schedule=one_step_off"))
    from mrtpo.core.models import eos_token_ids

    source = _source(trainer)
    source.bind(module.policy, module.tokenizer, eos_token_ids(module.tokenizer, module.policy))
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    source.take(0, batch.examples, 7, ahead=lambda j: (batch.examples, 8))
    saved = source.state_dict()  # batch 1, generated ahead by version 0
    source.close()
    # restored while the weights moved on by three versions (past one_step_off's bound of 1)
    source.load_state_dict(saved | {"version": 3})
    again = source.take(1, batch.examples, 8)
    assert source.dropped == again.n > 0
    assert int(again.versions.min()) == 3
    source.close()


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (("rollout.engine.own_copy=false",), "rollout.engine.own_copy=true"),
        (("rollout.max_staleness=0", "rollout.schedule=async"), "rollout.max_staleness=0"),
        (("rollout.schedule=offpolicy",), "use one of sync, one_step_off, async"),
    ],
)
def test_a_schedule_the_engine_cannot_run_is_refused(train_cfg, overrides, says):
    cfg = train_cfg(*COMMON, "rollout.schedule=one_step_off", *overrides)
    with pytest.raises(Exception) as err:
        _fit(cfg)
    assert says in str(err.value)


def test_the_in_process_vllm_engine_is_refused_before_anything_loads(train_cfg):
    from mrtpo.run.checks import validate
    from mrtpo.run.settings import ConfigError

    cfg = train_cfg("rollout=vllm", "model=tiny_wide", "rollout.schedule=one_step_off")
    with pytest.raises(ConfigError, match="VLLMEngine samples from the trainer's own weights"):
        validate(cfg)
    validate(train_cfg("rollout=vllm", "model=tiny_wide"))  # sync is fine
