"""The replication report from in-memory results (no training): tables, paired differences,
verdicts, the trend in K and the commit line, against hand-computed numbers."""

from __future__ import annotations

import re
import subprocess

import pytest

from replication.harness import KResult, Options
from replication.toy_report import source_commit, write_report

# success per step; AUC = the mean; steps to 0.5 use the 5-step trailing average
GDPO = [[0, 0, 0.5, 0.5], [0, 0.5, 0.5, 0.5], [0, 0, 0, 0.5]]  # AUC .25 .375 .125; never 0.5
MRTPO = [[0, 0.5, 0.5, 1.0], [0.5, 0.5, 0.5, 1.0], [0, 0.5, 0.5, 1.0]]  # AUC .5 .625 .5


def _sft(steps: int, success: float, stop_when: str, target: float) -> dict:
    return {
        "steps": steps,
        "reached": True,
        "stop_when": stop_when,
        "target_success": target,
        "history": [{"success": success, "reward/first": 0.9, "reward/last": 0.8}],
        "eval": {"prompts": 8, "samples": 4, "temperature": 1.0},
    }


def _result(k: int, mrtpo: list[list[float]]) -> KResult:
    return KResult(
        k=k,
        sft={"sft": _sft(300, 0.61, "above", 0.6), "sft_noisy": _sft(200, 0.2, "below", 0.25)},
        curves={
            "gdpo": [{"success": c, "first": c} for c in GDPO],
            "mrtpo": [{"success": c, "first": c} for c in mrtpo],
        },
        seeds={"gdpo": [0, 1, 2], "mrtpo": [0, 1, 2]},
        relevance_sft={
            "first": {
                "pairs": 12,
                "q_share": 0.5,
                "tok_share": 0.2,
                "enrichment": 2.5,
                "argmax_hit": 0.75,
            }
        },
    )


@pytest.fixture
def report(tmp_path):
    opts = Options(
        k_values=[2, 4], seeds=3, methods=["gdpo", "mrtpo"], threshold=0.5,
        logdir=tmp_path / "logs", docs=tmp_path / "docs", commit=source_commit(),
    )  # fmt: skip
    # K=4: MRTPO's curves equal GDPO's (no gain), so the gain shrinks with K
    results = [_result(2, MRTPO), _result(4, GDPO)]
    out = write_report(results, opts, {"RL": "4 steps"}, 90.0, tmp_path / "docs" / "r.md")
    return out.read_text()


def test_method_table(report):
    k2 = report.split("## K = 2")[1].split("## K = 4")[0]
    # gdpo AUC .25 .375 .125: mean .25, sd .125, half t(.975, 2) * .125 / sqrt(3) = 0.3105;
    # start (first 3 steps) .167 .333 0: sd .1667, half 0.414; no run reaches 0.5 -> steps
    # counted as 4 (the run length); final (last 10 steps) = AUC on 4-step runs
    assert "| gdpo | 3 | 0.167 ± 0.414 | 4.0 ± 0.0 | 0/3 | 0.250 ± 0.311 | 0.250 ± 0.311 |" in k2
    # mrtpo: starts .333 .5 .333 (sd .0962, half 0.239); smoothed crossings at steps 4, 1, 4
    # -> 3.0, sd sqrt(3), half 4.3027; AUC .5 .625 .5: mean .5417, sd .0722, half 0.179
    assert "| mrtpo | 3 | 0.389 ± 0.239 | 3.0 ± 4.3 | 3/3 | 0.542 ± 0.179 | 0.542 ± 0.179 |" in k2
    assert "steps to success ≥ 0.5" in k2
    assert "**Warm start, learn the task (clean references):** 300 SFT steps; stopped at" in k2
    assert "| first | 12 | 0.200 | 0.500 | 2.50× | 0.75 |" in k2


def test_paired_differences_and_verdicts(report):
    k2 = report.split("## K = 2")[1].split("## K = 4")[0]
    # Δ AUC per seed .25 .25 .375: mean .2917, sd .07217, half 4.3027 * .041667 = 0.1793;
    # Δ steps 4-4, 1-4, 4-4 = 0, -3, 0: mean -1, sd sqrt(3), half 4.3
    assert "| mrtpo | 0.292 ± 0.179 | 0.292 ± 0.179 | -1.0 ± 4.3 | 3/3 |" in k2
    assert "MRTPO − GDPO, AUC: +0.292 [+0.112, +0.471] — higher, and the 95% interval" in k2
    assert "**MRTPO learned faster than GDPO**" in k2
    k4 = report.split("## K = 4")[1]
    assert "| mrtpo | 0.000 ± 0.000 | 0.000 ± 0.000 | 0.0 ± 0.0 | 0/3 |" in k4
    assert "**MRTPO did not beat GDPO" in k4


def test_across_k_trend(report):
    across = report.split("## Across K")[1].split("## Caveats")[0]
    assert "| 2 | 0.292 ± 0.179 |" in across and "| 4 | 0.000 ± 0.000 |" in across
    # points (2: .25 .25 .375), (4: 0 0 0): slope -.875 / 6 = -0.14583; RSS .0104167, Sxx 6,
    # se sqrt(RSS / 4 / 6) = .0208333, half t(.975, 4) * se = 0.05784
    assert (
        "least-squares slope of each seed's MRTPO − GDPO Δ AUC against K, 6 points): "
        "-0.1458 per added reward [-0.2037, -0.0880] — the gain shrinks with K" in across
    )


def test_header_names_the_commit(report):
    header = report.splitlines()[2]
    assert re.search(
        r"on \d{4}-\d\d-\d\d \d\d:\d\d UTC, from commit `[0-9a-f]{7,}(\+dirty)?`", header
    )
    assert "wall time: **1.5 min**" in report


def _git(repo, *args):
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
        capture_output=True,
    )  # fmt: skip


def test_source_commit_marks_dirty_code_only(tmp_path):
    for d in ("src", "configs", "scripts", "docs"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "f.txt").write_text("a")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "x")
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True
    ).stdout.strip()
    assert source_commit(tmp_path) == head
    (tmp_path / "docs" / "f.txt").write_text("b")  # a report rewritten: not a code change
    assert source_commit(tmp_path) == head
    (tmp_path / "scripts" / "f.txt").write_text("b")  # a harness changed: dirty
    assert source_commit(tmp_path) == head + "+dirty"
    _git(tmp_path, "checkout", "-q", "--", "scripts")
    assert source_commit(tmp_path) == head
    (tmp_path / "configs" / "new.yaml").write_text("x: 1")  # untracked config: dirty
    assert source_commit(tmp_path) == head + "+dirty"
    assert source_commit(tmp_path / "docs" / "nowhere").startswith("unknown")


def test_claim_lines_open_the_report(report):
    head = report.split("## Design")[0]
    assert "## The claims, one line each" in head
    lines = [x for x in head.splitlines() if x[:2] in {f"{i}." for i in range(1, 7)}]
    assert [x[:2] for x in lines] == ["1.", "2.", "3.", "4.", "5.", "6."]
    # claim 1: the same six points as test_across_k_trend; the gain shrinks: contradicted
    assert lines[0].startswith(
        "1. **The gain over GDPO grows with the number of rewards K** — **not reproduced**: "
        "slope of MRTPO − GDPO Δ AUC in K -0.1458 [-0.2037, -0.0880] (n = 6) per added reward"
    )
    # no few-token reward, no joint ablation, no replay metrics in these runs
    for i in (1, 2, 4, 5):
        assert "— **inconclusive**: not measured (" in lines[i], lines[i]
    # claim 4: β = 0.5 is mrtpo; pooled Δ AUC .25 .25 .375 0 0 0: mean .14583, sd .16615,
    # half t(.975, 5) * sd / sqrt(6) = .17436
    assert "— **inconclusive**: Δ AUC vs GDPO β = 0.5: +0.146 [-0.029, +0.320] (n = 6)" in lines[3]
    assert "Only β = 0.5 ran" in lines[3]


def test_design_section_states_rules_modes_and_history(report):
    design = report.split("## Design (fixed before any result)")[1].split("## Starting points")[0]
    assert "full = K 2, 4, 8, 8 seeds" in design
    assert "mrtpo@beta=0.25, mrtpo@beta=0.75" in design
    from replication.harness import OPTIONAL_METHODS, available_methods

    for m in OPTIONAL_METHODS:  # a baseline joins the full mode once its config exists
        listed = m in available_methods(True)
        assert (f"- not run: {m}" in design) != listed and (f", {m}" in design) == listed
    assert "(2) the few-token reward `mark`'s compliance after 10 RL steps" in design
    assert "- how the design came about, in order" in design and "  - Before any run: " in design
    assert "- pairing: every method runs every seed" in design


def test_starting_points_table(report):
    starts = report.split("## Starting points per K")[1].split("## K = 2")[0]
    # gdpo starts .167 .333 0 and mrtpo .333 .5 .333 at K=2: six runs, mean .27778,
    # sd .17213, half t(.975, 5) * sd / sqrt(6) = .18064
    assert "| 2 | 300 | 0.610 | 200 | 0.200 | 0.278 ± 0.181 | – |" in starts


def test_determinism_line(tmp_path):
    import json

    logs = tmp_path / "logs"
    logs.mkdir()
    opts = Options(k_values=[2], seeds=3, methods=["gdpo", "mrtpo"], threshold=0.5,
                   logdir=logs, docs=tmp_path / "docs", commit="abc1234")  # fmt: skip
    res = [_result(2, MRTPO)]
    text = write_report(res, opts, {}, 60.0, tmp_path / "r.md").read_text()
    assert "No rerun was made for this report" in text
    (logs / "determinism.json").write_text(json.dumps(
        {"k": 2, "method": "mrtpo", "seed": 0, "steps": 50, "values": 1500,
         "max_abs_diff": 0.0, "column": None, "success_max_abs_diff": 0.0}))  # fmt: skip
    text = write_report(res, opts, {}, 60.0, tmp_path / "r.md").read_text()
    assert "(K = 2, mrtpo, seed 0) was run a second time: all 1500 logged values" in text
    assert "are identical" in text


def test_claim_1_flags_unequal_starts_and_missed_warm_starts(report, tmp_path):
    line = next(x for x in report.splitlines() if x.startswith("1. "))
    # RL starts (first 3 steps): K=2 mean of .167 .333 0 .333 .5 .333 = .278; K=4 gdpo twice
    # = .167; apart by more than START_SPREAD (0.1)
    assert "RL starts differ across K (K = 2: 0.28, K = 4: 0.17)" in line
    assert "never reached its target" not in line
    k4 = _result(4, GDPO)
    k4.sft["sft"]["reached"] = False
    opts = Options(k_values=[2, 4], seeds=3, methods=["gdpo", "mrtpo"], threshold=0.5,
                   logdir=tmp_path / "l", docs=tmp_path / "d", commit="abc1234")  # fmt: skip
    text = write_report([_result(2, MRTPO), k4], opts, {}, 1.0, tmp_path / "r.md").read_text()
    line = next(x for x in text.splitlines() if x.startswith("1. "))
    assert "At K = 4 the first warm-start pass never reached its target" in line


def test_opsd_teacher_section(tmp_path):
    """The teacher check of each K's warm start sits beside OPSD's paired gap to GDPO."""
    opsd = [[0, 0, 0.5, 0.5], [0, 0.5, 0.5, 0.5], [0, 0, 0, 0.25]]  # AUC .25 .375 .0625
    r = _result(2, MRTPO)
    r.curves["opsd"] = [{"success": c, "first": c} for c in opsd]
    r.seeds["opsd"] = [0, 1, 2]
    r.teacher = {"prompts": 64.0, "success_plain": 1.0, "copy_plain": 0.0,
                 "success_teacher": 0.84375, "copy_teacher": 0.015625}  # fmt: skip
    opts = Options(k_values=[2], seeds=3, methods=["gdpo", "mrtpo", "opsd"], threshold=0.5,
                   logdir=tmp_path / "l", docs=tmp_path / "d", commit="abc1234")  # fmt: skip
    text = write_report([r], opts, {}, 1.0, tmp_path / "r.md").read_text()
    assert "## OPSD's teacher" in text and "64 held-out prompts" in text
    row = next(x for x in text.splitlines() if x.startswith("| 2 | 1.00 |"))
    # Δ AUC per seed: 0, 0, -0.0625 -> mean -0.021
    assert row.startswith("| 2 | 1.00 | 0.84 | 0.02 | -0.021 [")
    # without a teacher check (no OPSD runs) there is no section
    r.teacher = {}
    text = write_report([r], opts, {}, 1.0, tmp_path / "r2.md").read_text()
    assert "## OPSD's teacher" not in text


# ---- Learning under one_step_off (issue 39) --------------------------------------------------

# gdpo@one_step_off AUC .25 .375 .25: paired − gdpo (sync) 0, 0, +.125
GDPO_OFF = [[0, 0, 0.5, 0.5], [0, 0.5, 0.5, 0.5], [0, 0.5, 0.5, 0]]
# mrtpo@one_step_off AUC .25 .25 .25: paired − mrtpo (sync) −.25, −.375, −.25
MRTPO_OFF = [[0, 0, 0.5, 0.5], [0, 0.5, 0, 0.5], [0.5, 0, 0, 0.5]]
STALE = [0.0, 1.0, 1.0, 1.0]  # train/rollout/staleness/max per step


@pytest.fixture
def schedule_report(tmp_path):
    r = _result(4, MRTPO)
    for m, curves in (("gdpo@one_step_off", GDPO_OFF), ("mrtpo@one_step_off", MRTPO_OFF)):
        r.curves[m] = [{"success": c, "first": c, "staleness/max": STALE} for c in curves]
        r.seeds[m] = [0, 1, 2]
    methods = ["gdpo", "mrtpo", "gdpo@one_step_off", "mrtpo@one_step_off"]
    opts = Options(k_values=[4], seeds=3, methods=methods, threshold=0.5, full=True,
                   logdir=tmp_path / "l", docs=tmp_path / "d", commit="abc1234")  # fmt: skip
    return write_report([r], opts, {}, 1.0, tmp_path / "r.md").read_text()


def test_one_step_off_section(schedule_report):
    text = schedule_report
    sec = text.split("## Learning under one_step_off (issue 39)")[1].split("## Caveats")[0]
    assert "| K | quantity | sync | one_step_off | one_step_off − sync, paired |" in sec
    # gdpo: sync AUC .25 ± .311 (test_method_table); one_step_off .2917, sd .0722, half .179;
    # paired 0 0 .125: mean .0417, sd .0722, half t(.975, 2) * .0722 / sqrt(3) = .1793
    assert (
        "| 4 | gdpo AUC | 0.250 ± 0.311 | 0.292 ± 0.179 | +0.042 [-0.138, +0.221] (n = 3) |" in sec
    )
    assert (
        "- K = 4, gdpo AUC: within the sync interval: one_step_off 0.292 inside sync's "
        "[-0.061, 0.561]; paired one_step_off − sync +0.042 [-0.138, +0.221] (n = 3)\n" in sec
    )
    # mrtpo: sync .5417 ± .1793 = [.362, .721]; one_step_off .25 (no spread): below it
    assert (
        "| 4 | mrtpo AUC | 0.542 ± 0.179 | 0.250 ± 0.000 | -0.292 [-0.471, -0.112] (n = 3) |" in sec
    )
    assert (
        "- K = 4, mrtpo AUC: differs: one_step_off 0.250, below sync's [0.362, 0.721]; "
        "paired one_step_off − sync -0.292 [-0.471, -0.112] (n = 3)" in sec
    )
    # MRTPO − GDPO: sync .25 .25 .375; one_step_off 0, −.125, 0; their difference −.25, −.375,
    # −.375 (mean −.3333, sd .0722, half .1793)
    assert (
        "| 4 | MRTPO − GDPO Δ AUC | +0.292 [+0.112, +0.471] (n = 3) | "
        "-0.042 [-0.221, +0.138] (n = 3) | -0.333 [-0.513, -0.154] (n = 3) |" in sec
    )
    assert (
        "- K = 4, MRTPO − GDPO Δ AUC: differs: one_step_off -0.042, below sync's "
        "[+0.112, +0.471]; paired one_step_off − sync -0.333 [-0.513, -0.154] (n = 3)" in sec
    )
    assert (
        "gdpo@one_step_off at K = 4: 0 at the first step, 1 at the later steps (3 runs); "
        "mrtpo@one_step_off at K = 4: 0 at the first step, 1 at the later steps (3 runs)." in sec
    )
    # the design states the variants and the rule
    design = text.split("## Design (fixed before any result)")[1].split("## Starting points")[0]
    assert (
        "- schedules (issue 39): gdpo@one_step_off, mrtpo@one_step_off run again at K = 4" in design
    )
    assert "`rollout.engine.own_copy=true rollout.schedule=one_step_off`" in design
    assert "(the gdpo@one_step_off, mrtpo@one_step_off runs at K = 4 only)" in design


def test_schedule_variants_stay_out_of_the_claims(schedule_report):
    """The claims and the paired table against GDPO compare methods under one schedule: the
    variants appear in their K's method table and in their own section only."""
    k4 = schedule_report.split("## K = 4")[1].split("### Where the relevance lands")[0]
    assert "| mrtpo@one_step_off | 3 |" in k4 and "| gdpo@one_step_off | 3 |" in k4
    paired = k4.split("Paired differences against gdpo")[1]
    assert "one_step_off" not in paired
    head = schedule_report.split("## Design")[0]
    assert "one_step_off" not in head  # the claim lines
    assert "one_step_off" not in schedule_report.split("## Claim 1")[1].split("## Determinism")[0]


def test_no_schedule_section_without_variants(report):
    assert "## Learning under" not in report and "- schedules (issue 39)" not in report


def test_schedule_verdict_branches():
    from mrtpo.evaluate.analysis.stats import Interval
    from replication.toy_report import schedule_verdict

    sync = Interval(0.5, 0.1, 8)  # [0.4, 0.6]
    small = Interval(0.01, 0.02, 8)  # paired interval containing zero
    shift = Interval(0.05, 0.02, 8)  # paired interval excluding zero
    v = schedule_verdict(sync, Interval(0.55, 0.1, 8), small, "one_step_off")
    assert v.startswith("within the sync interval: one_step_off 0.550 inside sync's [0.400, 0.600]")
    assert "excludes zero" not in v
    v = schedule_verdict(sync, Interval(0.55, 0.1, 8), shift, "one_step_off")
    assert v.startswith("within the sync interval") and "paired interval excludes zero" in v
    assert schedule_verdict(sync, Interval(0.6, 0.1, 8), shift, "x").startswith("within")  # edge
    v = schedule_verdict(sync, Interval(0.7, 0.1, 8), shift, "one_step_off")
    assert v == (
        "differs: one_step_off 0.700, above sync's [0.400, 0.600]; paired one_step_off − sync "
        "+0.050 [+0.030, +0.070] (n = 8)"
    )
    v = schedule_verdict(Interval(0.1, 0.05, 8), Interval(-0.1, 0.1, 8), shift, "s", signed=True)
    assert v.startswith("differs: s -0.100, below sync's [+0.050, +0.150]")
    nan = float("nan")
    assert schedule_verdict(Interval(nan, nan, 0), sync, small, "s") == "no data"
    assert schedule_verdict(sync, Interval(nan, nan, 0), small, "s") == "no data"
    assert schedule_verdict(Interval(0.5, nan, 1), sync, small, "s").startswith(
        "no sync interval (n = 1)"
    )
