"""The replication's warm-start jobs: which policy each pass starts from, and in what order."""

from __future__ import annotations

import importlib.util
import io
import json
import threading
from pathlib import Path

import pytest
from hydra.utils import instantiate

from mrtpo.core.credit import CoRT
from mrtpo.run.config import compose
from replication import harness as rep
from replication.jobs import recorded_csv, run_all

ROOT = Path(__file__).resolve().parents[2]


def _start(job) -> str | None:
    names = [o.split("=", 1)[1] for o in job.overrides if o.startswith("model.name_or_path=")]
    return names[0] if names else None


def test_curriculum_k_starts_its_clean_pass_from_the_other_k(tmp_path):
    opts = rep.Options(k_values=[2, 4, 8], logdir=tmp_path)
    for k in (2, 4):  # from random weights: the toy model's builder, no name_or_path override
        assert _start(rep.sft_job(k, "sft", opts)) is None
    (child, parent) = next(iter(rep.CURRICULUM.items()))
    job = rep.sft_job(child, "sft", opts)
    assert Path(_start(job)) == tmp_path / f"k{parent}" / "sft" / "policy"
    assert "model.tiny=null" in job.overrides
    # the noisy pass of every K starts from that K's own clean pass
    for k in (2, 4, 8):
        noisy = rep.sft_job(k, "sft_noisy", opts)
        assert Path(_start(noisy)) == tmp_path / f"k{k}" / "sft" / "policy"


def test_waves_run_a_parent_before_its_child_and_noisy_passes_last(monkeypatch):
    monkeypatch.setattr(rep, "CURRICULUM", {6: 4, 8: 6})
    assert rep.sft_waves([2, 4, 6]) == [
        [(2, "sft"), (4, "sft")],
        [(6, "sft")],
        [(2, "sft_noisy"), (4, "sft_noisy"), (6, "sft_noisy")],
    ]
    # a parent that is not compared still gets its clean pass (and no noisy one)
    assert rep.sft_waves([8]) == [[(4, "sft")], [(6, "sft")], [(8, "sft")], [(8, "sft_noisy")]]
    monkeypatch.setattr(rep, "CURRICULUM", {})
    assert rep.sft_waves([2, 4]) == [[(2, "sft"), (4, "sft")], [(2, "sft_noisy"), (4, "sft_noisy")]]


@pytest.mark.parametrize("k", sorted(rep.CURRICULUM))
def test_every_curriculum_k_is_a_full_mode_k_or_its_parent(k):
    assert k in rep.FULL_K and rep.CURRICULUM[k] in rep.FULL_K


def test_toy_replication_composes_a_cort_row(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location("replicate", ROOT / "scripts" / "replicate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    opts = script.parse_args(["--methods=gdpo,mrtpo,cort", "--seeds=1", f"--logdir={tmp_path}"])
    assert opts.methods == ["gdpo", "mrtpo", "cort"]
    for steps, warmup in ((None, 5), (20, 2)):  # the preset's 50 steps, or --steps
        job = rep.rl_job(
            4, "cort", 0, rep.Options(methods=opts.methods, logdir=tmp_path, steps=steps)
        )
        cfg = compose("train.yaml", job.overrides)
        method, task = instantiate(cfg.method), instantiate(cfg.task)
        assert isinstance(method, CoRT) and method.beta_warmup_steps == warmup
        method.setup(task)
        assert job.steps == (steps or 50) and cfg.trainer.max_steps == job.steps
    # other methods are composed as before
    gdpo = compose("train.yaml", rep.rl_job(4, "gdpo", 0, rep.Options(logdir=tmp_path)).overrides)
    assert "beta_warmup_steps" not in gdpo.method
    explicit = rep.Options(logdir=tmp_path, override=["method.beta_warmup_steps=7"])
    cort = compose("train.yaml", rep.rl_job(4, "cort", 0, explicit).overrides)
    assert cort.method["beta_warmup_steps"] == 7


def test_a_moved_run_folder_still_finds_its_metrics(tmp_path):
    """job.json holds the metrics file's absolute path: a copied or moved run folder (the
    report read from elsewhere) finds it below the job's own folder."""
    run = tmp_path / "moved" / "k4_f60" / "gdpo" / "s0"
    (run / "csv").mkdir(parents=True)
    (run / "csv" / "metrics.csv").write_text("step\n")
    gone = tmp_path / "original" / "k4_f60" / "gdpo" / "s0" / "csv" / "metrics.csv"
    assert recorded_csv(gone, run) == run / "csv" / "metrics.csv"
    assert recorded_csv(run / "csv" / "metrics.csv", tmp_path) == run / "csv" / "metrics.csv"
    assert recorded_csv(tmp_path / "nowhere.csv", run) == tmp_path / "nowhere.csv"  # left as is


def _replicate_script():
    spec = importlib.util.spec_from_file_location("replicate", ROOT / "scripts" / "replicate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_full_mode_adds_one_step_off_runs_of_gdpo_and_mrtpo_at_k4(tmp_path):
    """Issue 39's learning check: in the full mode only, GDPO and MRTPO again at K = 4 under
    one_step_off, 8 seeds, each job its sync twin's but for the schedule and its folder."""
    script = _replicate_script()
    quick = script.parse_args([f"--logdir={tmp_path}"])
    assert quick.methods == list(rep.METHODS)
    assert not any("one_step_off" in j.key for j in rep.rl_jobs(quick))
    assert len(rep.rl_jobs(quick)) == len(rep.QUICK_K) * rep.QUICK_SEEDS * len(rep.METHODS)

    full = script.parse_args(["--full", f"--logdir={tmp_path}"])
    assert full.methods[-2:] == ["gdpo@one_step_off", "mrtpo@one_step_off"]
    jobs = {j.key: j for j in rep.rl_jobs(full)}
    variants = sorted(k for k in jobs if "one_step_off" in k)
    assert variants == sorted(
        f"k4/{m}@one_step_off/s{s}" for m in ("gdpo", "mrtpo") for s in range(rep.FULL_SEEDS)
    )
    schedule = {"rollout.schedule=one_step_off", "rollout.engine.own_copy=true"}
    for key in variants:
        job, twin = jobs[key], jobs[key.replace("@one_step_off", "")]
        method, seed = key.split("/")[1].split("@")[0], key.split("/")[2]
        assert job.out == tmp_path / "k4" / f"{method}_one_step_off" / seed != twin.out
        assert set(job.overrides) - set(twin.overrides) == schedule | {
            f"paths.output_dir={job.out}"
        }
        assert set(twin.overrides) - set(job.overrides) == {f"paths.output_dir={twin.out}"}
        assert job.steps == twin.steps
    cfg = compose("train.yaml", jobs["k4/mrtpo@one_step_off/s3"].overrides)
    assert cfg.rollout.schedule == "one_step_off" and cfg.rollout.engine.own_copy is True
    assert cfg.seed == 3 and cfg.method.beta_warmup_steps == rep.MRTPO_WARMUP_STEPS
    assert cfg.model.name_or_path == str(rep.warm_start(4, tmp_path))


def test_a_schedule_variant_is_resumed_from_its_own_record_only(tmp_path):
    """The skip-when-done logic reads ``job.json`` in the job's own folder: a finished sync
    run does not stand in for its one_step_off twin, nor the other way round."""
    opts = rep.Options(methods=["mrtpo", "mrtpo@one_step_off"], seeds=1, logdir=tmp_path)
    sync, stale = rep.rl_jobs(opts)
    assert (sync.key, stale.key) == ("k4/mrtpo/s0", "k4/mrtpo@one_step_off/s0")
    for job in (sync, stale):
        job.out.mkdir(parents=True)
        (job.out / "job.json").write_text(json.dumps({"key": job.key, "csv": "x", "error": None}))
    done = run_all([sync, stale], 1, 1, None, "RL")  # both finished: nothing runs
    assert {k: v["key"] for k, v in done.items()} == {sync.key: sync.key, stale.key: stale.key}


def test_a_job_waits_for_the_jobs_it_starts_from_and_is_not_run_when_one_failed(tmp_path):
    """A job whose ``after`` job failed is reported as not run and leaves no record, so a rerun
    tries it; the failed job itself leaves its error (a real worker composing a bad config)."""
    from rich.console import Console

    from replication.jobs import Job

    bad = Job("a/sft", ["experiment=no_such_experiment"], tmp_path / "a", 1)
    child = Job("a/rl", ["experiment=toy_long"], tmp_path / "b", 1, after=("a/sft",))
    grandchild = Job("a/rl2", ["experiment=toy_long"], tmp_path / "c", 1, after=("a/rl",))
    out: dict = {}
    console = Console(file=io.StringIO())
    worker = threading.Thread(
        target=lambda: out.update(run_all([grandchild, child, bad], 2, 1, console, "t")),
        daemon=True,
    )
    worker.start()
    worker.join(600)  # a hang guard (about 5 s here): a scheduler stuck in its loop fails here
    assert not worker.is_alive(), "run_all did not return"
    res = out
    assert res["a/sft"]["error"] and (bad.out / "job.json").exists()
    assert res["a/rl"]["error"] == "not run: a/sft failed"
    assert res["a/rl2"]["error"] == "not run: a/rl failed"
    assert not (child.out / "job.json").exists() and not (grandchild.out / "job.json").exists()
    with pytest.raises(ValueError, match="not given to run_all: x"):
        run_all([Job("y", [], tmp_path / "y", 1, after=("x",))], 1, 1, None, "t")
    loop = [
        Job("p", [], tmp_path / "p", 1, after=("q",)),
        Job("q", [], tmp_path / "q", 1, after=("p",)),
    ]
    with pytest.raises(ValueError, match="wait for each other: p, q"):
        run_all(loop, 1, 1, None, "t")
