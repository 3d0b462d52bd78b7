"""Issue 49's credit experiment (``scripts/replicate.py --long --credit``): its jobs, the
decision rule on made-up tables, the time estimate, and the report from made-up run folders
(fast: nothing is trained)."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest
from tests.conftest import ROOT

from replication import claims as C
from replication import credit as X
from replication import credit_report as R
from replication import long as L
from replication.harness import method_dir
from replication.jobs import Job

pytestmark = pytest.mark.harness


def _opts(tmp_path: Path, **kw) -> L.LongOptions:
    base = L.LongOptions(logdir=tmp_path / "run", seeds=X.SEEDS, docs=tmp_path / "docs")
    return X.credit_options(base.__class__(**{**base.__dict__, **kw}))


def _value(job: Job, key: str) -> str | None:
    vals = [o.split("=", 1)[1] for o in job.overrides if o.startswith(key + "=")]
    return vals[-1] if vals else None


def test_phase1_runs_every_arm_with_its_cap_and_context_named(tmp_path):
    opts = _opts(tmp_path)
    jobs = {j.key: j for j in X.phase1_jobs(opts)}
    for spec in X.ARMS.values():
        for s in range(X.SEEDS):
            job = jobs[f"k8_f60/{spec}/s{s}"]
            if spec != "gdpo":
                cap, ctx = spec.split("@")[1].split(",")
                assert _value(job, "method.cap") == cap.split("=")[1]
                assert _value(job, "method.context") == ctx.split("=")[1]
            assert _value(job, "task.num_constraints") == "8"
            assert _value(job, "task.free_tokens") == "60"
    assert all(f"k{k}_f60/gdpo/s{s}" in jobs for k in (2, 4) for s in range(X.SEEDS))
    assert not any("/mrtpo" in k for k in jobs if k.startswith(("k2_", "k4_")))
    # the drawn check: its clean pass starts from K = 8's 60-word clean policy, fixed length
    clean = jobs["k8_d30-90/sft"]
    assert _value(clean, "task.free_tokens") == "[30,90]"
    assert _value(clean, "rollout.sampling.max_new_tokens") == str(12 + 6 + 90 + 45)
    assert _value(clean, "model.name_or_path").endswith("k8_f60/sft/policy")
    assert _value(clean, "trainer.max_steps") == _value(clean, "stage.sft.min_steps") == "300"
    assert "k8_f60/sft" in clean.after
    drawn = [k for k in jobs if k.startswith("k8_d30-90/mrtpo")]
    assert len(drawn) == 2 * X.CHECK_SEEDS


@pytest.mark.parametrize("context", ["delete", "mask"])
def test_phase2_runs_the_decided_defaults_where_phase1_did_not(tmp_path, context):
    opts = _opts(tmp_path)
    keys = {j.key for j in X.phase2_jobs(opts, X.Decision("token", context))}
    want = {f"k{k}_f60/{name}@cap=token,context={context}/s{s}"
            for k in (2, 4) for name in ("mrtpo", "mrtpo_joint") for s in range(X.SEEDS)}  # fmt: skip
    if context == "mask":  # the joint arm of phase 1 is at delete
        want |= {f"k8_f60/mrtpo_joint@cap=token,context=mask/s{s}" for s in range(X.SEEDS)}
    assert keys == want


def _table(diffs: dict[str, list[float]]) -> C.Table:
    """A made-up cell: GDPO's AUC 0.1 + a seed's noise, each arm GDPO's + its seed's diff."""
    noise = [0.01 * ((s * 7) % 5) for s in range(8)]
    runs = {X.ARMS["gdpo"]: {s: {"auc": 0.1 + noise[s]} for s in range(8)}}
    for arm, d in diffs.items():
        runs[X.ARMS[arm]] = {s: {"auc": 0.1 + noise[s] + d[s]} for s in range(8)}
    return {X.CELL: runs}


SPREAD = [0.001 * (s % 3) for s in range(8)]


def test_decision_rule_on_made_up_arms():
    zero = [0.0] * 8
    same = {a: zero for a in ("batch/delete", "batch/mask", "token/delete", "token/mask")}
    d = X.decide(_table(same))  # no difference anywhere: no interval wholly on a side
    assert (d.cap, d.context) == ("token", "delete")
    worse = [-0.03 + x for x in SPREAD]
    d = X.decide(_table(same | {"token/delete": worse, "token/mask": worse}))
    assert (d.cap, d.context) == ("batch", "delete")
    better = [0.02 + x for x in SPREAD]
    d = X.decide(_table(same | {"token/mask": better}))
    assert (d.cap, d.context) == ("token", "mask")
    assert d.numbers["context"].lo > 0 and d.numbers["interaction"].mean == pytest.approx(0.020875)
    # batch/mask ahead of everything: token is then worse on average over the contexts, so the
    # cap goes back to batch, and the context is judged at batch
    d = X.decide(_table(same | {"batch/mask": better}))
    assert (d.cap, d.context) == ("batch", "mask")
    # mask ahead at batch only, by less than token's gain: the context is judged at token
    d = X.decide(_table(same | {"batch/mask": better, "token/delete": [0.05] * 8,
                                "token/mask": [0.05] * 8}))  # fmt: skip
    assert (d.cap, d.context) == ("token", "delete")
    noisy = [0.05 * (-1) ** s for s in range(8)]  # mask ahead on average, inconclusive
    d = X.decide(_table(same | {"token/mask": [x + 0.01 for x in noisy]}))
    assert d.context == "delete" and d.numbers["context"].sign == 0


def test_the_estimate_follows_the_pool_and_skips_reused_warm_starts(tmp_path):
    opts = _opts(tmp_path)
    one = X.phase1_jobs(opts)
    fresh = X.estimate(one, 2)
    assert X.reused_keys(L.LongOptions(warm_from=tmp_path)) == frozenset()  # no run folder
    (tmp_path / "run.json").write_text("{}")
    reused = X.estimate(one, 2, X.reused_keys(L.LongOptions(warm_from=tmp_path)))
    assert 20 < reused < fresh < 90
    a = Job("k2_f60/gdpo/s0", [], tmp_path / "a", 30)
    b = Job("k2_f60/gdpo/s1", [], tmp_path / "b", 30, after=("k2_f60/gdpo/s0",))
    assert X.estimate([a, b], 2) == pytest.approx(2 * X.RL_MIN[2])  # b waits for a
    assert X.estimate([a, b.__class__(b.key, [], b.out, 30)], 2) == pytest.approx(X.RL_MIN[2])


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("replicate", ROOT / "scripts" / "replicate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    logdir = tmp_path / "plan"
    assert mod.main(["--long", "--credit", "--dry-run", "--logdir", str(logdir)]) == 0
    out = capsys.readouterr().out
    assert "phase 1: 85 jobs" in out and "phase 2 if context=mask: 40 RL runs" in out
    assert "k8_f60/mrtpo@cap=batch,context=mask/s7" in out
    assert not logdir.exists()
    with pytest.raises(SystemExit):
        mod.parse_args(["--credit"])  # a --long option


# ---------------------------------------------------------------------------------------------
# The report, from made-up run folders
# ---------------------------------------------------------------------------------------------


def _write_run(folder: Path, success: list[float], diag: dict[str, float]) -> None:
    """A finished run: job.json naming a metrics.csv with success, `mark` and diagnostics."""
    folder.mkdir(parents=True)
    cols = ["step", "train/success", "train/reward/mark/mean", *diag]
    with open(folder / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for step, s in enumerate(success):
            w.writerow([step, s, s, *diag.values()])
    info = {"key": folder.name, "csv": str(folder / "metrics.csv"), "error": None}
    (folder / "job.json").write_text(json.dumps(info))


def _diag(close: float) -> dict[str, float]:
    return {
        "train/replay/q_ratio/p50": 0.5, "train/replay/q_ratio/p99": 9.0,
        "train/replay/q_ratio/max": 22.0, "train/replay/profile_cosine": 0.3,
        "train/replay/energy_share/free": 0.9 - close, "train/replay/energy_share/close": close,
        "train/replay/energy_share/answer": 0.08, "train/replay/energy_share/mark": 0.02,
        "train/adv/cap_bound_share": 0.25, "train/adv/sign_flip_share": 0.0,
        "train/adv/credit_change": 0.125,
    }  # fmt: skip


def _made_up_experiment(opts: L.LongOptions) -> None:
    """Every arm at K = 8 (MRTPO at token/mask ahead by 0.1 on every step), P5 at the
    decided defaults (mask), the drawn check (closing tag at 0.2 against 0.55 fixed)."""
    ahead = X.ARMS["token/mask"]
    for s in range(X.SEEDS):
        base = [0.1 + 0.01 * s + 0.001 * t for t in range(30)]
        for spec in [*X.ARMS.values(), "mrtpo_joint@cap=token,context=mask"]:
            up = 0.1 + 0.002 * s if spec == ahead else 0.0
            _write_run(L.cell_dir(opts.logdir, X.CELL) / method_dir(spec) / f"s{s}",
                       [x + up for x in base], _diag(0.55))  # fmt: skip
        for k in (2, 4):
            for spec in ("gdpo", ahead, "mrtpo_joint@cap=token,context=mask"):
                up = 0.05 * k / 4 + 0.001 * s if spec == ahead else 0.0
                _write_run(L.cell_dir(opts.logdir, (k, 60)) / method_dir(spec) / f"s{s}",
                           [x + up for x in base], _diag(0.4))  # fmt: skip
        for spec in X.CHECK_ARMS.values():
            if s < X.CHECK_SEEDS:
                _write_run(L.cell_dir(opts.logdir, X.DRAWN_CELL) / method_dir(spec) / f"s{s}",
                           base, _diag(0.2 + 0.01 * s))  # fmt: skip


def _made_up_warm_start(opts: L.LongOptions, cell) -> None:
    for phase, steps in (("sft", 1550), ("sft_noisy", 76)):
        policy = L.cell_dir(opts.logdir, cell) / phase / "policy"
        policy.mkdir(parents=True)
        last = {"success": 0.652, "success_others": 0.115, "reward/mark": 0.039}
        (policy / "mrtpo_sft.json").write_text(json.dumps({"steps": steps, "reached": True,
                                                           "history": [last]}))  # fmt: skip


def test_report_from_made_up_runs(tmp_path):
    opts = _opts(tmp_path, steps=30, commit="abc1234")
    _made_up_experiment(opts)
    _made_up_warm_start(opts, X.CELL)
    runs = X.read_runs(opts)
    assert set(runs) == {*X.p5_cells(), X.DRAWN_CELL}
    assert runs[X.CELL][X.ARMS["batch/delete"]][3]["diag"]["share/close"] == pytest.approx(0.55)
    out = R.write_report(runs, opts, 600.0, opts.docs / "replication_long.md")
    text = out.read_text()
    # the decisions: mask wholly ahead at token, token not worse than batch
    assert "new defaults for P5: **cap=token, context=mask**" in text
    assert f"design history, last entry, commit `{R.DECISION_COMMIT}`" in text
    assert "- check: sign flips under cap=token: largest run mean 0 over 32 runs (none" in text
    assert "- check: gdpo: AUC 0.149 here, 0.135 in the previous report (**not the same**)" in text
    # the arms table and verdicts: token/mask ahead of GDPO and of the joint arm
    rows = [x for x in text.splitlines() if x.startswith("| token/mask |")]
    assert "| 8 | 0.257 [0.232, 0.281] |" in rows[0]  # the arms table: AUC
    assert (
        rows[1].count("**ahead**") == 2 and "+0.107 [+0.103, +0.111]" in rows[1]
    )  # the paired differences
    rows = [x for x in text.splitlines() if x.startswith("| batch/delete |")]
    assert rows[1].count("inconclusive") == 2
    # P5 at the new defaults: the gain grows with K (0.025, 0.05, 0.1 + the seed's)
    assert "**reproduced**" in next(x for x in text.splitlines() if x.startswith("5. "))
    # the diagnostics table: one row per replaying arm and cell, the closing tag's share
    diag = [x for x in text.splitlines() if x.startswith("| K = 8, free 60 | token/mask |")]
    assert diag and "| 0.55 |" in diag[0] and "| 22.00 |" in diag[0]
    assert "| K = 2, free 60 | joint@cap=token,context=mask |" in text
    # the drawn check passes: 0.2–0.23 against 0.55 at the fixed length
    check = next(x for x in text.splitlines() if x.startswith("| token/delete | 0.215"))
    assert "**passes**" in check and "0.550" in check
    assert "- wall time: **10.0 min**" in text
    # the warm start's table, for the cell whose warm start is there
    start = next(x for x in text.splitlines() if x.startswith("| K = 8, free 60 | 1550 |"))
    assert "| 76 | 0.115 | 0.039 |" in start
    assert R.DESIGN_HISTORY[-1][:60] in text


def test_a_p5_cell_whose_warm_start_missed_is_named_and_p5_read_without_it(tmp_path):
    """Issue 42's rule: K = 8's clean pass stopped at its limit short of its target, so the
    report says where it stopped and reads P5 over K = 2 and 4 as well."""
    opts = _opts(tmp_path, steps=30, commit="abc1234")
    _made_up_experiment(opts)
    _made_up_warm_start(opts, X.CELL)
    summary = L.cell_dir(opts.logdir, X.CELL) / "sft" / "policy" / "mrtpo_sft.json"
    missed = {"steps": 5000, "reached": False, "history": [{"success": 0.469}]}
    summary.write_text(json.dumps(missed))
    assert list(R.missed_starts(opts)) == [X.CELL]
    text = R.write_report(X.read_runs(opts), opts, 600.0, opts.docs / "out.md").read_text()
    assert (
        "did not reach its start: its clean pass stopped at its step limit (5000 steps) at "
        "held-out success 0.469" in text
    )
    over = next(x for x in text.splitlines() if "P5 over the cells that did" in x)
    assert "K 2:" in over and "K 4:" in over and "K 8:" not in over
    assert "warm start missed its target" in text
    # the fixed cell's closing-tag share (0.55) is above the bar: no caveat on the drawn check
    assert "cannot tell what drawing the length changes" not in text


def test_drawn_check_fails_when_the_closing_tag_keeps_most_energy(tmp_path):
    opts = _opts(tmp_path)
    for spec in X.CHECK_ARMS.values():
        for s in range(3):
            _write_run(L.cell_dir(opts.logdir, X.DRAWN_CELL) / method_dir(spec) / f"s{s}",
                       [0.1] * 5, _diag(0.7 + 0.01 * s))  # fmt: skip
    words = {name: word for name, _, _, word in R.drawn_check(X.read_runs(opts))}
    assert words == {"token/delete": "fails", "token/mask": "fails"}


@pytest.mark.slow
def test_credit_experiment_miniature_end_to_end(tmp_path, cache_dir):
    """Both phases with one seed, tiny passes and 2 RL steps: every arm runs (the masked
    contexts and the drawn length included), the rule decides, the report is written and
    rebuilt the same from the log folder."""
    spec = importlib.util.spec_from_file_location("replicate", ROOT / "scripts" / "replicate.py")
    rep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rep)
    docs, logs = tmp_path / "docs", tmp_path / "logs"
    sft = ["stage.sft.target_success=0.0", "stage.sft.eval_every=2", "stage.sft.min_steps=0",
           "stage.sft.eval_prompts=4", f"paths.cache_dir={cache_dir}"]  # fmt: skip
    args = ["--long", "--credit", "--seeds=1", "--steps=2", "--sft-max-steps=2",
            *(f"--sft-override={o}" for o in sft), "--override=rl.prompts_per_step=2",
            "--override=rl.group_size=2", f"--docs={docs}", f"--logdir={logs}"]  # fmt: skip
    assert rep.main(args) == 0
    decision = json.loads((logs / "decision.json").read_text())
    assert (decision["cap"], decision["context"]) in {
        ("token", "delete"),
        ("token", "mask"),
        ("batch", "delete"),
        ("batch", "mask"),
    }
    runs = X.read_runs(_opts(tmp_path, logdir=logs, seeds=1))
    assert set(runs[X.CELL]) >= set(X.ARMS.values())
    drawn = runs[X.DRAWN_CELL][X.ARMS["token/mask"]][0]
    assert len(drawn["series"]["success"]) == 2
    report = (docs / "replication_long.md").read_text()
    assert "## The arms at K = 8, free 60" in report and "## P5 at the new defaults" in report
    again = tmp_path / "again"
    assert rep.main(["--long", "--report-only", f"--logdir={logs}", f"--docs={again}"]) == 0
    assert "## The drawn-length check" in (again / "replication_long.md").read_text()
