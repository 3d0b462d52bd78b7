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
from mrtpo.rollout.server_client import RequestFailed, ServerClient
from mrtpo.rollout.server_process import (
    ServerProcess,
    free_port,
    group_members,
    is_loopback,
)
from mrtpo.rollout.snapshots import write_snapshot
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


def test_a_cpu_server_runs_the_model_in_its_engine_core(monkeypatch, tmp_path):
    """On CPU with one process, the server's engine core runs the model (vLLM's uni executor:
    no worker process polling shared memory beside it on the server's cores); elsewhere vLLM
    keeps its default, and the in-process engine's setting never leaks into the server."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as the in-process engine sets
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    assert VLLMServerEngine(str(tmp_path), device="cpu")._server_env()[key] == "0"
    for kwargs in ({"device": "cuda"}, {"device": "cpu", "tensor_parallel_size": 2}):
        assert key not in VLLMServerEngine(str(tmp_path), **kwargs)._server_env()


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


# ---- what a server answers (issue 47, items 8, 13 and 15): a fake server on 127.0.0.1 ----


class _Answers(http.server.BaseHTTPRequestHandler):
    """Answers each path with what the test put in ``table`` (raw bytes, or a list of them
    taken in turn); records the request bodies."""

    table: dict = {}
    seen: list = []

    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        type(self).seen.append((self.path, json.loads(body) if body else None))
        got = type(self).table.get(self.path.split("?")[0], b'{"error": "no such route"}')
        if isinstance(got, list):
            got = got.pop(0) if len(got) > 1 else got[0]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(got)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def answers():
    """(url, table): a fake server whose answers the test writes into ``table``."""
    _Answers.table, _Answers.seen = {}, []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Answers.table
    server.shutdown()
    server.server_close()


def _reached(url: str, tmp_path, vocab: int = 100) -> VLLMServerEngine:
    """An engine past its start-up checks, talking to ``url``."""
    eng = VLLMServerEngine("m", url=url, weight_dir=str(tmp_path))
    eng.client = ServerClient(url, timeout_s=60)
    eng.logprobs_mode, eng.vocab_size = "processed_logprobs", vocab
    return eng


def _choice(ids, lps=None, index=0, **more) -> dict:
    lps = [-0.5] * len(ids) if lps is None else lps
    content = [{"token_id": t, "logprob": lp} for t, lp in zip(ids, lps)]
    return {"index": index, "token_ids": ids, "logprobs": {"content": content},
            "finish_reason": "length", **more}  # fmt: skip


def _body(*choices) -> bytes:
    return json.dumps({"choices": list(choices)}).encode()


SAMPLING = SamplingConfig(temperature=0.7, max_new_tokens=32)
NAN = b'{"choices": [{"index": 0, "token_ids": [5, 6], "logprobs": {"content": [{"logprob": -1.0}, {"logprob": NaN}]}}]}'


@pytest.mark.parametrize(
    ("body", "words"),
    [
        pytest.param(
            b"<html>busy</html>", "a body that is not JSON ('<html>busy</html>')", id="html"
        ),
        pytest.param(b"[1, 2]", "a JSON list ([1, 2]) where a JSON object belongs", id="list"),
        pytest.param(b"{}", "no field 'choices'", id="no-choices"),
        pytest.param(b'{"choices": [{"index": 0}]}', "sample 0: no field 'token_ids'", id="no-ids"),
        pytest.param(
            _body(_choice([5, 10**9])),
            "token id 1000000000 is outside the policy's vocabulary [0, 100)",
            id="huge-id",
        ),
        pytest.param(_body(_choice([-3])), "token id -3 is outside", id="negative-id"),
        pytest.param(_body(_choice(["7"])), "token id '7' is not an integer", id="text-id"),
        pytest.param(NAN, "log-prob nan at token 1", id="nan"),
        pytest.param(_body(_choice([5], [50.0])), "log-prob 50.0 at token 0", id="positive"),
        pytest.param(_body(_choice([5] * 5000)), "5000 tokens for max_tokens=32", id="too-long"),
        pytest.param(_body(_choice([5, 6], [-1.0])), "1 log-probs for 2 tokens", id="short-lps"),
        pytest.param(_body(_choice([5]), _choice([6], index=1)), "2 samples where n=1", id="n"),
    ],
)
def test_a_bad_generate_answer_stops_the_run_with_one_line_naming_the_server(
    answers, tmp_path, body, words
):
    url, table = answers
    table["/inference/v1/generate"] = body
    eng = _reached(url, tmp_path)
    with pytest.raises(VLLMServerError) as err:
        eng.generate([[1, 2, 3]], 1, SAMPLING, seed=0)
    text = str(err.value)
    assert text.startswith(f"the vLLM server at {url} sent an answer the run cannot use "
                           "during generation: "), text  # fmt: skip
    assert words in text and "\n" not in text, text


def test_a_good_generate_answer_is_taken_in_index_order(answers, tmp_path):
    url, table = answers
    second = _choice([7, 99], [-0.25, 0.0], index=1, finish_reason="stop",
                     weight_versions=[{"start": 0, "end": 2, "version": "3"}])  # fmt: skip
    table["/inference/v1/generate"] = _body(second, _choice([5, 6, 7]))
    eng = _reached(url, tmp_path)
    first, other = eng.generate([[1, 2]], 2, SAMPLING, seed=0)
    assert (first.token_ids, first.logprobs, first.finished) == ([5, 6, 7], [-0.5] * 3, False)
    assert (other.token_ids, other.logprobs, other.finished) == ([7, 99], [-0.25, 0.0], True)
    assert (first.weight_version, other.weight_version) == (0, 3)


def test_start_up_answers_missing_a_field_name_the_server(answers, tmp_path):
    url, table = answers
    info = {"vllm_config": {"weight_transfer_config": {"backend": "mrtpo_file"},
                            "model_config": {"logprobs_mode": "processed_logprobs"}}}  # fmt: skip
    table["/server_info"] = json.dumps(info).encode()
    table["/v1/models"] = b'{"object": "list"}'
    eng = VLLMServerEngine("m", url=url, weight_dir=str(tmp_path))
    with pytest.raises(VLLMServerError) as err:
        eng._check_server(ServerClient(url))
    assert str(err.value) == (
        f"the vLLM server at {url} sent an answer the run cannot use during the start-up "
        "check: no field 'data' (it has ['object'])"
    )


def _top(lps: dict[int, float]) -> bytes:
    """A one-token generate answer whose top log-probs are ``lps``."""
    top = [{"token_id": t, "logprob": lp} for t, lp in lps.items()]
    first = next(iter(lps))
    content = [{"token_id": first, "logprob": lps[first], "top_logprobs": top}]
    return json.dumps({"choices": [{"index": 0, "token_ids": [first],
                                    "logprobs": {"content": content}}]}).encode()  # fmt: skip


def _log_softmax(z: list[float], temperature: float) -> dict[int, float]:
    lp = torch.log_softmax(torch.tensor(z) / temperature, -1)
    return {i: float(lp[i]) for i in range(3)}


Z = [2.0, 1.0, 0.0, -1.0]


def test_a_server_reporting_untempered_logprobs_is_refused_at_start(answers, tmp_path):
    """The probe samples one token at temperature 1 and at 0.5: a server that returns the
    model's own log-probs (raw_logprobs) gives the same gaps between tokens at both."""
    url, table = answers
    table["/inference/v1/generate"] = [_top(_log_softmax(Z, 1.0)), _top(_log_softmax(Z, 1.0))]
    eng = _reached(url, tmp_path)
    eng.logprobs_mode = "raw_logprobs"
    with pytest.raises(VLLMServerError) as err:
        eng._probe_generate(eng.client)
    text = str(err.value)
    assert text.startswith(f"the vLLM server at {url} ") and "\n" not in text
    assert "--logprobs-mode processed_logprobs" in text and "raw_logprobs" in text
    temps = [b["sampling_params"]["temperature"] for p, b in _Answers.seen if "generate" in p]
    assert temps == [1.0, 0.5]


def test_a_server_reporting_tempered_logprobs_passes_the_probe(answers, tmp_path):
    url, table = answers
    table["/inference/v1/generate"] = [_top(_log_softmax(Z, 1.0)), _top(_log_softmax(Z, 0.5))]
    eng = _reached(url, tmp_path)
    eng.logprobs_mode = None  # a release that does not say: the probe alone decides
    eng._probe_generate(eng.client)


def test_a_probe_whose_top_tokens_do_not_overlap_is_a_bad_answer(answers, tmp_path):
    """Tempering keeps the order of tokens, so the two probes share their top tokens; a
    server whose probes share none sent a wrong answer (was a ValueError traceback)."""
    url, table = answers
    table["/inference/v1/generate"] = [_top({1: -0.5, 2: -1.0}), _top({3: -0.5, 4: -1.0})]
    eng = _reached(url, tmp_path)
    with pytest.raises(VLLMServerError) as err:
        eng._probe_generate(eng.client)
    text = str(err.value)
    assert text.startswith(f"the vLLM server at {url} sent an answer the run cannot use "
                           "during the log-prob probe: "), text  # fmt: skip
    assert "no top token in common" in text and "\n" not in text


@pytest.mark.parametrize("value", ['"mrtpo_file"', "[1]", "7"])
def test_a_weight_transfer_config_that_is_not_an_object_names_the_server(answers, tmp_path, value):
    url, table = answers
    table["/server_info"] = f'{{"vllm_config": {{"weight_transfer_config": {value}}}}}'.encode()
    eng = VLLMServerEngine("m", url=url, weight_dir=str(tmp_path))
    with pytest.raises(VLLMServerError) as err:
        eng._check_server(ServerClient(url))
    assert str(err.value).startswith(f"the vLLM server at {url} has weight transfer backend")


# ---- weight snapshot folders (issue 47, item 6) --------------------------------------------


def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(proc.stdout)


def _killed_run_folder(parent, prefix: str, **record):
    """A folder as a run killed with SIGKILL leaves it: its record names a dead process."""
    from mrtpo.rollout import snapshots

    folder = snapshots.make_folder(prefix, parent)
    (folder / "v000003").mkdir()
    (folder / "v000003" / "bucket-00000.safetensors").write_bytes(b"weights")
    rec = {**snapshots.owner(), "pid": _dead_pid(), **record}
    (folder / snapshots.RECORD).write_text(json.dumps(rec))
    return folder


@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
    """The temporary folder (``tempfile.gettempdir()``) moved into tmp_path."""
    import tempfile

    where = tmp_path / "tmp"
    where.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(where))
    return where


def test_the_next_run_removes_only_what_a_killed_run_provably_left(temp_dir, tmp_path):
    from mrtpo.rollout import snapshots

    shared = tmp_path / "weights"  # a url= run's weight_dir
    shared.mkdir()
    dead_root = _killed_run_folder(temp_dir, snapshots.OWN_ROOT)
    dead_pushes = _killed_run_folder(shared, snapshots.PUSHES)
    rebooted = _killed_run_folder(shared, snapshots.PUSHES, pid=os.getpid(), boot="before")
    reused = _killed_run_folder(shared, snapshots.PUSHES, pid=os.getpid(), start="0")
    live = snapshots.make_folder(snapshots.PUSHES, shared)  # this process: a live run
    other_host = _killed_run_folder(shared, snapshots.PUSHES, host="nodeB")  # its pid is not ours
    unrecorded = _killed_run_folder(shared, snapshots.PUSHES)
    (unrecorded / snapshots.RECORD).unlink()
    not_ours = _killed_run_folder(tmp_path, "elsewhere-")  # another name: never looked at
    target = _killed_run_folder(tmp_path, snapshots.PUSHES)  # a link to a dead one
    (shared / "pushes-link").symlink_to(target)
    other_ns = _killed_run_folder(shared, snapshots.PUSHES, pidns=1)  # another container's
    no_ns = _killed_run_folder(shared, snapshots.PUSHES, pidns=None)  # cannot tell: kept
    no_start = _killed_run_folder(shared, snapshots.PUSHES, pid=os.getpid(), start=None)
    kept = {live, other_host, unrecorded, shared / "pushes-link", not_ours, target, other_ns}
    kept |= {no_ns, no_start}
    note = snapshots.leftover_note(shared)
    assert note is not None and note.startswith("4 weight snapshot folder(s) of killed runs")
    gone = set(snapshots.remove_leftovers(shared))
    assert gone == {dead_root, dead_pushes, rebooted, reused}
    assert not any(p.exists() for p in gone)
    assert all(os.path.lexists(p) for p in kept) and (target / "v000003").is_dir()
    assert snapshots.leftover_note(shared) is None


def test_an_engine_removes_its_snapshots_at_close_and_a_killed_runs_at_start(temp_dir, tmp_path):
    from mrtpo.rollout import snapshots

    dead = _killed_run_folder(temp_dir, snapshots.OWN_ROOT)
    eng = VLLMServerEngine("m")  # a started server's engine: a temporary folder of its own
    eng._prepare_weight_folder()  # what start() does first
    assert not dead.exists()
    root = eng._root
    assert root.parent == temp_dir and eng._pushes.parent == root
    eng._write(1, 0, [("w", torch.ones(2))])
    assert (eng._pushes / "v000001" / "bucket-00000.safetensors").is_file()
    eng.close()
    assert not root.exists()
    eng.close()  # a second close is harmless
    shared = tmp_path / "weights"
    shared.mkdir()
    eng = VLLMServerEngine("m", url="http://127.0.0.1:1", weight_dir=str(shared))
    eng._prepare_weight_folder()
    eng.close()
    assert list(shared.iterdir()) == []  # its pushes-* went, the shared folder stays


def test_check_names_a_killed_runs_snapshots(temp_dir, tmp_path):
    from tests.conftest import compose_config

    from mrtpo.rollout import snapshots
    from mrtpo.run.dryrun import check_all

    dead = _killed_run_folder(temp_dir, snapshots.OWN_ROOT)
    found = check_all(compose_config("train.yaml", ["rollout=vllm_server"]))
    [note] = [n for n in found.notes if "snapshot" in n]
    assert str(dead) in note and "removes them at start" in note and dead.is_dir()
    found = check_all(compose_config("train.yaml", ["rollout=hf"]))
    assert not [n for n in found.notes if "snapshot" in n]  # no server engine: not its business
