"""The claim statistics (mrtpo.evaluate.analysis.stats) and verdicts (replication.claims) on
hand-computed inputs: no training."""

from __future__ import annotations

import math

import pytest

from mrtpo.evaluate.analysis.stats import Interval, early_minus_late, mean_finite, value_at
from replication import claims
from replication.claims import (
    INCONCLUSIVE,
    NOT_REPRODUCED,
    REPRODUCED,
    all_of,
    below_verdict,
    claim_verdict,
)
from replication.harness import (
    compare_metrics,
    method_dir,
    parse_method,
    runs_at,
    schedule_of,
    sync_spec,
)

T975_DF2 = 4.302652729749464
T975_DF5 = 2.570581835636314


# ---- stats ------------------------------------------------------------------------------------


def test_value_at_is_the_trailing_mean_at_a_step():
    c = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    assert value_at(c, 5) == pytest.approx(0.2)  # steps 1..5
    assert value_at(c, 7) == pytest.approx(0.4)  # steps 3..7
    assert value_at(c, 2) == pytest.approx(0.05)  # what exists
    assert value_at(c, 3, w=1) == pytest.approx(0.2)
    assert math.isnan(value_at(c, 8)) and math.isnan(value_at(c, 0))
    assert value_at([math.nan, 1.0, 0.0], 3) == pytest.approx(0.5)  # NaN steps left out


def test_early_minus_late_and_mean_finite():
    share = [0.6, 0.5, 0.4, math.nan, 0.3, 0.2, 0.1]  # finite: .6 .5 .4 .3 .2 .1
    assert early_minus_late(share, 2) == pytest.approx(0.55 - 0.15)
    assert early_minus_late(share, 3) == pytest.approx(0.5 - 0.2)
    assert math.isnan(early_minus_late(share, 4))  # fewer than 2w values
    assert mean_finite([1.0, math.nan, None, 3.0]) == 2.0
    assert math.isnan(mean_finite([math.nan]))


@pytest.mark.parametrize(
    ("iv", "direction", "want"),
    [
        (Interval(0.1, 0.05, 8), 1, REPRODUCED),
        (Interval(0.1, 0.05, 8), -1, NOT_REPRODUCED),
        (Interval(-0.1, 0.05, 8), 1, NOT_REPRODUCED),
        (Interval(-0.1, 0.05, 8), -1, REPRODUCED),
        (Interval(0.1, 0.2, 8), 1, INCONCLUSIVE),
        (Interval(0.1, 0.1, 8), 1, INCONCLUSIVE),  # touches zero
        (Interval(0.1, math.nan, 1), 1, INCONCLUSIVE),  # no interval
    ],
)
def test_claim_verdict(iv, direction, want):
    assert claim_verdict(iv, direction) == want


def test_claim_verdict_needs_a_direction():
    with pytest.raises(ValueError, match="direction"):
        claim_verdict(Interval(1, 1, 2), 0)


def test_all_of_and_below_verdict():
    assert all_of([REPRODUCED, REPRODUCED]) == REPRODUCED
    assert all_of([REPRODUCED, INCONCLUSIVE]) == INCONCLUSIVE
    assert all_of([INCONCLUSIVE, NOT_REPRODUCED]) == NOT_REPRODUCED
    assert all_of([]) == INCONCLUSIVE
    assert below_verdict(Interval(0.2, 0.05, 5), 0.29) == REPRODUCED
    assert below_verdict(Interval(0.25, 0.25, 5), 0.5) == REPRODUCED  # hi = the bound
    assert below_verdict(Interval(0.27, 0.05, 5), 0.29) == INCONCLUSIVE
    assert below_verdict(Interval(0.4, 0.05, 5), 0.29) == NOT_REPRODUCED
    assert below_verdict(Interval(0.1, math.nan, 1), 0.29) == INCONCLUSIVE


# ---- method specs ----------------------------------------------------------------------------


def test_method_specs():
    assert parse_method("gdpo") == ("gdpo", [])
    assert parse_method("mrtpo@beta=0.25") == ("mrtpo", ["method.beta=0.25"])
    assert parse_method("mrtpo@beta=0.25,beta_warmup_steps=5") == (
        "mrtpo", ["method.beta=0.25", "method.beta_warmup_steps=5"],
    )  # fmt: skip
    assert method_dir("mrtpo@beta=0.25") == "mrtpo_beta0.25" and method_dir("gdpo") == "gdpo"
    for bad in ("mrtpo@beta", "mrtpo@=1", "@beta=1", "mrtpo@beta=", "@one_step_off",
                "mrtpo@two_steps_off"):  # fmt: skip
        with pytest.raises(ValueError, match="method spec"):
            parse_method(bad)


def test_schedule_specs():
    """``<method>@one_step_off``: the method's own config, run under the one_step_off rollout
    schedule, in a folder of its own; paired with the spec without the schedule."""
    schedule = ["rollout.schedule=one_step_off", "rollout.engine.own_copy=true"]
    assert parse_method("gdpo@one_step_off") == ("gdpo", schedule)
    assert parse_method("mrtpo@beta=0.25,one_step_off") == (
        "mrtpo",
        ["method.beta=0.25", *schedule],
    )
    assert method_dir("mrtpo@one_step_off") == "mrtpo_one_step_off"
    assert method_dir("mrtpo@beta=0.25,one_step_off") == "mrtpo_beta0.25_one_step_off"
    assert schedule_of("mrtpo@one_step_off") == "one_step_off"
    assert schedule_of("mrtpo@beta=0.25") == schedule_of("gdpo") == "sync"
    assert sync_spec("mrtpo@one_step_off") == "mrtpo" and sync_spec("gdpo") == "gdpo"
    assert sync_spec("mrtpo@beta=0.25,one_step_off") == "mrtpo@beta=0.25"
    # a schedule variant runs at K = 4 (SCHEDULE_K), or at every K of a run without K = 4
    assert [k for k in (2, 4, 8) if runs_at("gdpo@one_step_off", k, [2, 4, 8])] == [4]
    assert [k for k in (2, 8) if runs_at("gdpo@one_step_off", k, [2, 8])] == [2, 8]
    assert all(runs_at("gdpo", k, [2, 4, 8]) for k in (2, 4, 8))


# ---- claims on a hand-made table ---------------------------------------------------------------


def _run(success, mark=None, share=None, top=None):
    s = {"success": success}
    if mark is not None:
        s["mark"] = mark
    if share is not None:
        s["replay/share"] = share
        s["time/replay_share"] = [0.25] * len(share)
    for name, v in (top or {}).items():
        s[f"replay/top80/{name}"] = v
    return s


def test_summarize_one_run():
    n = 12
    x = claims.summarize(
        _run([0.0] * 6 + [1.0] * 6, mark=[0.1 * i for i in range(n)],
             share=[0.6] * 5 + [0.4] * 2 + [0.1] * 5, top={"a": [0.2] * n, "b": [0.4] * n}),
        threshold=0.5, few_token="mark", at_step=10,
    )  # fmt: skip
    assert x["auc"] == 0.5 and x["start"] == 0.0
    # trailing 5 at step 10 crosses at step 9 (.2 .4 .6 .8 -> 0, 0, .2, .4, .6: step 9 = .6)
    assert x["steps_to_threshold"] == 9.0
    assert x["compliance"] == pytest.approx((0.5 + 0.6 + 0.7 + 0.8 + 0.9) / 5)
    assert x["compliance_start"] == pytest.approx(0.1)
    assert x["replay_early"] == pytest.approx(0.6) and x["replay_late"] == pytest.approx(0.1)
    assert x["replay_drop"] == pytest.approx(0.5)
    assert x["replay_overall"] == pytest.approx((3.0 + 0.8 + 0.5) / 12)
    assert x["time_replay"] == 0.25
    assert x["top80/a"] == pytest.approx(0.2) and x["top80"] == pytest.approx(0.3)


def _table(few_token="mark"):
    """K = 2 and 4, three seeds each; AUCs chosen so every difference is easy to check."""

    def flat(v, n=10):
        return [v] * n

    auc = {  # method -> K -> per-seed AUC
        "gdpo": {2: [0.40, 0.50, 0.60], 4: [0.40, 0.50, 0.60]},
        "mrtpo": {2: [0.41, 0.52, 0.60], 4: [0.45, 0.56, 0.64]},  # Δ: .01 .02 0 / .05 .06 .04
        "mrtpo_joint": {
            2: [0.40, 0.51, 0.60],
            4: [0.43, 0.53, 0.62],
        },  # Δ vs gdpo .0 .01 .0 / .03 .03 .02
    }
    runs = {}
    for m, by_k in auc.items():
        for k, vals in by_k.items():
            for s, v in enumerate(vals):
                share = flat(0.5, 5) + flat(0.2, 5) if m == "mrtpo" else None
                top = {"first": flat(0.2), "mark": flat(0.3)} if m == "mrtpo" else None
                mark = flat(0.9 if m == "mrtpo" else 0.5)
                runs.setdefault(k, {}).setdefault(m, {})[s] = _run(flat(v), mark, share, top)
    return claims.table(runs, threshold=0.99, few_token=few_token, at_step=5)


def test_claim_1_trend_in_k():
    c = claims.claim_gain_grows(_table())
    # points (2: .01 .02 0), (4: .05 .06 .04): slope (mean 4 - mean 2) / 2 = (.05 - .01) / 2
    tr = c.details["trend_auc"]
    assert tr.slope == pytest.approx(0.02)
    # residuals ±.01, 0 at each K: RSS 4e-4, Sxx 6 * 1 = 6; se sqrt(4e-4 / 4 / 6)
    assert tr.half == pytest.approx(2.7764451051977934 * math.sqrt(4e-4 / 4 / 6))
    assert c.verdict == REPRODUCED
    assert c.details["auc"][2].mean == pytest.approx(0.01)
    assert "slope of MRTPO − GDPO Δ AUC in K +0.0200 [" in c.statistic
    one_k = claims.claim_gain_grows({4: _table()[4]})
    assert one_k.verdict == INCONCLUSIVE and "One K only" in one_k.why


def test_claim_2_few_token_compliance():
    c = claims.claim_few_token(_table(), ["gdpo", "mrtpo"], "mark", 5)
    assert c.details["diff"].mean == pytest.approx(0.4) and c.details["diff"].half < 1e-12
    assert c.verdict == REPRODUCED  # zero spread: the interval is the point itself
    assert "mrtpo 0.90" in c.statistic and "gdpo 0.50" in c.statistic
    assert c.why == ""  # the start (0.5 for gdpo) is not above one half everywhere
    missing = claims.claim_few_token(_table("nothing"), ["gdpo"], "nothing", 5)
    assert missing.verdict == INCONCLUSIVE and "not measured" in missing.statistic


def test_claim_3_ablation_order():
    c = claims.claim_ablation_order(_table())
    # mrtpo - joint: .01 .01 0 / .02 .03 .02 ; joint - gdpo: 0 .01 0 / .03 .03 .02
    a = [0.01, 0.01, 0.0, 0.02, 0.03, 0.02]
    m = sum(a) / 6
    sd = math.sqrt(sum((x - m) ** 2 for x in a) / 5)
    assert f"{m:+.3f} [{m - T975_DF5 * sd / math.sqrt(6):+.3f}" in c.statistic
    assert c.verdict == REPRODUCED
    t = _table()
    for k in t:  # joint worse than gdpo everywhere: order broken
        for s in t[k]["mrtpo_joint"]:
            t[k]["mrtpo_joint"][s]["auc"] = t[k]["gdpo"][s]["auc"] - 0.05 - 0.01 * s
    assert claims.claim_ablation_order(t).verdict == NOT_REPRODUCED


def test_claim_4_beta_without_the_curve():
    c = claims.claim_beta(_table())
    assert c.verdict == REPRODUCED  # β = 0.5 (mrtpo) beats gdpo, pooled .01 .02 0 .05 .06 .04
    assert "β = 0.5: +0.030" in c.statistic and "Only β = 0.5 ran" in c.why


def test_claims_5_and_6_replay_and_concentration():
    t = _table()
    c5 = claims.claim_replay_share(t)
    assert c5.details["drop"].mean == pytest.approx(0.3) and c5.verdict == REPRODUCED
    assert c5.details["overall"].mean == pytest.approx(0.35)
    assert "from 50% to 20%" in c5.statistic and "25% of the step time" in c5.statistic
    c6 = claims.claim_concentration(t, 0.29)
    assert c6.details["overall"].mean == pytest.approx(0.25)
    assert c6.verdict == REPRODUCED  # zero spread at 0.25 <= 0.29
    assert "first 0.20, mark 0.30" in c6.statistic
    assert claims.claim_concentration(t, 0.2).verdict == NOT_REPRODUCED


def test_claim_line():
    c = claims.Claim(9, "A thing", REPRODUCED, "x +0.1 [+0.0, +0.2]", "Because.")
    assert c.line() == "9. **A thing** — **reproduced**: x +0.1 [+0.0, +0.2]. Because."


# ---- the determinism comparison ----------------------------------------------------------------


def test_compare_metrics(tmp_path):
    head = "step,train/success,train/loss,train/time/step\n"
    (tmp_path / "a.csv").write_text(head + "0,0.5,1.0,3.0\n1,0.6,0.9,3.0\n")
    (tmp_path / "b.csv").write_text(head + "0,0.5,1.0,9.0\n1,0.6,0.8,1.0\n")
    d = compare_metrics(tmp_path / "a.csv", tmp_path / "a.csv")
    assert d["max_abs_diff"] == 0.0 and d["steps"] == 2 and d["values"] == 4
    d = compare_metrics(tmp_path / "a.csv", tmp_path / "b.csv")
    assert d["max_abs_diff"] == pytest.approx(0.1) and d["column"] == "train/loss"
    assert d["success_max_abs_diff"] == 0.0  # timing columns are not compared
