"""Issue 50, items 2 and 4: what a new user meets in the first hour.

- ``+resume=<run>`` alone continues a run with the overrides its folder holds; a key a resume
  may not change is refused naming the run's value.
- A warm-up of beta longer than the run: one warning at start, and report.py names the run.
- Every refusal before training (a bad ``method.*`` value, a missing data file, a bad model
  path) leaves no run folder; ``method=gdpo method.beta=...`` says GDPO has no beta.
- Prompt token counts are kept between jobs in the project's cache.
- A sweep's folder is named by its swept keys.

The CLI runs are real ``python src/train.py`` processes on the tiny model.
"""

from __future__ import annotations

import csv
import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import ROOT, SMALL_RUN

from mrtpo.evaluate.analysis.report import main as report_main
from mrtpo.lightning.data import PromptDataModule
from mrtpo.run.config_keys import check_overrides
from mrtpo.run.settings import ConfigError
from mrtpo.tasks.synthetic import SyntheticTask

HANG_GUARD_S = 900  # a bound for a machine far slower than this one, not a speed check

RUN = [*SMALL_RUN, "method.beta_warmup_steps=3", "optim.lr=1e-3", "callbacks.export=null"]


def _train(logs: Path, cache_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, str(ROOT / "src" / "train.py"), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S,
    )  # fmt: skip


def _rows(run: Path) -> list[dict[str, str]]:
    with open(run / "csv" / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("train/iteration")]


def _tree(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    """(whole, stopped, logs): a 2-step run, and a 1-step run of the same command; both
    started with the project's plumbing on the command line, as a user would."""
    root = tmp_path_factory.mktemp("first_hour")
    plumbing = [f"paths.cache_dir={cache_dir}"]
    made = {}
    for name, steps in (("whole", 2), ("stopped", 1)):
        logs = root / name
        res = _train(logs, cache_dir, *RUN, *plumbing, f"paths.log_dir={logs}",
                     f"trainer.max_steps={steps}")  # fmt: skip
        assert res.returncode == 0, res.stderr[-3000:]
        (made[name],) = (logs / "train" / "runs").iterdir()
        made[name + "_out"] = res.stdout + res.stderr
    return made


# ---- item 2: resume from the folder alone ---------------------------------------------------


def test_resume_from_the_folder_alone_continues_the_run(runs, cache_dir):
    run = runs["stopped"]
    assert "+resume=" in runs["stopped_out"]
    res = _train(run.parent, cache_dir, f"+resume={run}", "trainer.max_steps=2")
    assert res.returncode == 0, res.stderr[-3000:]
    resumed, whole = _rows(run), _rows(runs["whole"])
    assert [r["step"] for r in resumed] == ["0", "1"]
    for a, b in zip(resumed, whole, strict=True):  # the same run as the uninterrupted one
        for key in ("train/reward/total/mean", "train/beta", "train/loss", "train/adv/mean",
                    "train/approx_kl_old", "train/response_len/mean"):  # fmt: skip
            if b.get(key):
                assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-5, abs=1e-6), key
    # the printed hint is the folder alone, and the resume was recorded with the run's keys
    assert f"python src/train.py +resume={run}" in runs["stopped_out"]
    history = (run / ".hydra" / "history.yaml").read_text()
    assert "method.beta_warmup_steps=3" in history.split("resume: true")[-1]


def test_a_resume_that_changes_another_key_is_refused_naming_the_runs_value(runs, cache_dir):
    run = runs["whole"]
    before = _tree(run)
    res = _train(run.parent, cache_dir, f"+resume={run}", "rl.group_size=4")
    assert res.returncode != 0
    (line,) = [x for x in res.stderr.strip().splitlines() if x.startswith("error:")]
    assert "rl.group_size=4" in line and "has rl.group_size=2" in line, res.stderr
    assert "Traceback" not in res.stderr
    assert _tree(run) == before
    # a key the run left at its default, named with the run's value; a repeated value is
    # accepted; a config group (trainer=ddp) is left to the checkpoint's key-by-key check
    from mrtpo.run.resume import resume_overrides

    with pytest.raises(ConfigError, match="has seed=0"):
        resume_overrides([f"+resume={run}", "seed=3"])
    assert "method=gdpo" in resume_overrides([f"+resume={run}", "method=gdpo"])
    words = resume_overrides([f"+resume={run}", "rl.group_size=2", "trainer.max_steps=5"])
    assert words[-1] == f"+resume={run}" and "trainer.max_steps=5" in words
    assert "trainer.max_steps=2" not in words and "method.beta_warmup_steps=3" in words


# ---- item 4: the warm-up of beta ----------------------------------------------------------


def test_a_warmup_longer_than_the_run_is_said_at_start_and_in_the_report(runs, tmp_path, capsys):
    said = [x for x in runs["whole_out"].splitlines() if "beta_warmup_steps=3 is longer" in x]
    assert len(said) == 1, runs["whole_out"][-3000:]
    assert "trainer.max_steps=2" in said[0]
    assert report_main([str(runs["whole"]), "--no-plots"]) == 0
    text = capsys.readouterr().out
    (note,) = [x for x in text.splitlines() if "beta never reached" in x]
    assert "method.beta=0.5" in note and str(runs["whole"]) in note


# ---- item 4: refusals leave no folder ---------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    ["beta", "data", "model"],
)
def test_each_refusal_before_training_leaves_no_run_folder(case, tmp_path, cache_dir):
    logs = tmp_path / "logs"
    given = {
        "beta": ["method.beta=1.0"],
        "data": ["task=toolcall", f"paths.data_dir={tmp_path / 'no-data'}"],
        "model": [f"model.name_or_path={tmp_path / 'no-model'}", "model.tiny=null"],
    }[case]
    res = _train(logs, cache_dir, *RUN, f"paths.log_dir={logs}", f"paths.cache_dir={cache_dir}",
                 "trainer.max_steps=1", *given)  # fmt: skip
    assert res.returncode != 0
    errors = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, res.stderr[-3000:]
    assert not list(logs.rglob("*")), sorted(map(str, logs.rglob("*")))


def test_gdpo_beta_says_gdpo_has_no_beta(tmp_path, cache_dir):
    res = _train(tmp_path / "logs", cache_dir, "method=gdpo", "method.beta=0.5")
    assert res.returncode != 0
    assert res.stderr.strip().startswith("error: method.beta=0.5: method=gdpo has no beta")
    assert "+method.beta" not in res.stderr and not (tmp_path / "logs").exists()
    check_overrides(["method=mrtpo_joint", "method.beta=0.3"])  # a method built on mrtpo's
    with pytest.raises(ConfigError, match="method=gdpo has no nope"):
        check_overrides(["method=gdpo", "method.nope=1"])


# ---- item 4: prompt token counts kept between jobs ---------------------------------------


def test_prompt_token_counts_come_from_the_cache_in_a_second_job(runs, tiny, tmp_path, caplog):
    _, tok = tiny
    cache = tmp_path / "cache"
    first = PromptDataModule(SyntheticTask(num_train=12), tokenizer=tok, cache_dir=cache)
    first.setup()
    assert first.tokenized == 12
    (stored,) = (cache / "prompt_lengths").iterdir()
    second = PromptDataModule(SyntheticTask(num_train=12), tokenizer=tok, cache_dir=cache)
    with caplog.at_level(logging.INFO, logger="mrtpo"):
        second.setup()
    assert (
        second.tokenized == 0
        and "12 of 12 train prompts' token counts from the cache" in caplog.text
    )
    assert [e.id for e in second.train_examples] == [e.id for e in first.train_examples]
    assert second.prompt_lengths(second.train_examples) == [
        len(
            tok(
                tok.apply_chat_template(e.messages, add_generation_prompt=True, tokenize=False),
                add_special_tokens=False,
            )["input_ids"]
        )
        for e in second.train_examples
    ]
    # another template is another tokenizer identity: counted again, in a file of its own
    other = PromptDataModule(SyntheticTask(num_train=12), tokenizer=tok, cache_dir=cache)
    saved = tok.chat_template
    try:
        tok.chat_template = (saved or "") + "{{ '' }}"
        other.setup()
    finally:
        tok.chat_template = saved
    assert other.tokenized == 12 and len(list((cache / "prompt_lengths").iterdir())) == 2
    assert stored.is_file()
    # with progress, chunk by chunk
    caplog.clear()
    fresh = PromptDataModule(SyntheticTask(num_train=5), tokenizer=tok, cache_dir=tmp_path / "c2")
    with caplog.at_level(logging.INFO, logger="mrtpo"):
        fresh.prompt_lengths(list(fresh.task.examples("train")), chunk=2)
    assert "counting prompts' tokens: 2/5" in caplog.text and "5/5" in caplog.text
    # the real jobs: the second took the first's counts (same data, same tokenizer)
    log = (runs["stopped"] / "train.log").read_text()
    assert "train prompts' token counts from the cache" in log


# ---- item 4: sweep folders named by what they hold ---------------------------------------


def test_a_sweep_folder_is_named_by_its_swept_keys(tmp_path, cache_dir):
    from mrtpo.run.config import sweep_dir, swept_keys

    given = ["method=gdpo,mrtpo", "seed=range(1,3)", "rl.group_size=2", "'task.rewards=[a,b]'"]
    assert swept_keys(given) == ["method", "seed"]
    base = str(tmp_path / "multiruns" / "2026-01-01_00-00-00")
    assert sweep_dir(base, given) == base + "_method-seed"
    assert sweep_dir(base, ["method=gdpo", "seed=1"]) == base + "_method-seed"  # each job's
    logs = tmp_path / "logs"
    same = [o for o in RUN if not o.startswith("method.")]  # GDPO and GRPO have no beta
    res = _train(logs, cache_dir, "-m", *same, f"paths.log_dir={logs}",
                 f"paths.cache_dir={cache_dir}", "trainer.max_steps=1",
                 "method=gdpo,grpo")  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    (sweep,) = (logs / "train" / "multiruns").iterdir()
    assert sweep.name.endswith("_method"), sweep.name
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert len(jobs) == 2 and "method=gdpo" in jobs[0] and "method=grpo" in jobs[1]
