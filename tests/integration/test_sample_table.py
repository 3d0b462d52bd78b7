"""Sample completions on the console by default (issue 41, item 3): every ``every`` steps a
compact table of a few responses with each reward is printed, and the same responses are in
the run folder's ``samples.jsonl``; ``print_table=false`` keeps them to the file."""

from __future__ import annotations

import io
import json

from rich.console import Console

from mrtpo.lightning.callbacks.samples import sample_table
from mrtpo.lightning.pipeline import build


def _records(folder):
    return [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]


def test_a_table_is_printed_by_default_and_written(train_cfg, tmp_path, capsys):
    cfg = train_cfg("trainer.max_steps=3", "callbacks.sample_table.every=2")
    assert cfg.callbacks.sample_table.print_table is True  # the default
    trainer, module, dm = build(cfg)
    trainer.fit(module, datamodule=dm)
    out = capsys.readouterr().out
    assert out.count("samples at step") == 2  # steps 1 and 3
    assert "samples at step 1" in out and "samples at step 3" in out
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [1] * 4 + [3] * 4
    first = records[0]
    shown = " ".join(f"{k}={v:.3g}" for k, v in first["rewards"].items() if v is not None)
    assert shown.split()[0] in out  # each reward by name, with its value


def test_print_table_false_keeps_them_to_the_file(train_cfg, tmp_path, capsys):
    cfg = train_cfg("callbacks.sample_table.print_table=false")
    trainer, module, dm = build(cfg)
    trainer.fit(module, datamodule=dm)
    assert "samples at step" not in capsys.readouterr().out
    assert [r["step"] for r in _records(tmp_path)] == [1] * 4


def _text(rows, width: int) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(sample_table(rows, step=7, width=width))
    return console.export_text()


def test_the_table_is_compact():
    long = "word " * 200 + "\nsecond line"
    rows = [{"prompt": "Say hi.\nNow.", "response": long, "rewards": {"a": 1.0, "b": None}},
            {"prompt": "Say hi.\nNow.", "response": "hi", "rewards": {"a": 0.0, "b": 0.5}}]  # fmt: skip
    for width in (80, 140):
        lines = _text(rows, width).splitlines()
        assert lines[0].startswith("samples at step 7, prompt: Say hi. ⏎ Now.")  # one group
        body = [ln for ln in lines if "a=" in ln]
        assert len(body) == 2  # one line per response, however long it is
        assert "a=1 b=-" in body[0] and "a=0 b=0.5" in body[1]
        assert all(len(ln) <= width for ln in lines)
    rows[1]["prompt"] = "Another prompt"
    text = _text(rows, 80)
    assert "│ prompt" in text.replace("┃", "│") and "Another prompt" in text
