"""The small inconsistencies a reader trips on (issue 40 item 7); the console's
'c0 (constraint 1)' and curves.png's one legend are in test_console_summary.py."""

from __future__ import annotations

import csv
import re

from omegaconf import OmegaConf
from tests.conftest import CONFIG_DIR, ROOT

from mrtpo.evaluate.analysis.report import bounds, curve_band
from mrtpo.evaluate.tables import parser as table_parser
from mrtpo.evaluate.viewer import main as relevance_main


def test_table_help_prints_a_percent_sign_once():
    text = table_parser().format_help()
    assert "95% CI" in text and "%%" not in text


def test_a_rates_band_stays_between_0_and_1():
    """Three seeds of a success rate, 0, 1 and 1: the t band reached 1.6 (and below 0)."""
    seeds = [[0.0] * 12, [1.0] * 12, [1.0] * 12]
    cut = bounds({"mrtpo": seeds})
    assert cut == (0.0, 1.0)
    mean, lo, hi = curve_band(seeds, 0.95, cut)
    assert len(mean) == 12 and all(0.0 <= a <= m <= b <= 1.0 for a, m, b in zip(lo, mean, hi))
    assert max(curve_band(seeds)[2]) > 1.5  # uncut, as it was drawn
    signed = [[-3.0] * 5, [2.0] * 5]  # tool calling's correctness: -3..3, not cut
    assert bounds({"g": signed}) == (float("-inf"), float("inf"))


def _short_run(folder, method: str, every: int | None, replayed: float, steps: int = 2):
    """A run folder as a short training run leaves it, without relevance.jsonl."""
    (folder / ".hydra").mkdir(parents=True)
    dump = None if every is None else {"_target_": "x", "every": every, "num": 4}
    cfg = {"method": {"_target_": method}, "callbacks": {"relevance_dump": dump}}
    OmegaConf.save(OmegaConf.create(cfg), folder / ".hydra" / "config.yaml")
    (folder / "csv").mkdir()
    with open(folder / "csv" / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["step", "train/iteration", "train/reward/total/mean", "train/adv/replayed_share"]
        )
        for s in range(steps):
            w.writerow([s, s + 1, 0.1, replayed])


def test_relevance_on_a_short_run_names_the_dump_not_the_method(tmp_path, capsys):
    """A 2-step MRTPO run: relevance_dump.every=10 writes at steps 1, 11, ..., and step 1
    replayed nothing; the message said the method does not replay."""
    run = tmp_path / "run"
    _short_run(run, "mrtpo.core.credit.methods.MRTPO", 10, 0.0)
    assert relevance_main([str(run)]) == 2
    out = capsys.readouterr().out
    assert "callbacks.relevance_dump.every=10 writes at steps 1, 11, 21" in out
    assert "this run logged 2 step(s)" in out and "no response was replayed" in out
    assert "That is not the method: set callbacks.relevance_dump.every=1" in out
    gdpo = tmp_path / "gdpo"
    _short_run(gdpo, "mrtpo.core.credit.methods.GDPO", 10, 0.0)
    assert relevance_main([str(gdpo)]) == 2
    assert "its method (GDPO) does not replay" in capsys.readouterr().out
    off = tmp_path / "off"
    _short_run(off, "mrtpo.core.credit.methods.MRTPO", None, 0.5)
    assert relevance_main([str(off)]) == 2
    assert "callbacks.relevance_dump was off in this run" in capsys.readouterr().out


def test_the_hir_path_is_the_same_everywhere():
    """The README said /data/HIR-16K/train.parquet, the task docs HIR_trainv1.jsonl (the
    released file); every command and preset now names the released file."""
    places = [ROOT / "README.md", ROOT / "docs" / "tasks" / "instructions.md",
              *sorted((CONFIG_DIR / "experiment").glob("ifeval_*.yaml")),
              CONFIG_DIR / "task" / "ifeval.yaml"]  # fmt: skip
    for path in places:
        text = path.read_text(encoding="utf-8")
        named = re.findall(r"task\.data\.path=(\S+)", text) + re.findall(r"path: (\S+HIR\S*)", text)
        named = [p for p in named if "HIR" in p or "hir" in p]  # (task=custom's prompts.jsonl)
        assert named and all(p.endswith("HIR-16K/HIR_trainv1.jsonl") for p in named), (path, named)
        assert "train.parquet" not in "".join(named)
