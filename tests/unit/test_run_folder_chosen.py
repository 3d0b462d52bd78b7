"""The folders a new run named (``run_folder._CHOSEN``) are remembered for that run only: a
process that starts many runs (``mrtpo.api.train`` in a loop, a notebook) does not keep one
entry per run for its lifetime."""

from __future__ import annotations

from tests.conftest import compose_config

from mrtpo.run import folder as run_folder


def test_only_the_current_runs_chosen_folders_are_kept(tmp_path):
    for i in range(20):
        cfg = compose_config("train.yaml", [f"paths.output_dir={tmp_path / f'run{i}'}"])
        run_folder.check_new_run_folder(cfg)
        assert str((tmp_path / f"run{i}").resolve()) in run_folder._CHOSEN
    assert len(run_folder._CHOSEN) <= len(run_folder._DEFAULT_FOLDERS)
    # the refused run's clean-up reads its entry once, and drops it
    assert run_folder.discard_refused_folder(cfg) is None  # nothing was made there
    assert not run_folder._CHOSEN
