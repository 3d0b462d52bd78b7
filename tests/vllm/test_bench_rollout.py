"""``make bench``'s rollout section (vLLM against HF ``generate``) at toy size, against the real
vLLM: it runs through the harness's own functions, writes the JSON the renderer reads, and the
document's section 5 renders from it. Results and models go to a temporary folder."""

from __future__ import annotations

import json

import pytest

from benchmarks import harness
from benchmarks.render import render

PLAN = {
    "rollout": [
        dict(
            size="tiny_wide",
            prompts=2,
            groups=[2, 3],
            new_tokens=8,
            shapes={"short": {"length": 8, "shared": 0}, "long": {"length": 96, "shared": 80}},
            rounds=2,
        )
    ]
}


@pytest.fixture(scope="module")
def rollout_json(tmp_path_factory, vllm_module):
    base = tmp_path_factory.mktemp("bench")
    mp = pytest.MonkeyPatch()
    mp.setenv("MRTPO_BENCH_DIR", str(base / "out"))
    mp.setenv("MRTPO_CACHE_DIR", str(base / "cache"))
    try:
        (path,) = harness.run_sections(["rollout"], PLAN, full=False, threads=1)
        assert path == base / "out" / "rollout.json"
        yield json.loads(path.read_text())
    finally:
        mp.undo()


def test_every_case_is_timed_on_both_engines(rollout_json):
    (res,) = rollout_json["cases"]
    assert res["size"] == "tiny_wide" and rollout_json["commit"]
    cases = {(c["shape"], c["group"]): c for c in res["cases"]}
    assert set(cases) == {("short", 2), ("short", 3), ("long", 2), ("long", 3)}
    for (shape, _), c in cases.items():
        engines = {"hf", "vllm"} | ({"vllm_no_prefix"} if shape == "long" else set())
        assert set(c["rounds"]) == engines
        assert all(len(v) == 2 and min(v) > 0 for v in c["rounds"].values())
        assert c["ratio_vllm_over_hf"] > 0
        assert ("ratio_prefix_cache" in c) == (shape == "long")


def test_sync_is_timed_per_megabyte_of_parameters(rollout_json):
    (res,) = rollout_json["cases"]
    s = res["sync"]
    # one push before every vLLM round: 4 cases x 2 rounds, plus the long cases' second engine
    assert s["count"] == 4 * 2 + 2 * 2
    # fp32 weights; a tied LM head may travel as its own tensor too
    assert res["parameters"] * 4 / 2**20 * 0.99 <= s["mb"] <= res["parameters"] * 8 / 2**20
    # every push moves the same megabytes: the median per MB is the median time over them
    assert s["mode"] == "reload_weights" and s["seconds"] > 0
    assert s["s_per_mb"] == pytest.approx(s["seconds"] / s["mb"], rel=1e-9)


def test_the_document_renders_the_section(rollout_json):
    doc = render({"rollout": rollout_json})
    assert "## 5. Rollout engines: vLLM against HF `generate`" in doc
    section = doc.split("## 5.")[1]
    rows = [line for line in section.splitlines() if line.startswith("| `tiny_wide`")]
    assert len(rows) == 4
    assert "ms per MB" in section and rollout_json["commit"] in doc
