"""Issue 47 against real ``vllm serve`` processes: a server given by URL that reports untempered
log-probs is refused at start (item 13), and weight snapshots do not outlive their run: a run
leaves none, and what a trainer killed with SIGKILL left is removed by the next run (item 6).

Each test starts its own server (45-150 s here)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from tests.conftest import ROOT
from tests.vllm.test_vllm_server import RUN_LIMIT_S, SERVER_CPU, _env, _train_cmd

from mrtpo.core.models import eos_token_ids
from mrtpo.rollout import snapshots
from mrtpo.rollout.server_process import ServerProcess, free_port, group_members
from mrtpo.rollout.vllm_server import VLLMServerEngine, VLLMServerError, launch_command


def test_a_server_by_url_without_processed_logprobs_is_refused_at_start(tiny32, tmp_path):
    """vLLM's default mode reports the model's own log-probs: a run at temperature 0.7 would
    find no usable log-probs at its first stale batch. The start-up probe refuses it."""
    path, model, tok = tiny32
    starter = VLLMServerEngine(str(path), cpus=[SERVER_CPU])  # its arguments and environment
    starter._policy = model
    starter._prepare_weight_folder()
    port = free_port()
    cmd = launch_command("127.0.0.1", port, str(path), starter.server_arguments())
    at = cmd.index("--logprobs-mode")
    del cmd[at : at + 2]
    env = starter._server_env()
    env.pop("VLLM_API_KEY", None)
    proc = ServerProcess(cmd, env, tmp_path / "raw.log")
    proc.start()
    try:
        url = f"http://127.0.0.1:{port}"
        eng = VLLMServerEngine(str(path), url=url, weight_dir=str(starter._root))
        with pytest.raises(VLLMServerError) as err:
            eng.bind(model, tok, eos_token_ids(tok, model))
        text = str(err.value)
        assert text.startswith(f"the vLLM server at {url} reports the model's own log-probs")
        assert "'raw_logprobs'" in text and "--logprobs-mode processed_logprobs" in text
        assert "\n" not in text and eng.weight_version == 0  # nothing was pushed
    finally:
        proc.stop()
        starter.close()


KEEP_A_SERVER = """
import sys, time
from mrtpo.core.models import eos_token_ids, load_policy
from mrtpo.rollout.vllm_server import VLLMServerEngine
model, tok = load_policy(sys.argv[1], tiny=None)
eng = VLLMServerEngine(sys.argv[1], cpus=[int(sys.argv[2])], log_file=sys.argv[3])
eng.bind(model, tok, eos_token_ids(tok, model))  # pushes version 1
print(eng._root, eng.process.pid, flush=True)
time.sleep(3600)
"""


def test_a_killed_runs_snapshots_are_removed_by_the_next_run_which_leaves_none(
    tiny32, tmp_path, cache_dir, monkeypatch
):
    path, _, _ = tiny32
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**_env(), "TMPDIR": str(temp)}
    cmd = [sys.executable, "-c", KEEP_A_SERVER, str(path), str(SERVER_CPU), str(tmp_path / "log")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        root, pid = proc.stdout.readline().split()
        proc.kill()  # SIGKILL: no atexit, no finally, no teardown
        proc.wait(timeout=60)
        deadline = time.monotonic() + 120
        while group_members(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
    [pushes] = [p for p in os.scandir(root) if p.name.startswith(snapshots.PUSHES)]
    assert os.path.isdir(os.path.join(pushes.path, "v000001"))  # what SIGKILL leaves
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    assert snapshots.leftovers() == [snapshots.Path(root)]
    run = _train_cmd(tmp_path, cache_dir, "trainer.max_steps=2")
    done = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=RUN_LIMIT_S)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert not os.path.exists(root)  # removed by the next run, at its start
    assert not [p for p in temp.iterdir() if p.name.startswith(snapshots.OWN_ROOT)]  # its own went


def test_a_run_stopped_by_sigterm_leaves_no_snapshots(tmp_path, cache_dir):
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**_env(), "TMPDIR": str(temp)}
    cmd = _train_cmd(tmp_path, cache_dir, "trainer.max_steps=100000")
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    log = tmp_path / "run" / "vllm_server.log"
    try:
        deadline = time.monotonic() + RUN_LIMIT_S
        while not (log.is_file() and log.read_text(errors="replace").count("/update_weights") >= 2):
            assert proc.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
            assert time.monotonic() < deadline, "no weight push of a step"
            time.sleep(1.0)
        assert [p for p in temp.iterdir() if p.name.startswith(snapshots.OWN_ROOT)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=600) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not [p for p in temp.iterdir() if p.name.startswith(snapshots.OWN_ROOT)]
