"""Credit diagnostics in a real run's metrics.csv: the cap's statistics (adv/...), relevance's
concentration and overlap, where the reallocated energy lands, and replay's noise floor."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
from tests.conftest import compose_config

from mrtpo.evaluate import viewer
from mrtpo.lightning.pipeline import build, metrics_csv
from mrtpo.run.settings import ReplayConfig
from mrtpo.step.diagnostics import CreditDiagnostics, profile_cosine, q_ratio_quantiles
from mrtpo.tasks.base import tag_spans, token_segments
from mrtpo.tasks.synthetic import SyntheticTask

# rewards that vary within groups even under the untrained tiny model (the mark and the count
# are often met by chance), so that replay has pairs to score at every step
RUN = (
    "method=mrtpo",
    "method.beta_warmup_steps=0",
    "method.cap=token",
    "task.closing_mark=true",
    "task.min_words=1",
    "task.max_words=3",
    "rl.prompts_per_step=4",
    "rl.group_size=4",
    "rollout.sampling.max_new_tokens=6",
    "replay.noise_floor=2",
    "trainer.max_steps=3",
    "callbacks.relevance_dump.every=1",
)


def _rows(train_cfg, *extra: str) -> list[dict[str, float]]:
    trainer, module, dm = build(train_cfg(*RUN, *extra))
    trainer.fit(module, datamodule=dm)
    with open(metrics_csv(trainer)) as f:
        return [{k: float(v) if v else math.nan for k, v in r.items()} for r in csv.DictReader(f)]


def test_a_short_run_logs_the_diagnostics(train_cfg, tmp_path):
    rows = _rows(train_cfg)
    replayed = [r for r in rows if r.get("train/replay/share", 0) > 0]
    assert replayed, "no step replayed anything: the run cannot show the diagnostics"
    for r in replayed:
        # the cap's statistics
        assert 0 <= r["train/adv/cap_bound_share"] <= 1
        assert r["train/adv/sign_flip_share"] == 0  # cap=token
        assert r["train/adv/credit_change"] >= 0
        # relevance: q / qbar has mean 1 over each pair, so its median is near 1 and its max >= 1
        p50, p99, top = (r[f"train/replay/q_ratio/{k}"] for k in ("p50", "p99", "max"))
        assert 0 <= p50 <= p99 <= top and top >= 1
        # energy shares over the toy's segments add up to 1
        shares = {k: v for k, v in r.items() if k.startswith("train/replay/energy_share/")}
        assert "train/replay/energy_share/answer" in shares
        assert all(0 <= v <= 1 for v in shares.values() if not math.isnan(v))
        assert math.isclose(sum(v for v in shares.values() if not math.isnan(v)), 1, abs_tol=1e-6)
        # two code paths over identical contexts: float32 noise on CPU
        assert 0 <= r["train/replay/noise_floor"] <= r["train/replay/noise_floor/max"] < 1e-3
    # logged where a response had two rewards replayed (the untrained model varies mostly the
    # count, so it may not be); its values are checked by hand below
    cos = [r.get("train/replay/profile_cosine", math.nan) for r in replayed]
    assert all(-1e-9 <= c <= 1 + 1e-9 for c in cos if not math.isnan(c))
    # the relevance dump keeps each response's reallocation and segments for the viewer
    [dump] = tmp_path.rglob("relevance.jsonl")
    records = [json.loads(line) for line in dump.read_text().splitlines()]
    assert records and all("realloc" in r and "answer" in r["segments"] for r in records)
    assert viewer.main([str(dump), "--out", str(tmp_path / "page")]) == 0
    page = (tmp_path / "page" / "relevance.html").read_text()
    assert "reallocated energy: " in page and 'id="summary"' in page and "q/q̄" in page


def test_noise_floor_is_opt_in(train_cfg):
    rows = _rows(train_cfg, "replay.noise_floor=0", "trainer.max_steps=1")
    assert not any("noise_floor" in k for k in rows[0])


def test_a_resume_may_turn_the_noise_floor_on_or_off():
    from mrtpo.run.resume import may_change

    # a diagnostic only: it changes what is logged, not what the run computes
    assert may_change("replay.noise_floor") and not may_change("method.cap")


def test_bad_noise_floor_is_named():
    with pytest.raises(ValueError, match=r"replay\.noise_floor"):
        ReplayConfig.from_mapping({"noise_floor": -1})
    assert compose_config("train.yaml", []).replay.noise_floor == 0


# ---- the parts, on hand-made inputs -----------------------------------------------------------
def test_ratio_quantiles_and_cosine_by_hand():
    q = torch.tensor([[[0.1, 0.3, 0.2, 0.0], [0.2, 0.6, 0.4, 0.0]]])  # one response, K = 2
    mask = torch.tensor([[True, True, True, False]])
    both = torch.tensor([[True, True]])
    m, w = q_ratio_quantiles(q, mask, both)
    assert math.isclose(m["q_ratio/max"], 1.5, rel_tol=1e-6) and w["q_ratio/p50"] == 6
    assert math.isclose(m["q_ratio/p50"], 1.0, rel_tol=1e-6)
    m, w = profile_cosine(q, mask, both)  # the same profile, scaled
    assert math.isclose(m["profile_cosine"], 1.0) and w["profile_cosine"] == 1
    q2 = torch.tensor([[[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]])
    assert profile_cosine(q2, mask, both)[0]["profile_cosine"] == 0.0
    assert profile_cosine(q2, mask, torch.tensor([[True, False]])) == ({}, {})


def test_segments_of_each_task_and_their_tokens():
    toy = SyntheticTask(num_constraints=4, closing_mark=True, free_tokens=3)
    text = "<think> and or to </think> apple river!"
    seg = toy.segments(text)
    assert text[slice(*seg["free"][0])] == "<think> and or to "
    assert text[slice(*seg["close"][0])] == "</think>"
    assert text[slice(*seg["answer"][0])] == " apple river"
    assert text[slice(*seg["mark"][0])] == "!"
    assert toy.segments("<think> and") == {"free": [(0, 11)]}
    plain = SyntheticTask(num_constraints=2)
    assert plain.segments("apple river.") == {"answer": [(0, 12)]}
    sql = "<think>why</think>\n<answer>```sql\nSELECT 1\n```</answer>"
    spans = tag_spans(sql, ("think", "answer"))
    assert sql[slice(*spans["think"][0])] == "<think>why</think>"
    assert sql[slice(*spans["answer"][0])].endswith("</answer>")
    assert tag_spans("<think>open", ("think", "tool_call")) == {"think": [(0, 11)]}
    pieces = ["<think>", " a", "</", "think", ">", " b", ""]  # the last: an end of sequence
    masks = token_segments(pieces, {"close": [(9, 17)], "answer": [(17, 19)]})
    assert masks["close"] == [False, False, True, True, True, False, False]
    assert masks["answer"] == [False] * 5 + [True, False]


def test_energy_shares_by_hand():
    class Tok:  # each id is one character
        def decode(self, ids, skip_special_tokens=True):
            return "".join("ab!"[i] for i in ids)

    diag = CreditDiagnostics(SyntheticTask(num_constraints=2, closing_mark=True), Tok())
    ids = torch.tensor([[0, 1, 2, 0]])
    mask = torch.tensor([[True, True, True, False]])
    realloc = torch.tensor([[1.0, 1.0, 2.0, 5.0]])  # the pad's 5 does not count
    m, w = diag.energy_shares(realloc, ids, mask)
    assert m == {"energy_share/mark": 4 / 6, "energy_share/answer": 2 / 6, "energy_share/other": 0}
    assert w["energy_share/mark"] == 6.0


def test_viewer_diagnostics_of_a_record():
    rec = {
        "step": 1,
        "tokens": ["<think>", " a", "</think>", " b", "!"],
        "q": {"first": [0.0, 0.1, 0.4, 0.0, 0.0], "mark": [0.0, 0.1, 0.4, 0.0, 0.5]},
        "w": {"first": [1.0] * 5, "mark": [1.0] * 5},
        "realloc": [0.0, 1.0, 3.0, 0.0, 2.0],
        "segments": {"free": [0, 1], "close": [2], "answer": [3], "mark": [4]},
    }
    d = viewer.diagnostics([viewer.clean(rec)])
    assert d["q_ratio"]["first"][2] == pytest.approx(4.0)  # 0.4 over a mean of 0.1
    assert d["q_ratio"]["mark"][0] == pytest.approx(0.5)  # median of 0, .5, 2, 0, 2.5
    dot = 0.1 * 0.1 + 0.4 * 0.4
    assert d["cosine"] == pytest.approx(dot / math.sqrt(dot * (dot + 0.25)))
    assert d["energy"] == pytest.approx(
        {"free": 1 / 14, "close": 9 / 14, "answer": 0.0, "mark": 4 / 14, "other": 0.0}
    )
    page = viewer.render_html([viewer.clean(rec)], "t")
    assert "close 64%" in page and "profile cosine" in page
    # an older record without them still draws; a broken one is named
    old = {k: v for k, v in rec.items() if k not in ("realloc", "segments")}
    assert viewer.diagnostics([viewer.clean(old)])["energy"] == {}
    with pytest.raises(ValueError, match="'segments' is not an object"):
        viewer.clean({**rec, "segments": {"free": [9]}})
