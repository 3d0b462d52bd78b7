"""A resume continues the same run: settings that change what is computed are refused.

Issue 25 item 15: a resume accepted other settings silently (``rl.group_size`` 3 -> 4,
``method.beta`` 0.25 -> 0.5) or with a warning only (``seed``, ``rl.prompts_per_step``).
Each checkpoint now records the run's settings; a ``+resume`` may change only the keys of
``mrtpo.run.resume.RESUME_MAY_CHANGE`` and is refused, before anything is written, otherwise.
"""

from __future__ import annotations

import csv
import hashlib
from pathlib import Path

import pytest

from mrtpo.lightning.pipeline import train
from mrtpo.run.resume import ResumeRefused

RUN = (
    "callbacks.model_checkpoint.every_n_train_steps=1",
    "callbacks.sample_table=null",
    "callbacks.relevance_dump=null",
    "callbacks.export=null",
    "rl.group_size=3",
    "method.beta=0.25",
)


def tree_hash(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_resume_that_changes_the_run_is_refused_before_anything_is_written(train_cfg, tmp_path):
    run = tmp_path / "run"
    train(train_cfg(*RUN, f"paths.output_dir={run}"))
    before = tree_hash(run)

    def resume(*change: str):
        return train(
            train_cfg(
                *RUN, f"paths.output_dir={run}", f"+resume={run}", "trainer.max_steps=3", *change
            )
        )

    for change, shown in [
        ("rl.group_size=4", "rl.group_size: 3 -> 4"),
        ("method.beta=0.5", "method.beta: 0.25 -> 0.5"),
        ("seed=1", "seed: 0 -> 1"),
        ("rl.prompts_per_step=3", "rl.prompts_per_step: 2 -> 3"),
    ]:
        with pytest.raises(ResumeRefused) as info:
            resume(change)
        msg = str(info.value)
        assert shown in msg and "may change only" in msg and "ckpt_path=" in msg, msg
        assert tree_hash(run) == before, change
    # what a resume may change: more steps, memory and speed knobs, where the progress goes
    resume("replay.token_budget=4096", "rl.micro_batch_size=1", "callbacks.progress=null",
           "rl.shared_prompt_forward=always", "rl.measure_logp_gap=false")  # fmt: skip
    with open(run / "csv" / "metrics.csv", newline="") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["0", "1", "2"]


def test_the_list_of_what_a_resume_may_change():
    from mrtpo.run.resume import RESUME_MAY_CHANGE, may_change

    assert may_change("trainer.max_steps") and may_change("paths.data_dir")
    assert may_change("replay.token_budget") and may_change("callbacks.progress.min_interval_s")
    # how a forward is computed (each prompt once) and whether the engine gap is logged
    assert may_change("rl.shared_prompt_forward") and may_change("rl.measure_logp_gap")
    for key in ("seed", "rl.group_size", "rl.prompts_per_step", "method.beta", "optim.lr"):
        assert not may_change(key), key
    assert not may_change("model.name_or_path") and not may_change("rollout.sampling.temperature")
    assert len(RESUME_MAY_CHANGE) == len(set(RESUME_MAY_CHANGE))
