"""The GPU tier (marker ``gpu``; never in CI, not in ``make test``): the runner's stages at
their real sizes on one CUDA GPU, with the acceptance thresholds the report is read against.

    PYTHONPATH=src python -m pytest -q -m gpu tests/gpu

The report these tests produce lands in a temporary folder; ``scripts/gpu_check.py`` is the
one command that writes ``docs/gpu/``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from benchmarks import gpu  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    return gpu.run(out, stages=gpu.STAGES, vllm="auto")


def _ok(report, stage):
    rec = report["stages"][stage]
    if rec["status"] == "skipped":
        pytest.skip(f"{stage}: {rec['reason']}")
    assert rec["status"] == "ok", rec.get("traceback") or rec


def test_environment(report):
    _ok(report, "environment")
    env = report["environment"]
    assert env["gpu"] and env["memory_free_gib"] > 8


def test_model_has_the_real_vocabulary(report):
    _ok(report, "model")
    m = report["model"]
    assert m["config"]["vocab_size"] == 151936 and m["dtype"] == "torch.bfloat16"
    assert 4.5e8 < m["parameters"] < 5.5e8


def test_mrtpo_step_against_gdpo(report):
    _ok(report, "steps")
    h = report["steps"]["headline"]
    assert 0.10 <= h["share"] <= 0.20
    # replay at ~15% share must not double the step; it is a few no-grad forwards
    assert h["ratio_train_median_paired"] < 2.0
    assert h["replay_over_floor"] < 3.0
    assert h["peak_gib_mrtpo"] < 1.5 * h["peak_gib_gdpo"] + 2


def test_replay_numerics(report):
    _ok(report, "numerics")
    nu = report["numerics"]
    assert nu["shared_prefix_batches"] >= 1
    assert nu["shared_vs_plain_fp32"]["max_abs"] < 1e-3
    assert nu["bf16_vs_fp32"]["spearman"] > 0.9


def test_jsd_memory_is_flat_in_T(report):
    _ok(report, "jsd_memory")
    flat = report["jsd_memory"]["flat"]
    for impl in ("chunked", "replay"):
        assert flat[impl]["growth"] < 1.5, flat[impl]


def test_generation(report):
    _ok(report, "generation")
    assert report["generation"]["tokens_per_s"] > 0


def test_vllm_when_installed(report):
    if report.get("vllm", {}).get("status") == "not installed":
        pytest.skip("vLLM is not installed")
    _ok(report, "vllm")
    assert report["vllm"]["agreement"]["pass"]
