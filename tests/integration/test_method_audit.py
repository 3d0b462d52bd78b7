"""Method settings the paper fixes: β's range and the presets' warm-up."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from tests.conftest import ROOT

from mrtpo.core import models
from mrtpo.lightning.pipeline import train

MRTPO_PRESETS = sorted(p.stem for p in (ROOT / "configs" / "method").glob("mrtpo*.yaml"))


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before method.beta was checked")

    monkeypatch.setattr(models, "load_policy", refuse)


@pytest.mark.parametrize("method", ["mrtpo", "mrtpo_saw", "mrtpo_joint"])
def test_beta_one_is_refused_before_the_model_loads(train_cfg, no_model_load, method):
    cfg = train_cfg(f"method={method}", "method.beta=1.0")
    with pytest.raises(Exception, match=r"method\.beta must be in \[0, 1\)") as err:
        train(cfg)
    assert "got 1.0" in str(err.value)


def test_mrtpo_presets_state_their_warm_up(train_cfg):
    """Every MRTPO preset ramps β over the same documented number of steps."""
    assert set(MRTPO_PRESETS) == {"mrtpo", "mrtpo_saw", "mrtpo_shuffle", "mrtpo_joint"}
    doc = (ROOT / "docs" / "method.md").read_text()
    for name in MRTPO_PRESETS:
        method = OmegaConf.to_container(train_cfg(f"method={name}").method, resolve=True)
        assert method["beta_warmup_steps"] == 10, name
        assert method["beta"] == 0.5, name
    assert "`beta_warmup_steps: 10`" in doc
