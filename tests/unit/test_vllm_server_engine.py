"""``rollout=vllm_server`` without a vLLM server: its settings, the process group it starts
and stops, the HTTP failures it names, and the weight snapshots it writes.

The real server is tested in tests/vllm/test_vllm_server.py (``make test-vllm``)."""

from __future__ import annotations

import http.server
import json
import os
import sys
import threading
import time

import pytest
import torch

from mrtpo.rollout.base import SamplingConfig
from mrtpo.rollout.server_client import RequestFailed, ServerClient, write_snapshot
from mrtpo.rollout.server_process import (
    ServerProcess,
    free_port,
    group_members,
    is_loopback,
)
from mrtpo.rollout.vllm_serve import CPUS_ENV, parse_cpus, pin_cpus
from mrtpo.rollout.vllm_server import VLLMServerEngine, VLLMServerError
from mrtpo.safe_files import UnsafePath


def test_a_host_beyond_loopback_needs_an_api_key(monkeypatch):
    monkeypatch.delenv("MRTPO_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match="MRTPO_TEST_KEY") as err:
        VLLMServerEngine("m", host="0.0.0.0", api_key_env="MRTPO_TEST_KEY")
    assert "call methods on its workers" in str(err.value)
    monkeypatch.setenv("MRTPO_TEST_KEY", "s3cret")
    eng = VLLMServerEngine("m", host="0.0.0.0", api_key_env="MRTPO_TEST_KEY")
    assert eng.api_key == "s3cret" and eng.process is None  # nothing starts before bind
    VLLMServerEngine("m", host="127.0.0.1", api_key_env="MRTPO_TEST_KEY")


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"url": "http://10.0.0.2:8000"}, "rollout.engine.weight_dir"),
        ({"url": "http://h:1", "weight_dir": "/tmp", "cpus": [1]}, "rollout.engine.cpus"),
        ({"url": "h:8000", "weight_dir": "/tmp"}, "http://host:port"),
        ({"request_timeout_s": 0}, "rollout.engine.request_timeout_s=0"),
        ({"device": "tpu"}, "rollout.engine.device='tpu'"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(kwargs, words):
    with pytest.raises(ValueError, match=r"rollout\.engine") as err:
        VLLMServerEngine("m", **kwargs)
    assert words in str(err.value)


def test_loopback_and_cpu_lists():
    assert all(map(is_loopback, ["127.0.0.1", "127.1.2.3", "::1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "10.0.0.2", "node7", "::"]))
    assert parse_cpus("1") == [1] and parse_cpus("0-2,5") == [0, 1, 2, 5]


def test_the_configured_cores_replace_an_inherited_openmp_binding(monkeypatch, capsys):
    """rollout.engine.cpus wins over a VLLM_CPU_OMP_THREADS_BIND the trainer passed down (vLLM
    obeys that variable over the affinity), and the replacement is said in the server's log.
    The cores asked are this process's own, so the real affinity call changes nothing."""
    mine = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv(CPUS_ENV, ",".join(map(str, mine)))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "99")
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    pin_cpus()
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, mine))
    assert os.environ["OMP_NUM_THREADS"] == str(len(mine))
    assert "replaces the inherited VLLM_CPU_OMP_THREADS_BIND=99" in capsys.readouterr().err
    assert sorted(os.sched_getaffinity(0)) == mine


def test_sampling_params_set_every_field_that_changes_the_distribution():
    eng = VLLMServerEngine("m", stop_token_ids=[7])
    eng.eos_ids = [2]
    p = eng.sampling_params(SamplingConfig(temperature=0.7, max_new_tokens=5), 3, 11, True)
    assert p == {
        "n": 3,
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "min_tokens": 0,
        "max_tokens": 5,
        "detokenize": False,
        "stop_token_ids": [2, 7],
        "seed": 11,
        "logprobs": 0,
    }
    greedy = eng.sampling_params(SamplingConfig(greedy=True), 1, None, False)
    assert greedy["temperature"] == 0.0 and "seed" not in greedy and "logprobs" not in greedy


GROUP = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(300)\n"
)


def test_stop_ends_the_whole_process_group(tmp_path):
    proc = ServerProcess([sys.executable, "-c", GROUP], dict(os.environ), tmp_path / "log")
    proc.start()
    pid = proc.pid
    deadline = time.monotonic() + 60
    while len(group_members(pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert os.getpgid(pid) == pid and len(group_members(pid)) == 2  # its own group
    proc.stop()
    assert group_members(pid) == [] and not proc.alive()
    proc.stop()  # a second stop is harmless


def test_a_server_ignoring_sigterm_is_killed(tmp_path):
    stubborn = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(300)"
    proc = ServerProcess([sys.executable, "-c", stubborn], dict(os.environ), tmp_path / "log", 1.0)
    proc.start()
    pid = proc.pid
    time.sleep(1.0)  # let it install its handler
    t0 = time.monotonic()
    handle = proc.proc
    proc.stop()
    assert group_members(pid) == [] and time.monotonic() - t0 < 30
    assert handle.returncode == -9


def test_a_log_file_that_is_a_link_is_refused(tmp_path):
    target = tmp_path / "mine.txt"
    target.write_text("keep")
    (tmp_path / "server.log").symlink_to(target)
    proc = ServerProcess([sys.executable, "-c", "pass"], {}, tmp_path / "server.log")
    with pytest.raises(UnsafePath, match="symbolic link"):
        proc.start()
    assert target.read_text() == "keep" and proc.proc is None


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        if self.path == "/slow":
            time.sleep(3)  # the client has gone by then
            return
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        body = {"error": {"message": "Worker failed with error 'no such weight'", "code": 500}}
        self.wfile.write(json.dumps(body).encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def http_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_request_failures_say_how_they_failed(http_server):
    with pytest.raises(RequestFailed) as err:
        ServerClient(f"http://127.0.0.1:{free_port()}").post("/health")
    assert err.value.kind == "unreachable"
    with pytest.raises(RequestFailed) as err:
        ServerClient(http_server).post("/update_weights")
    assert err.value.kind == "refused" and err.value.status == 500
    assert err.value.detail == "Worker failed with error 'no such weight'"
    with pytest.raises(RequestFailed) as err:
        ServerClient(http_server, timeout_s=0.5).post("/slow")
    assert err.value.kind == "timeout"


def test_failures_become_one_line_naming_the_server(http_server):
    eng = VLLMServerEngine("m", url=http_server, weight_dir="/tmp")
    refused = eng._failure("the weight push of version 3", RequestFailed("refused", "bad", 500))
    assert isinstance(refused, VLLMServerError)
    assert str(refused) == (
        f"the vLLM server at {http_server} refused the weight push of version 3 (HTTP 500: bad)"
    )
    gone = eng._failure("generation", RequestFailed("unreachable", "Connection refused"))
    assert "cannot be reached during generation (Connection refused)" in str(gone)
    slow = eng._failure("generation", RequestFailed("timeout", "no answer within 600 s"))
    assert "rollout.engine.request_timeout_s" in str(slow) and "\n" not in str(slow)


def test_a_model_folder_that_does_not_exist_is_refused_before_a_start(tmp_path):
    eng = VLLMServerEngine(str(tmp_path / "no-model"))
    with pytest.raises(ValueError, match=r"rollout\.engine\.model=.*no such folder"):
        eng.start()
    assert eng.process is None and eng._root is not None and not eng._root.exists()


def test_snapshots_hold_the_tied_head_and_refuse_links(tmp_path):
    from safetensors.torch import load_file

    emb = torch.randn(5, 3)
    tensors = [("model.embed_tokens.weight", emb), ("lm_head.weight", emb)]  # tied
    name = write_snapshot(tmp_path, 0, tensors)
    back = load_file(str(tmp_path / name))
    assert set(back) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert torch.equal(back["lm_head.weight"], emb)
    (tmp_path / "bucket-00001.safetensors").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafePath):
        write_snapshot(tmp_path, 1, tensors)
    assert not (tmp_path / "elsewhere").exists()


def test_the_remote_server_command_in_the_docs_matches_the_launcher():
    """docs/scaling.md starts a server by hand: it must have every flag the engine relies on."""
    from tests.conftest import ROOT

    from mrtpo.rollout.vllm_server import launch_command

    text = (ROOT / "docs" / "scaling.md").read_text()
    start = text.index("python -m mrtpo.rollout.vllm_serve --model")
    command = text[start : text.index("```", start)].replace("\\\n", " ")
    for part in launch_command("nodeB", 8000, "/m", [])[3:]:
        if part.startswith("--") or part.startswith("{"):
            assert part in command or f"'{part}'" in command, part
    for env in ("VLLM_SERVER_DEV_MODE=1", "MRTPO_WEIGHT_ROOT=", "VLLM_API_KEY="):
        assert env in text[:start] + command, env
