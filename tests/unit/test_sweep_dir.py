"""A multirun's folder (``mrtpo.run.config.sweep_dir``, issue 50 review item 4): two sweeps in one
process started in the same second over different keys get the folders their keys name; the
first's name was kept for the base time and given to the second."""

from __future__ import annotations


def test_same_second_sweeps_over_different_keys_get_their_own_folders(tmp_path):
    from mrtpo.run.config import sweep_dir

    base = str(tmp_path / "multiruns" / "2026-01-01_00-00-00")
    assert sweep_dir(base, ["method=gdpo,mrtpo", "seed=1"]) == base + "_method"
    assert sweep_dir(base, ["method=gdpo", "seed=1"]) == base + "_method"  # its job
    assert sweep_dir(base, ["seed=1,2", "method=gdpo"]) == base + "_seed"  # the next sweep
    assert sweep_dir(base, ["seed=2", "method=gdpo"]) == base + "_seed"  # its job
    # the same keys in the same second: the same folder, as Hydra's own ${now:...} folder
    # (its jobs' subfolders are numbered per sweep)
    assert sweep_dir(base, ["method=grpo,mrtpo"]) == base + "_method"
    other = str(tmp_path / "multiruns" / "2026-01-01_00-00-01")
    assert sweep_dir(other, ["seed=1"]) == other  # nothing swept, no sweep before: the base
