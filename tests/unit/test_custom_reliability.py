"""``task=custom`` against hostile data files and misbehaving reward functions (issue 25).

Each case used to fail late or without a location: a lone surrogate in a prompt reached the
tokenizer after the model loaded; ``sys.exit()`` in a reward ended the run with rc 0; the
string ``"1.0"`` counted as 1.0 and ``10**400`` voided the sample's other rewards; a 10 MB
block went unbounded to replay; bad UTF-8, deep JSON, long CSV fields, an empty ``.json`` and
a FIFO gave errors that named neither file nor line; a BOM was refused.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
from tests.unit.test_scoring import NUMERIC_CASES, NUMERIC_IDS

from mrtpo.core.faults import FaultTracker
from mrtpo.core.scoring import score_batch
from mrtpo.tasks.custom import CustomTask


def ok(prompt, response, **row):
    return 1.0


def exits(prompt, response, **row):
    if response == "bye":
        raise SystemExit(0)
    return 0.5


def interrupts(prompt, response, **row):
    raise KeyboardInterrupt


def text_one(prompt, response, **row):
    return "1.0"


def huge_int(prompt, response, **row):
    return 10**400


def huge_block(prompt, response, **row):
    return "b" * 10_000_000


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _task(path, rewards=(ok,), **kw) -> CustomTask:
    return CustomTask(data={"path": str(path), **kw.pop("data", {})}, rewards=list(rewards), **kw)


# ---- 6: text no tokenizer can encode -----------------------------------------------------


@pytest.mark.parametrize(
    ("row", "data", "what"),
    [
        ({"prompt": "hi \ud800 there"}, {}, "column 'prompt' holds U+D800 at character 3"),
        (
            {"prompt": [{"role": "user", "content": "x"}, {"role": "user", "content": "\udfff"}]},
            {},
            "column 'prompt' (message 1) holds U+DFFF at character 0",
        ),
        ({"prompt": "hi", "ref": "a\ud83d"}, {"reference_column": "ref"}, "column 'ref' holds"),
    ],
    ids=["text", "messages", "reference"],
)
def test_a_lone_surrogate_is_refused_at_load_naming_file_and_row(tmp_path, row, data, what):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "fine"}, row])
    assert "\\ud" in path.read_text()  # written as a JSON escape, as json.dumps does
    with pytest.raises(ValueError) as err:
        _task(path, data=data)
    msg = str(err.value)
    assert f"{path} row 1" in msg and what in msg and "lone surrogate" in msg


def test_a_lone_surrogate_in_the_system_prompt_names_the_key(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "fine"}])
    with pytest.raises(ValueError, match=r"task\.data\.system_prompt: .*U\+D800"):
        _task(path, data={"system_prompt": "be \ud800 nice"})


# ---- 7: exits and interrupts inside a reward function -----------------------------------


def test_system_exit_in_a_reward_is_that_rewards_scoring_error(tmp_path):
    task = _task(_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}]), rewards=[ok, exits])
    ex = task.examples("train")[0]
    faults = FaultTracker(3, 3)
    scores = score_batch(task, [ex, ex], ["hello", "bye"], faults)
    assert scores[0].rewards == {"ok": 1.0, "exits": 0.5} and scores[0].error is None
    assert scores[1].rewards == {"ok": 1.0, "exits": None}  # the other reward is kept
    assert f"reward exits ({__name__}.exits) raised SystemExit(0)" in scores[1].error
    assert "not exit" in scores[1].error


def test_keyboard_interrupt_in_a_reward_stops_naming_the_function(tmp_path, caplog):
    task = _task(_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}]), rewards=[ok, interrupts])
    ex = task.examples("train")[0]
    caplog.set_level(logging.ERROR)
    with pytest.raises(KeyboardInterrupt) as err:
        score_batch(task, [ex], ["hello"], FaultTracker(3, 3))
    label = f"reward interrupts ({__name__}.interrupts)"
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(logged) == 1 and label in logged[0] and "the run stops" in logged[0]
    assert any(label in note for note in getattr(err.value, "__notes__", []))


# ---- 8: a runaway block function --------------------------------------------------------


def test_a_10_mb_block_is_cut_to_the_cap_with_a_note(tmp_path, caplog, monkeypatch):
    import mrtpo.core.scoring

    monkeypatch.setattr(mrtpo.core.scoring, "_CAPPED", set())  # logged once per process otherwise
    task = _task(
        _jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}]),
        blocks={"ok": huge_block},
        max_block_chars=4096,
    )
    ex = task.examples("train")[0]
    caplog.set_level(logging.WARNING, logger="mrtpo.core.scoring")
    (score,) = score_batch(task, [ex], ["x"], FaultTracker(3, 3))
    block = score.blocks["ok"]
    assert len(block) == 4096 and block.startswith("bbbb")
    assert "cut to 4096 of its 10000000 characters (task.max_block_chars)" in block
    assert any("task.max_block_chars=4096" in r.getMessage() for r in caplog.records)
    ctx = task.contexts(ex, score)
    assert len(ctx.all[-1]["content"]) < 5000
    with pytest.raises(ValueError, match=r"task\.max_block_chars"):
        _task(tmp_path / "p.jsonl", max_block_chars=0)


# ---- 13: what a reward function returns -------------------------------------------------


def test_a_string_reward_is_none_with_a_reason(tmp_path):
    task = _task(_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}]), rewards=[ok, text_one])
    s = task.score(task.examples("train")[0], "x")
    assert s.rewards == {"ok": 1.0, "text_one": None}
    assert "returned a str ('1.0'), not a number or None" in s.error


def test_a_huge_int_reward_is_none_and_keeps_the_other_rewards(tmp_path):
    task = _task(_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}]), rewards=[ok, huge_int])
    ex = task.examples("train")[0]
    s = task.score(ex, "x")
    assert s.rewards == {"ok": 1.0, "huge_int": None}
    assert "returned an int ('1000" in s.error and "too large for a reward" in s.error
    (cleaned,) = score_batch(task, [ex], ["x"], FaultTracker(3, 3))
    assert cleaned.rewards == {"ok": 1.0, "huge_int": None}


# ---- 18: data files ---------------------------------------------------------------------


def _error(path, **data) -> str:
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        _task(path, data=data)
    return str(err.value)


def test_bad_utf8_names_file_line_and_byte(tmp_path):
    jl = tmp_path / "bad.jsonl"
    jl.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    assert f"{jl}:2: not valid UTF-8 (byte 0xe9 at column 16)" in _error(jl)
    cs = tmp_path / "bad.csv"
    cs.write_bytes(b"prompt,word\nfine,a\n\xff\xfe,b\n")
    assert f"{cs}:3: not valid UTF-8 (byte 0xff at column 1)" in _error(cs)


def test_deeply_nested_json_names_the_file(tmp_path):
    deep = '{"prompt": "x", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"
    jl = tmp_path / "deep.jsonl"
    jl.write_text('{"prompt": "fine"}\n' + deep + "\n")
    assert f"{jl}:2: JSON nested too deeply to read" in _error(jl)
    js = tmp_path / "deep.json"
    js.write_text("[" + deep + "]")
    assert f"{js}: JSON nested too deeply to read" in _error(js)


def test_an_empty_or_broken_json_file_names_the_file(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text("")
    assert f"{empty}: the file is empty" in _error(empty)
    broken = tmp_path / "broken.json"
    broken.write_text('[\n{"prompt": "a"},\n{"prompt": }\n]')
    assert f"{broken}:3: not valid JSON (Expecting value at column 12)" in _error(broken)


def test_a_csv_field_over_128_kib_is_read(tmp_path):
    import csv

    long_prompt = "word " * 60_000  # 300 KB, past csv's default field limit of 128 KiB
    cs = tmp_path / "long.csv"
    cs.write_text(f'prompt,word\n"{long_prompt}",a\nshort,b\n', encoding="utf-8")
    before = csv.field_size_limit()
    task = _task(cs)
    assert [len(e.messages[-1]["content"]) for e in task.examples("train")] == [300_000, 5]
    assert csv.field_size_limit() == before  # the module-wide limit is left as it was


def test_a_csv_field_over_the_limit_names_file_and_line(tmp_path, monkeypatch):
    import csv

    from mrtpo.tasks.custom import data as data_module

    cs = tmp_path / "long.csv"
    cs.write_text("prompt\nshort\n" + "x" * 300 + "\n", encoding="utf-8")
    before = csv.field_size_limit(100)  # a small limit stands in for a 1 GiB field
    monkeypatch.setattr(data_module, "CSV_FIELD_LIMIT", 100)
    try:
        msg = _error(cs)
    finally:
        csv.field_size_limit(before)
    assert f"{cs}:3: not valid CSV (field larger than field limit (100))" in msg


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes on this platform")
def test_a_fifo_is_named_as_such_not_as_missing(tmp_path):
    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)
    for data in ({}, {"format": "jsonl"}):
        msg = _error(fifo, **data)  # never opened: reading a FIFO would block
        assert f"task.data.path={fifo} is a FIFO (named pipe)" in msg and "no such" not in msg
    good = _jsonl(tmp_path / "train.jsonl", [{"prompt": "a"}])
    task = _task(good, data={"splits": {"val": str(fifo)}})
    with pytest.raises(ValueError, match=r"task\.data\.splits\.val=.* is a FIFO"):
        task.examples("val")


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_a_byte_order_mark_is_accepted_as_evaluation_accepts_it(tmp_path, suffix):
    body = {
        ".jsonl": '{"prompt": "a"}\n{"prompt": "b"}\n',
        ".json": '[{"prompt": "a"}, {"prompt": "b"}]',
        ".csv": "prompt\na\nb\n",
    }[suffix]
    path = tmp_path / f"bom{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    task = _task(path)
    assert [e.messages[-1]["content"] for e in task.examples("train")] == ["a", "b"]


# ---- issue 37, case 10: the same rule as every other task ------------------------------------


@pytest.mark.parametrize(("value", "expect", "reason"), NUMERIC_CASES, ids=NUMERIC_IDS)
def test_a_custom_reward_follows_the_one_numeric_rule(tmp_path, value, expect, reason):
    def odd(prompt, response, **row):
        return value

    task = _task(_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}]), rewards=[ok, odd])
    ex = task.examples("train")[0]
    (s,) = score_batch(task, [ex], ["x"], FaultTracker(3, 3))
    assert s.rewards == {"ok": 1.0, "odd": expect}
    if reason:
        assert f"reward odd ({__name__}.{odd.__qualname__}) returned a" in s.error
        assert reason in s.error
    else:
        assert s.error is None
