"""The long toy (``make replicate ARGS=--long``): its cells, warm-start chain and RL jobs, the
prediction rules on made-up runs, and the whole harness in miniature (slow)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
from tests.conftest import ROOT

from mrtpo.evaluate.analysis.runs import rl_curves
from mrtpo.run.config import compose
from replication import claims as C
from replication import long as L
from replication import long_report as R


def _script():
    spec = importlib.util.spec_from_file_location("replicate", ROOT / "scripts" / "replicate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _value(job, key: str) -> str | None:
    vals = [o.split("=", 1)[1] for o in job.overrides if o.startswith(key + "=")]
    return vals[-1] if vals else None


def test_clean_passes_start_from_the_free_part_0_policy_and_noisy_passes_from_their_own(tmp_path):
    cells = list(L.FULL_CELLS)
    assert (8, L.LONG_FREE) in cells
    opts = L.LongOptions(cells=cells, logdir=tmp_path)
    assert _value(L.sft_job((4, 0), "sft", opts), "model.name_or_path") is None  # random weights
    for cell, parent in [((4, 20), (4, 0)), ((4, 60), (4, 0)), ((8, 60), (8, 0))]:
        job = L.sft_job(cell, "sft", opts)
        assert (
            Path(_value(job, "model.name_or_path"))
            == L.cell_dir(tmp_path, parent) / "sft" / "policy"
        )
        assert job.after == (f"{L.cell_name(parent)}/sft",)
    noisy = L.sft_job((4, 60), "sft_noisy", opts)
    assert (
        Path(_value(noisy, "model.name_or_path"))
        == L.cell_dir(tmp_path, (4, 60)) / "sft" / "policy"
    )
    assert noisy.after == ("k4_f60/sft",)
    rl = L.rl_job((8, 60), "mrtpo", 0, opts)
    assert rl.after == ("k8_f60/sft_noisy",)
    waves = L.sft_waves(cells)
    assert waves[0] == [((2, 0), "sft"), ((4, L.TOY), "sft"), ((4, 0), "sft")]
    assert waves[1] == [((2, 60), "sft"), ((4, 20), "sft"), ((4, 60), "sft"), ((8, L.TOY), "sft")]
    assert waves[2] == [((8, 0), "sft")] and waves[3] == [((8, 60), "sft")]
    assert waves[-1] == [(c, "sft_noisy") for c in cells]


def test_k8_reads_through_the_toy_format_first(tmp_path):
    """K = 8's free-part-0 pass starts from a toy-format K = 8 policy (toy_sft, a fixed number
    of steps), which starts from a toy-format K = 4 one (toy_sft from random weights)."""
    opts = L.LongOptions(cells=[(8, 60)], logdir=tmp_path)
    assert L.start_of((8, 0)) == (8, L.TOY) and L.start_of((8, L.TOY)) == (4, L.TOY)
    assert L.start_of((4, L.TOY)) is None and L.start_of((4, 0)) is None
    k4, k8 = L.sft_job((4, L.TOY), "sft", opts), L.sft_job((8, L.TOY), "sft", opts)
    f0 = L.sft_job((8, 0), "sft", opts)
    assert (k4.after, k8.after, f0.after) == ((), ("k4_toy/sft",), ("k8_toy/sft",))
    assert Path(_value(f0, "model.name_or_path")) == tmp_path / "k8_toy" / "sft" / "policy"
    c4, c8, cf = (compose("train.yaml", j.overrides) for j in (k4, k8, f0))
    assert c4.task.get("free_tokens") is None is c8.task.get("free_tokens")
    assert cf.task.free_tokens == 0
    assert (c4.task.num_constraints, c8.task.num_constraints) == (4, 8)
    assert c8.trainer.max_steps == L.TOY_READER_STEPS == k8.steps
    assert c4.trainer.max_steps == cf.trainer.max_steps  # to the target, within the usual limit
    with pytest.raises(ValueError, match="no sft_noisy pass"):
        L.sft_job((8, L.TOY), "sft_noisy", opts)
    # the chain goes first: four passes wait on the K = 4 toy pass, two on K = 2's free part 0
    full = L.LongOptions(cells=list(L.FULL_CELLS), logdir=tmp_path)
    jobs = [L.sft_job(c, ph, full) for w in L.sft_waves(list(L.FULL_CELLS)) for c, ph in w]
    order = [j.key for j in L._chain_first(jobs)]
    assert order[0] == "k4_toy/sft" and order.index("k8_toy/sft") < 4
    assert order.index("k8_f0/sft") < order.index("k2_f60/sft")


@pytest.mark.parametrize("free", L.FREE)
def test_rl_job_composes_the_free_part_and_a_budget_that_fits_it(tmp_path, free):
    opts = L.LongOptions(logdir=tmp_path, steps=7)
    job = L.rl_job((4, free), "mrtpo@beta=0.25", 1, opts)
    cfg = compose("train.yaml", job.overrides)
    assert cfg.task.free_tokens == free and cfg.task.closing_mark and cfg.method.beta == 0.25
    assert cfg.rollout.sampling.max_new_tokens >= free + 6 + 12
    assert cfg.trainer.max_steps == 7 and cfg.seed == 1 and job.steps == 7
    assert Path(cfg.model.name_or_path) == L.warm_start(tmp_path, (4, free))
    noisy = compose("train.yaml", L.sft_job((4, free), "sft_noisy", opts).overrides)
    assert noisy.task.mark_success == 0.0 and noisy.stage.sft.target_metric == "reward/mark"
    assert noisy.task.mark_break == "none"
    assert noisy.stage.sft.eval_max_new_tokens == cfg.rollout.sampling.max_new_tokens


def test_replicate_long_flags():
    rep = _script()
    quick = rep.parse_args(["--long"])
    assert isinstance(quick, L.LongOptions) and quick.cells == list(L.QUICK_CELLS)
    assert quick.seeds == L.QUICK_SEEDS and quick.steps == L.QUICK_STEPS
    full = rep.parse_args(["--long", "--full", "--seeds=9"])
    assert full.cells == list(L.FULL_CELLS) and full.seeds == 9 and full.steps == L.FULL_STEPS
    assert rep.parse_args(["--long", "--cells=2:0,2:5"]).cells == [(2, 0), (2, 5)]
    with pytest.raises(SystemExit):
        rep.parse_args(["--cells=4:0"])  # not without --long
    with pytest.raises(SystemExit):
        rep.parse_args(["--long", "--cells=4-0"])
    assert not isinstance(rep.parse_args([]), L.LongOptions)  # the toy replication as before
    assert L.FULL_SEEDS >= 8


def _made_warm_starts(root: Path, cells, **saved) -> Path:
    """A made-up earlier run folder holding finished warm-start passes for ``cells``."""
    run = {"commit": "abc1234", "sft_max_steps": None, "sft_seed": 0, "sft_override": []}
    (root / "run.json").parent.mkdir(parents=True, exist_ok=True)
    (root / "run.json").write_text(json.dumps(run | saved))
    for cell, phase in [(c, ph) for w in L.sft_waves(list(cells)) for c, ph in w]:
        d = L.cell_dir(root, cell) / phase
        (d / "policy").mkdir(parents=True)
        (d / "policy" / "model.safetensors").write_bytes(b"weights")
        (d / "csv").mkdir()
        (d / "csv" / "metrics.csv").write_text("step\n1\n")
        csv = str(d / "csv" / "metrics.csv")
        (d / "job.json").write_text(json.dumps({"key": phase, "csv": csv, "error": None}))
    return root


def test_warm_from_copies_an_earlier_runs_warm_starts_and_leaves_it_as_it_was(tmp_path):
    src = _made_warm_starts(tmp_path / "earlier", L.QUICK_CELLS)
    before = sorted((p.relative_to(src), p.stat().st_mtime_ns) for p in src.rglob("*"))
    opts = L.LongOptions(logdir=tmp_path / "now", warm_from=src)
    assert L.reuse_warm_starts(opts) == "abc1234"
    assert sorted((p.relative_to(src), p.stat().st_mtime_ns) for p in src.rglob("*")) == before
    for cell in L.QUICK_CELLS:
        for phase in L.SFT_PHASES:
            job = L.sft_job(cell, phase, opts)
            info = json.loads((job.out / "job.json").read_text())
            assert not info.get("error") and Path(info["csv"]).is_relative_to(opts.logdir)
            assert (job.out / "policy" / "model.safetensors").read_bytes() == b"weights"
    # its RL runs start from the copies, inside this run's folder
    assert all(L.warm_start(opts.logdir, c).is_dir() for c in L.QUICK_CELLS)


def test_warm_from_refuses_other_sft_options_or_missing_passes(tmp_path):
    other = _made_warm_starts(tmp_path / "other", L.QUICK_CELLS, sft_seed=3)
    with pytest.raises(ValueError, match="sft_seed=3"):
        L.reuse_warm_starts(L.LongOptions(logdir=tmp_path / "a", warm_from=other))
    k, free = L.QUICK_CELLS[-1]
    part = _made_warm_starts(tmp_path / "part", [(k, 0)])
    with pytest.raises(ValueError, match=f"k{k}_f{free}/sft"):
        L.reuse_warm_starts(L.LongOptions(logdir=tmp_path / "b", warm_from=part))
    with pytest.raises(ValueError, match=r"no run\.json"):
        L.reuse_warm_starts(L.LongOptions(logdir=tmp_path / "c", warm_from=tmp_path))
    rep = _script()
    assert rep.parse_args(["--long", f"--warm-from={other}"]).warm_from == other
    with pytest.raises(SystemExit):
        rep.parse_args([f"--warm-from={other}"])  # not without --long


def _series(success: list[float], mark: list[float]) -> dict[str, list[float]]:
    return {"success": success, "mark": mark, "first": [1.0] * len(success)}


def _ramp(start: float, rate: float, n: int = 20) -> list[float]:
    return [min(1.0, start + rate * t) for t in range(n)]


def test_predictions_follow_their_rules_on_made_up_runs():
    """MRTPO's edge over GDPO grows with the free part by construction: P1 and P2 are
    reproduced; shuffle is GDPO and joint halfway, so P4 is too; one K, so P5 is inconclusive."""
    tab: C.Table = {}
    for free in L.FREE:
        edge = 0.002 * free
        by_m = {}
        for m, gain in (
            ("gdpo", 0),
            ("mrtpo", edge),
            ("mrtpo_shuffle", 0),
            ("mrtpo_joint", edge / 2),
        ):
            by_m[m] = {
                s: R.summarize(
                    _series(_ramp(0.01 * s, 0.03 + gain), _ramp(0.05, 0.04 + 2 * gain)), 0.5
                )
                for s in range(4)
            }
        tab[(4, free)] = by_m
    found = {
        c.number: c for c in R.predictions(tab, ["gdpo", "mrtpo", "mrtpo_shuffle", "mrtpo_joint"])
    }
    assert found[1].verdict == C.REPRODUCED, found[1].statistic
    assert found[2].verdict == C.REPRODUCED, found[2].statistic
    assert found[4].verdict == C.REPRODUCED, found[4].statistic
    assert found[5].verdict == C.INCONCLUSIVE and "full mode" in found[5].why
    assert found[3].verdict == C.INCONCLUSIVE and "not measured" in found[3].statistic
    # the mirror image is "not reproduced", not "inconclusive"
    flipped = {cell: {"gdpo": by_m["mrtpo"], "mrtpo": by_m["gdpo"]} for cell, by_m in tab.items()}
    assert R.predictions(flipped, ["gdpo", "mrtpo"])[0].verdict == C.NOT_REPRODUCED


def test_mark_steps_are_censored_at_the_run_length():
    never = R.summarize(_series([0.0] * 12, [0.05] * 12), 0.5)
    assert never["mark_steps"] == 12 and never["mark_reached"] == 0.0
    soon = R.summarize(_series([0.0] * 12, [0.9] * 12), 0.5)
    assert soon["mark_steps"] < 12 and soon["mark_reached"] == 1.0


def test_free_end_counts_the_tokens_through_the_closing_marker():
    toks = ["<", "think", ">", " and", " </", "think", ">", " red", "!"]
    assert R.free_end(toks) == 7
    assert R.free_end([" red", "!"]) == 0


@pytest.mark.slow
@pytest.mark.harness
def test_long_replication_miniature_end_to_end(tmp_path, cache_dir):
    rep = _script()
    docs, logs = tmp_path / "docs", tmp_path / "logs"
    rc = rep.main(
        [
            "--long",
            "--cells=2:0,2:3",
            "--seeds=2",
            "--methods=gdpo,mrtpo",
            "--steps=3",
            "--sft-max-steps=6",
            "--sft-override=stage.sft.target_success=0.0",
            "--sft-override=stage.sft.eval_every=3",
            "--sft-override=stage.sft.min_steps=0",
            "--sft-override=stage.sft.eval_prompts=4",
            f"--sft-override=paths.cache_dir={cache_dir}",
            "--override=rl.prompts_per_step=2",
            "--override=rl.group_size=4",
            "--override=callbacks.relevance_dump.every=1",
            f"--docs={docs}",
            f"--logdir={logs}",
        ]
    )
    assert rc == 0
    for cell in ((2, 0), (2, 3)):
        for phase in L.SFT_PHASES:
            sft = json.loads(
                (L.cell_dir(logs, cell) / phase / "policy" / "mrtpo_sft.json").read_text()
            )
            assert sft["steps"] == 3, (cell, phase)
        noisy = json.loads(
            (L.cell_dir(logs, cell) / "sft_noisy" / "policy" / "mrtpo_sft.json").read_text()
        )
        assert noisy["target_metric"] == "reward/mark"
        first = set()
        for method in ("gdpo", "mrtpo"):
            job = json.loads((L.cell_dir(logs, cell) / method / "s0" / "job.json").read_text())
            assert job["error"] is None, job["error"]
            curve = rl_curves(job["csv"])
            assert len(curve["success"]) == 3 and set(curve) == {"success", "first", "mark"}
            first.add(curve["mark"][0])
        assert len(first) == 1  # same warm start, prompts and sampling seed
    report = (docs / "replication_long.md").read_text()
    # the commit, with +dirty when run from a working copy with changes
    assert re.search(r"runs and report from commit `[0-9a-f]{7,}(\+dirty)?`", report)
    assert report.index("## Design and predictions") < report.index("## Verdicts")
    assert report.index("## Verdicts") < report.index("## Results per cell")
    for n in range(1, 6):
        assert re.search(rf"^{n}\. \*\*.+\*\* — \*\*(reproduced|not reproduced|inconclusive)\*\*",
                         report, re.M), n  # fmt: skip
    assert (docs / "figures" / "long_curves.png").stat().st_size > 0
    assert "| K = 2, free 3 | mrtpo | 2 |" in report
    run = json.loads((logs / "run.json").read_text())
    assert run["cells"] == [[2, 0], [2, 3]] and not math.isnan(run["seeds"])
    # the report rebuilt from the log folder alone says the same
    again = tmp_path / "again"
    assert rep.main(["--long", "--report-only", f"--logdir={logs}", f"--docs={again}"]) == 0
    strip = lambda s: re.sub(r"on \d{4}-\d\d-\d\d \d\d:\d\d UTC", "", s)  # noqa: E731
    assert strip((again / "replication_long.md").read_text()).replace(str(again), "") == strip(
        report
    ).replace(str(docs), "")
    # --recheck runs seed 0 and the short warm starts again at this code and says what it found
    # (it was ignored for the plain long toy: only the credit report read it)
    assert (
        rep.main(["--long", "--report-only", "--recheck", f"--logdir={logs}", f"--docs={again}"])
        == 0
    )
    checked = json.loads((logs / "recheck.json").read_text())["jobs"]
    assert {"k2_f0/gdpo/s0", "k2_f3/mrtpo/s0", "k2_f0/sft"} <= {j["key"] for j in checked}
    assert all(j["max_abs_diff"] == 0 and j["rows"] == j["rows_again"] for j in checked), checked
    assert "**Rechecked at commit" in (again / "replication_long.md").read_text()


def test_credit_stats_reading_and_picture_of_a_made_up_dump(tmp_path):
    """One long response whose `mark` relevance sits on the mark: the diagnostics find it on
    the checker's tokens and outside the free part, and MRTPO's capped weights give those
    tokens more of the credit than GDPO's even spread."""
    import yaml
    from tests.conftest import CONFIG_DIR

    from mrtpo.core.models import build_tokenizer
    from mrtpo.tasks.synthetic import SyntheticTask

    tiny = yaml.safe_load((CONFIG_DIR / "model" / "toy.yaml").read_text())["tiny"]
    tok = build_tokenizer(tiny["vocab_size"], tiny["extra_corpus"])
    task = SyntheticTask(num_constraints=4, num_train=20, closing_mark=True, free_tokens=4)
    ex = task.examples("train")[0]
    by = {c.kind: c.value for c in ex.data["constraints"]}
    words = [by["first"], *["red"] * (int(by["count"]) - 2), by["last"]]
    text = f"<think> and or to in </think> {' '.join(words)}{by['mark']}"
    ids = [*tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    tokens = [tok.decode([i]) for i in ids]
    n, at = len(ids), len(ids) - 2  # the mark, just before the end
    q = [0.01] * n
    q[at] = 0.9
    mean = sum(q) / n
    w = [0.5 + 0.5 * x / mean for x in q]  # beta = 0.5
    rec = {"id": ex.id, "token_ids": ids, "tokens": tokens, "q": {"mark": q}, "w": {"mark": w},
           "rewards": {"mark": 1.0}, "step": 1, "prompt": "p", "beta": 0.5, "seed": 0}  # fmt: skip
    cell = L.CellRuns((4, 4), {}, {}, [rec])
    got = R.credit_stats(cell, task, tok, cap_s=0.5)["mark"]
    assert got["pairs"] == 1 and got["free_t"] == pytest.approx(10 / n)  # 4 words + 2 x 3 tokens
    assert got["free_q"] == pytest.approx(0.1 / sum(q))
    assert got["gdpo"] == pytest.approx(2 / n)  # the mark and the end
    assert got["w"] > 3 and got["mrtpo"] > 2 * got["gdpo"]  # the mark high, the end low
    lines: list[str] = []
    diag = {(4, 4): {"relevance": {"mark": {"enrichment": 8.0, "q_share": 0.9, "tok_share": 0.1}},
                     "credit": {"mark": got}, "cap_s": 0.5}}  # fmt: skip
    R._reading(lines.append, diag)
    text = "\n".join(lines)
    assert "on the decisive tokens" in text and "binds (mean s = 0.50" in text
    R.plot_relevance_wrapped(rec, tmp_path / "r.png", tmp_path / "r.html", width=8)
    assert (tmp_path / "r.png").stat().st_size > 0 and "q=0.9000" in (
        tmp_path / "r.html"
    ).read_text()


def test_the_report_names_changed_verdicts_and_where_the_change_comes_from(monkeypatch):
    """Over the previous report's cells the verdicts are the recorded ones; a cell added since
    where MRTPO trails GDPO changes some, and the section blames the added cell. A recorded
    verdict the old cells do not give again is blamed on the runs."""
    methods = ["gdpo", "mrtpo", "mrtpo_shuffle", "mrtpo_joint"]

    def cell(edge: float) -> dict:
        gains = {"gdpo": 0, "mrtpo": edge, "mrtpo_shuffle": 0, "mrtpo_joint": edge / 2}
        return {
            m: {
                s: R.summarize(_series(_ramp(0.01 * s, 0.05 + g), _ramp(0.05, 0.05 + 2 * g)), 0.5)
                for s in range(4)
            }
            for m, g in gains.items()
        }

    old = {(4, f): cell(0.002 * f) for f in L.FREE}
    monkeypatch.setitem(R.PREVIOUS_REPORT, "cells", tuple(old))
    before = {c.number: c.verdict for c in R.predictions(old, methods)}
    monkeypatch.setitem(R.PREVIOUS_REPORT, "verdicts", before)

    def section(tab) -> str:
        lines: list[str] = []
        R._against_previous(lines.append, tab, R.predictions(tab, methods), methods)
        return "\n".join(lines)

    assert "Every verdict is the same." in section(old)
    new = {**old, (8, L.LONG_FREE): cell(-0.03)}
    text = section(new)
    changed = [c for c in R.predictions(new, methods) if c.verdict != before[c.number]]
    assert changed and "this one adds (8, 60)." in text
    for c in changed:
        assert f"- P{c.number}: {before[c.number]} → **{c.verdict}**" in text
    assert text.count("so the change comes from the cells added since") == len(changed)
    monkeypatch.setitem(R.PREVIOUS_REPORT, "verdicts", {**before, 1: C.NOT_REPRODUCED})
    assert "so the change is in the runs themselves" in section(old)
