"""The replication's OPSD teacher check, on the toy model as built (random weights)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf
from tests.conftest import compose_config

from mrtpo.core.models import load_policy
from replication.harness import teacher_check


def test_teacher_check_scores_both_contexts(cache_dir):
    cfg = compose_config(
        "train.yaml", ["experiment=toy_replication", f"paths.cache_dir={cache_dir}"]
    )
    load_policy(**OmegaConf.to_container(cfg.model, resolve=True))  # builds the toy model
    out = teacher_check(Path(cfg.model.name_or_path), 2, n=4)
    assert out["prompts"] == 4
    for key in ("success_plain", "success_teacher", "copy_plain", "copy_teacher"):
        assert 0.0 <= out[key] <= 1.0, (key, out[key])
    # the plain prompt never holds the reference: a random model does not write it out
    assert out["copy_plain"] == 0.0
