"""The replication's warm-start jobs: which policy each pass starts from, and in what order."""

from __future__ import annotations

from pathlib import Path

import pytest

from mrtpo.analysis import replication as rep


def _start(job) -> str | None:
    names = [o.split("=", 1)[1] for o in job.overrides if o.startswith("model.name_or_path=")]
    return names[0] if names else None


def test_curriculum_k_starts_its_clean_pass_from_the_other_k(tmp_path):
    opts = rep.Options(k_values=[2, 4, 8], logdir=tmp_path)
    for k in (2, 4):  # from random weights: the toy model's builder, no name_or_path override
        assert _start(rep.sft_job(k, "sft", opts)) is None
    (child, parent) = next(iter(rep.CURRICULUM.items()))
    job = rep.sft_job(child, "sft", opts)
    assert Path(_start(job)) == tmp_path / f"k{parent}" / "sft" / "policy"
    assert "model.tiny=null" in job.overrides
    # the noisy pass of every K starts from that K's own clean pass
    for k in (2, 4, 8):
        noisy = rep.sft_job(k, "sft_noisy", opts)
        assert Path(_start(noisy)) == tmp_path / f"k{k}" / "sft" / "policy"


def test_waves_run_a_parent_before_its_child_and_noisy_passes_last(monkeypatch):
    monkeypatch.setattr(rep, "CURRICULUM", {6: 4, 8: 6})
    assert rep.sft_waves([2, 4, 6]) == [
        [(2, "sft"), (4, "sft")],
        [(6, "sft")],
        [(2, "sft_noisy"), (4, "sft_noisy"), (6, "sft_noisy")],
    ]
    # a parent that is not compared still gets its clean pass (and no noisy one)
    assert rep.sft_waves([8]) == [[(4, "sft")], [(6, "sft")], [(8, "sft")], [(8, "sft_noisy")]]
    monkeypatch.setattr(rep, "CURRICULUM", {})
    assert rep.sft_waves([2, 4]) == [[(2, "sft"), (4, "sft")], [(2, "sft_noisy"), (4, "sft_noisy")]]


@pytest.mark.parametrize("k", sorted(rep.CURRICULUM))
def test_every_curriculum_k_is_a_full_mode_k_or_its_parent(k):
    assert k in rep.FULL_K and rep.CURRICULUM[k] in rep.FULL_K
