"""``make bench``'s schedules section (section 6) at toy size, against a real ``vllm serve``
process: real Lightning runs of GDPO and MRTPO under ``sync`` and ``one_step_off`` share one
started server, the JSON has every run of every workload, the targets are judged from it, and
the document's section 6 renders. Results and models go to a temporary folder."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import harness
from benchmarks.render import render
from benchmarks.schedules import RUNS

BIND_BEFORE = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
PLAN = {
    "schedules": dict(
        size="tiny_wide",
        prompts=2,
        group=2,
        rewards=2,
        system_tokens=64,
        workloads=[dict(name="half", new_tokens=4), dict(name="long", new_tokens=8)],
        steps=1,
        warmup=1,
        rounds=1,
    )
}


@pytest.fixture(scope="module")
def schedules_json(tmp_path_factory, vllm_module):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the section pins the server and the trainer to two cores")
    base = tmp_path_factory.mktemp("bench")
    mp = pytest.MonkeyPatch()
    mp.setenv("MRTPO_BENCH_DIR", str(base / "out"))
    mp.setenv("MRTPO_CACHE_DIR", str(base / "cache"))
    try:
        (path,) = harness.run_sections(["schedules"], PLAN, full=False, threads=1)
        yield json.loads(path.read_text())
    finally:
        mp.undo()


def test_every_run_of_every_workload_is_timed(schedules_json):
    d = schedules_json
    assert d["server_cpu"] != d["trainer_cpu"] and d["commit"]
    # nothing of the section's pinning is left behind for later servers of this process
    assert os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == BIND_BEFORE
    assert len(os.sched_getaffinity(0)) >= 2  # not left on the trainer's one core
    first, second = d["workloads"]
    assert set(first["step_s"]) == {r[0] for r in RUNS} | {"gdpo/sync/in_process"}
    assert set(second["step_s"]) == {r[0] for r in RUNS}
    for w in d["workloads"]:
        assert all(v > 0 for v in w["step_s"].values())
        assert 0 < w["generation_share_gdpo_sync"] < 1.5
        assert w["push"]["mb"] > 0 and w["push"]["s_per_mb"] > 0
    assert [t["target"].split(" (")[0] for t in d["targets"]] == [
        "one_step_off steps/s over sync",
        "MRTPO / GDPO step time under one_step_off",
        "sync step time, server / in-process vLLM",
    ]


def test_section_six_renders_with_its_targets(schedules_json):
    doc = render({"schedules": schedules_json})
    assert "## 6. Rollout schedules" in doc
    assert doc.count("**met**") + doc.count("**missed**") == 3
    assert "ms per MB" in doc
