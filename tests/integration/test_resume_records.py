"""A resumed run keeps one set of ``samples.jsonl`` and ``relevance.jsonl`` records per step
(issue 37 case 6), as it keeps one ``metrics.csv`` row per step.

A run stopped after its checkpoint has written the records of steps that the resumed run
computes again. They used to stay, so those steps had their records twice (8 instead of 4).
On resume the records of steps after the checkpoint's are now dropped: the file is rewritten
beside itself and renamed into place, keeping every earlier record as it was.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from mrtpo.lightning.pipeline import train

FILES = ("samples.jsonl", "relevance.jsonl")

RUN = (
    "method=mrtpo",
    "method.beta_warmup_steps=0",  # replayed from the first step: relevance records at once
    "callbacks.model_checkpoint.every_n_train_steps=1",
    "callbacks.sample_table.every=1",
    "callbacks.relevance_dump.every=1",
    "callbacks.export=null",
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines(keepends=True)


def _steps(path: Path) -> Counter:
    return Counter(json.loads(line)["step"] for line in _lines(path))


def test_a_resume_drops_the_stopped_runs_records_of_the_steps_it_runs_again(train_cfg, tmp_path):
    run = tmp_path / "run"
    train(train_cfg(*RUN, f"paths.output_dir={run}", "trainer.max_steps=3"))
    before = {name: _lines(run / name) for name in FILES}
    first = {name: _steps(run / name) for name in FILES}
    for name in FILES:
        assert sorted(first[name]) == [1, 2, 3], (name, first[name])

    # As if the run had been killed after writing step 3's records, its last checkpoint
    # being step 2's: the resume runs step 3 again, then step 4.
    ckpt = run / "checkpoints" / "step000002.ckpt"
    train(
        train_cfg(
            *RUN,
            f"paths.output_dir={run}",
            f"+resume={run}",
            f"ckpt_path={ckpt}",
            "trainer.max_steps=4",
        )
    )
    for name in FILES:
        after = _lines(run / name)
        counts = _steps(run / name)
        # each step once: steps 1-3 as many records as the uninterrupted first run wrote
        assert sorted(counts) == [1, 2, 3, 4], (name, counts)
        for step in (1, 2, 3):
            assert counts[step] == first[name][step], (name, step, counts)
        # the records of the steps before the checkpoint are kept byte for byte
        kept = [line for line in before[name] if json.loads(line)["step"] <= 2]
        assert after[: len(kept)] == kept, name
        # step 3 ran again from the same weights and data: the same records
        again = [line for line in after if json.loads(line)["step"] == 3]
        assert again == [line for line in before[name] if json.loads(line)["step"] == 3], name
        assert not list(run.glob(f".{name}*")), name


def _record(step: int, text: str = "x") -> str:
    return json.dumps({"step": step, "id": f"p{step}", "response": text}) + "\n"


def test_dropping_keeps_earlier_records_and_a_torn_last_line_goes(tmp_path):
    from mrtpo.lightning.callbacks.samples import drop_records_after

    path = tmp_path / "samples.jsonl"
    body = _record(1) + _record(2) + "not json, kept as it is\n" + _record(3) + _record(2, "late")
    path.write_text(body + '{"step": 1, "id": "p1", "resp', encoding="utf-8")
    assert drop_records_after(path, 2) == 2  # step 3's record, and the line a kill cut off
    assert path.read_text(encoding="utf-8") == (
        _record(1) + _record(2) + "not json, kept as it is\n" + _record(2, "late")
    )
    same = path.read_bytes()
    inode = path.stat().st_ino
    assert drop_records_after(path, 2) == 0
    assert path.read_bytes() == same and path.stat().st_ino == inode  # not rewritten
    assert drop_records_after(tmp_path / "absent.jsonl", 2) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["samples.jsonl"]


def test_a_records_file_that_is_a_symlink_is_neither_read_nor_written(tmp_path):
    from mrtpo.lightning.callbacks.samples import drop_records_after

    mine = tmp_path / "mine.jsonl"
    mine.write_text(_record(1) + _record(5), encoding="utf-8")
    link = tmp_path / "run" / "samples.jsonl"
    link.parent.mkdir()
    os.symlink(mine, link)
    with pytest.raises(ValueError, match=r"samples\.jsonl is a symbolic link") as info:
        drop_records_after(link, 2)
    assert "\n" not in str(info.value)
    assert mine.read_text(encoding="utf-8") == _record(1) + _record(5)
    assert link.is_symlink()
    assert sorted(p.name for p in link.parent.iterdir()) == ["samples.jsonl"]
