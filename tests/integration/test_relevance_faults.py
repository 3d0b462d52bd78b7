"""``python src/relevance.py`` on what a hostile pass gave it (issue 37, cases 2 and 15):
prompts holding Unicode line separators (kept raw by the trainer's writer), a BOM, records that
cannot be drawn (each named by its line), a huge file at one step, a read-only run folder, and
relevance.html / relevance.png planted as symlinks to a user's file."""

from __future__ import annotations

import html
import json
import subprocess
import sys
import uuid

import pytest
from tests.conftest import ROOT
from tests.integration.test_relevance_viewer import _record

from mrtpo.evaluate.viewer import main


def _line(rec) -> str:
    """One record as mrtpo.lightning.callbacks.samples.RelevanceDump writes it."""
    return json.dumps(rec, ensure_ascii=False) + "\n"


def _write(folder, lines: list[str], bom: bool = False):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "relevance.jsonl", "w", encoding="utf-8-sig" if bom else "utf-8") as f:
        f.write("".join(lines))
    return folder


SEPARATORS = "a\u2028b\u0085c\u2029d\x1ce"


def test_prompts_with_unicode_line_separators_are_read(tmp_path, capsys):
    recs = [{**_record(step, 0), "prompt": f"{step}: {SEPARATORS}"} for step in (1, 11, 21)]
    recs[1]["tokens"][0] = "x\u2028y"
    run = _write(tmp_path / "run", [_line(r) for r in recs])
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "note:" not in out and "3 responses" in out
    page = (run / "relevance.html").read_text(encoding="utf-8")
    assert page.count('<section class="rec"') == 3 and "11: a\u2028b\u0085c\u2029d" in page


def test_a_bom_is_accepted(tmp_path, capsys):
    run = _write(tmp_path / "run", [_line(_record(1, j)) for j in range(2)], bom=True)
    assert main([str(run)]) == 0
    assert "2 responses" in capsys.readouterr().out


def _bad_lines() -> list[tuple[str, str]]:
    """(line, what the note says) for each kind of record that cannot be drawn."""
    good = _record(1, 0)
    no_w = {k: v for k, v in good.items() if k != "w"}
    big = json.dumps(good).replace("0.007", "1" + "0" * 400, 1)  # an int beyond any float
    deep = '{"step": 1, "q": ' + "[" * 100_000 + "]" * 100_000 + "}"
    return [
        (json.dumps(no_w), "no 'w'"),
        (json.dumps({**good, "tokens": ["a", 5, "c", "d", "e", "f"]}), "'tokens' is not a list of strings"),
        (json.dumps({**good, "step": "abc"}), "'step' is not a whole number (a str)"),
        (json.dumps({**good, "step": 1.5}), "'step' is not a whole number (a float)"),
        (json.dumps({**good, "step": True}), "'step' is not a whole number (a bool)"),
        (big, "q['format'] holds a value that is not a finite number"),
        (json.dumps(good).replace("0.016", "1e999", 1), "q['format'] holds a value that is not a finite number"),
        (json.dumps({**good, "q": {"format": "abc"}}), "q['format'] does not have one number per token (6)"),
        (json.dumps({**good, "rewards": [1]}), "'rewards' is not an object of numbers"),
        (deep, "JSON nested too deeply"),
        (json.dumps(good)[:40], "not valid JSON"),
        ("\udcff", "not UTF-8"),
    ]  # fmt: skip


def test_records_that_cannot_be_drawn_are_left_out_naming_their_line(tmp_path, capsys):
    bad = _bad_lines()
    sep = {**_record(1, 1), "prompt": "one\u2028two"}  # must not shift the line numbers
    lines = [_line(_record(1, 0)), "\n", _line(sep)] + [b + "\n" for b, _ in bad]
    run = tmp_path / "run"
    run.mkdir()
    data = "".join(lines).encode("utf-8", "surrogateescape")
    (run / "relevance.jsonl").write_bytes(data)
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    for i, (_, why) in enumerate(bad, 4):
        assert f"relevance.jsonl line {i}: {why}" in out, (i, why, out)
    assert "2 responses" in out and "Traceback" not in out
    page = (run / "relevance.html").read_text(encoding="utf-8")
    assert page.count('<section class="rec"') == 2
    assert "relevance.jsonl line 4: no 'w'" in html.unescape(page)


def test_a_file_with_nothing_to_draw_is_one_error_naming_it(tmp_path, capsys):
    run = _write(tmp_path / "run", [b + "\n" for b, _ in _bad_lines()[:3]])
    assert main([str(run)]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith(f"error: {run / 'relevance.jsonl'}: no record to draw (3 lines")
    assert "line 1: no 'w'" in out[-1]
    assert not (run / "relevance.html").exists()


def test_a_huge_file_at_one_step_is_streamed_and_capped(tmp_path):
    """~40 MB at one step (the issue's 106 MB took 5.1 GB and wrote a 756 MB page): memory
    stays near the interpreter's own, and the page shows --max-per-step responses."""
    rec = _record(7, 0)
    rec["tokens"] = rec["tokens"] * 100
    for kind in ("q", "w"):
        rec[kind] = {k: v * 100 for k, v in rec[kind].items()}
    one = _line(rec)
    n = 40_000_000 // len(one) + 1
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "relevance.jsonl", "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(one.replace('"id": "p0"', f'"id": "p{i}"', 1))
    # the child's own high-water mark (VmHWM belongs to its address space: ru_maxrss would
    # carry the forking test process's, hundreds of MB inside a full test run)
    code = (
        "import re, sys; from mrtpo.evaluate.viewer import main; rc = main(sys.argv[1:]); "
        "hwm = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1); "
        "print('peak', hwm); sys.exit(rc)"
    )
    res = subprocess.run([sys.executable, "-c", code, str(run)], cwd=ROOT, capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    peak_mb = int(res.stdout.split("peak ")[1].split()[0]) / 1024
    page = (run / "relevance.html").read_text(encoding="utf-8")
    assert page.count('<section class="rec"') == 8
    assert f"at most 8 of the {n} responses at step 7 are shown (--max-per-step)" in page
    assert len(page) < 5_000_000
    assert peak_mb < 400, f"peak {peak_mb:.0f} MB"


# ---- writes -------------------------------------------------------------------------------
def test_outputs_planted_as_symlinks_are_refused_and_their_targets_left_alone(tmp_path, capsys):
    run = _write(tmp_path / "run", [_line(_record(1, j)) for j in range(2)])
    user = tmp_path / "precious.txt"
    user.write_text("mine\n")
    for name in ("relevance.html", "relevance.png"):
        (run / name).symlink_to(user)
        assert main([str(run)]) == 2
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert last.startswith(f"error: refusing to write {run / name}: it is a symbolic link "
                               f"(to {user})"), last  # fmt: skip
        assert user.read_text() == "mine\n"
        assert sorted(p.name for p in run.iterdir()) == sorted(["relevance.jsonl", name])
        (run / name).unlink()
    assert main([str(run)]) == 0
    assert (run / "relevance.png").read_bytes()[:4] == b"\x89PNG"


@pytest.fixture
def read_only(tmp_path):
    """A tmpfs at a folder, remounted read-only by ``freeze()`` (root ignores permission
    bits, so only a read-only mount refuses its writes); unmounted afterwards."""
    where = tmp_path / f"ro-{uuid.uuid4().hex[:8]}"
    where.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "none", str(where)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.decode().strip()[:200]})")
    yield where, lambda: subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
    subprocess.run(["umount", str(where)], check=False)


def test_a_read_only_run_folder_is_one_line(read_only, tmp_path, capsys):
    where, freeze = read_only
    run = _write(where / "run", [_line(_record(1, 0))])
    freeze()
    assert main([str(run)]) == 2
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot write {run / 'relevance.html'}: Read-only file system")
    assert "--out" in last
    assert main([str(run), "--out", str(tmp_path / "figs")]) == 0
