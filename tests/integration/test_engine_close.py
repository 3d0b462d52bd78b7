"""The rollout callback closes the engine it was built with at the end of each fit (issue 47,
item 6): a sweep of jobs in one process keeps no job's server or snapshots. An engine handed
to the callback after it was built belongs to whoever handed it in, and stays open."""

from __future__ import annotations

import lightning as L
import pytest
from omegaconf import open_dict

from mrtpo.lightning.callbacks.rollout import RolloutCallback
from mrtpo.lightning.pipeline import build
from mrtpo.rollout.hf import HFEngine

HERE = __name__
CLOSED: list[str] = []


class ClosingHFEngine(HFEngine):
    """The HF engine, recording its ``close`` calls."""

    def close(self) -> None:
        CLOSED.append("closed")
        super().close()


class _Fail(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        raise RuntimeError("a step failed")


def _built(train_cfg):
    cfg = train_cfg("rollout=hf", "callbacks.model_checkpoint=null")
    with open_dict(cfg):
        cfg.rollout.engine._target_ = f"{HERE}.ClosingHFEngine"
    trainer, module, dm = build(cfg)
    [cb] = [c for c in trainer.callbacks if isinstance(c, RolloutCallback)]
    return trainer, module, dm, cb


def test_the_engine_is_closed_at_the_end_of_a_fit_and_after_a_failure(train_cfg):
    CLOSED.clear()
    trainer, module, dm, _ = _built(train_cfg)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 2 and CLOSED == ["closed"]
    CLOSED.clear()
    trainer, module, dm, _ = _built(train_cfg)
    trainer.callbacks.append(_Fail())
    with pytest.raises(RuntimeError, match="a step failed"):
        trainer.fit(module, datamodule=dm)
    assert CLOSED and set(CLOSED) == {"closed"}


def test_an_engine_handed_in_stays_open(train_cfg):
    CLOSED.clear()
    trainer, module, dm, cb = _built(train_cfg)
    mine = ClosingHFEngine()
    cb.engine = mine
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 2 and CLOSED == []
