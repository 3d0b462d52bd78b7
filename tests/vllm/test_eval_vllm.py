"""``src/eval.py ... rollout=vllm``: evaluation generates with the real engine, and its greedy
answers are the HF engine's (both fp32 on the same weights).

The engine the eval config builds is the session's (one in-process vLLM engine per process:
a second one started beside it leaves the first unusable), with the config's settings checked
first."""

from __future__ import annotations

import json

from tests.conftest import compose_config
from tests.vllm.conftest import TINY_OVERRIDES

from mrtpo.evaluate import job


def _eval(tmp_path, cache_dir, rollout: str, engine=None, monkeypatch=None):
    out = tmp_path / rollout
    cfg = compose_config(
        "eval.yaml",
        [
            f"paths.output_dir={tmp_path}",
            f"paths.cache_dir={cache_dir}",
            *TINY_OVERRIDES,
            f"rollout={rollout}",
            "eval.limit=4",
            "eval.max_new_tokens=8",
            f"eval.output={out}",
        ],
    )
    shared_used = []
    if engine is not None:
        # Patched where the job looks it up: a second in-process engine would leave the
        # session's unusable for every later test (vLLM's parallel state is per process).
        build = job.instantiate

        def shared(node, *args, **kwargs):
            if node.get("_target_") == "mrtpo.rollout.vllm.VLLMEngine":
                assert node.model == str(engine.model) and node.device == "auto"
                shared_used.append(node)
                return engine
            return build(node, *args, **kwargs)

        monkeypatch.setattr(job, "instantiate", shared)
    metrics = job.run(cfg)
    if monkeypatch is not None:
        monkeypatch.undo()
    assert bool(shared_used) == (engine is not None), "the eval job built its own vLLM engine"
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return metrics, rows


def test_eval_with_vllm_matches_hf_greedy(tmp_path, cache_dir, engine, monkeypatch):
    m_vllm, rows_vllm = _eval(tmp_path, cache_dir, "vllm", engine, monkeypatch)
    _, rows_hf = _eval(tmp_path, cache_dir, "hf")
    assert m_vllm["n_responses"] == 4.0
    assert [r["id"] for r in rows_vllm] == [r["id"] for r in rows_hf]
    assert [r["response"] for r in rows_vllm] == [r["response"] for r in rows_hf]
    assert any(r["response"] for r in rows_vllm)
