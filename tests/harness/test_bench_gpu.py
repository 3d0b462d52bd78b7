"""The GPU runner's ``--dry-run``: every stage at toy size on the CPU, run the way a bare GPU
machine runs it (``PYTHONPATH=src``, no Hydra, no OmegaConf, no vLLM, no datasets), so the
runner cannot rot between the rare occasions a GPU is at hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks import gpu

ROOT = Path(__file__).resolve().parents[2]
# Packages the bare GPU machine does not have: importing any of them fails in the dry run,
# in the runner and in its worker processes. (Packages that transformers or lightning probe
# by their installed metadata, such as SciPy, cannot be hidden this way: those libraries
# would see them installed and then fail to import them, which a real absence never does.)
ABSENT = ("hydra", "omegaconf", "antlr4", "vllm", "datasets", "trl")


@pytest.mark.harness
def test_dry_run_on_a_bare_machine(tmp_path):
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(
        f"import sys\nfor m in {ABSENT!r}:\n    sys.modules[m] = None\n"
    )
    out = tmp_path / "report"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(block), str(ROOT / "src")]),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,  # a hang guard, sized for a machine 10x slower than a quiet one
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / gpu.REPORT_NAME).read_text())
    assert data["dry_run"] and data["status"] == "ok"
    assert list(data["stages"]) == list(gpu.STAGES)
    assert all(s["status"] == "ok" for s in data["stages"].values()), data["stages"]
    # vLLM was unimportable there (whether or not it is installed here)
    assert data["vllm"] == {"status": "not installed"}
    st = data["steps"]
    assert st["headline"]["share"] == pytest.approx(0.25)  # 2 of 8 (prompt, reward) cells
    assert st["headline"]["ratio_train_median_paired"] > 0
    assert st["headline"]["replay_over_floor"] > 0
    assert {r["variant"] for r in st["records"]} == {"mrtpo", "gdpo"}
    nu = data["numerics"]
    assert nu["shared_prefix_batches"] >= 1  # the shared path was taken
    assert nu["shared_vs_plain_fp32"]["max_abs"] < 1e-5
    assert 0 < nu["bf16_vs_fp32"]["max_abs"] < 0.05 and nu["bf16_vs_fp32"]["spearman"] > 0.5
    assert set(data["jsd_memory"]["flat"]) >= {"chunked", "replay"}
    assert data["generation"]["tokens"] == 2 * 2 * 4
    summary = (out / gpu.SUMMARY_NAME).read_text()
    assert summary.startswith("# GPU check (dry run")
    assert "| steps | ok |" in summary and "**vLLM**: not installed." in summary


def test_missing_feature_skips_its_stage(tmp_path, monkeypatch):
    monkeypatch.setitem(gpu.NEEDS, "jsd_memory", [("torch.imaginary_feature", lambda s: False)])
    data = gpu.run(tmp_path, dry_run=True, stages=("environment", "jsd_memory"), vllm="off")
    rec = data["stages"]["jsd_memory"]
    assert rec["status"] == "skipped" and "torch.imaginary_feature" in rec["reason"]
    assert data["status"] == "ok"  # a skip is not a failure
    assert "| jsd_memory | skipped |" in (tmp_path / gpu.SUMMARY_NAME).read_text()


@pytest.mark.harness
def test_numerics_without_the_steps_stage_builds_its_own_pairs(tmp_path, monkeypatch):
    # with no steps stage before it (or a failed one), numerics builds the rollout itself; it
    # set the pairs on the frozen ScoredBatch and failed with FrozenInstanceError
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    data = gpu.run(tmp_path / "out", dry_run=True, stages=("numerics",), vllm="off")
    assert not list(scratch.glob("mrtpo-gpu-*"))  # its scratch folder went with it (it stayed)
    assert "steps" not in data["stages"]
    assert data["stages"]["numerics"]["status"] == "ok", data["stages"]["numerics"]
    assert data["numerics"]["pairs"] > 0 and data["numerics"]["bf16_vs_fp32"]["tokens"] > 0


def test_failing_stage_does_not_stop_the_others(tmp_path, monkeypatch):
    def boom(sizes):
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(gpu, "stage_environment", boom)
    # the vLLM stage runs after it and is cheap: "not installed", or installed but not run
    data = gpu.run(tmp_path, dry_run=True, stages=("environment", "vllm"), vllm="auto")
    assert data["stages"]["environment"]["status"] == "failed"
    assert "simulated failure" in data["stages"]["environment"]["error"]
    assert data["stages"]["vllm"]["status"] == "ok" and data["vllm"]["status"] != "no report"
    assert data["status"] == "failed"
    with pytest.raises(ValueError, match="unknown stage"):
        gpu.run(tmp_path, dry_run=True, stages=("nope",))


@pytest.mark.parametrize("name", ["mrtpo", "gdpo"])
def test_runner_methods_equal_what_hydra_composes(name):
    """The runner builds methods from their classes' defaults (no Hydra on its machine); they
    must be the ones ``method=<name>`` gives ``src/train.py`` (β schedule off in both, as the
    bench times a step): a config default that drifts from its class fails here."""
    from benchmarks.common import build_method

    built, composed = gpu.gpu_method(name), build_method(name)
    assert type(built) is type(composed)
    assert vars(built) == vars(composed)


def test_spearman_and_compare_q():
    import torch

    a = torch.tensor([0.1, 0.4, 0.2, 0.9])
    assert gpu.spearman(a, a * 2 + 1) == pytest.approx(1.0)
    assert gpu.spearman(a, -a) == pytest.approx(-1.0)
    q1 = torch.zeros(2, 1, 3)
    q1[0, 0] = torch.tensor([0.1, 0.2, 0.3])
    q2 = q1.clone()
    q2[0, 0, 2] = 0.5
    q2[1, 0, 0] = 9.0  # not replayed: ignored
    replayed = torch.tensor([[True], [False]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    c = gpu.compare_q(q1, q2, replayed, mask)
    assert c["tokens"] == 3 and c["max_abs"] == pytest.approx(0.2)
