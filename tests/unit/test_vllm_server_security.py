"""A started vLLM server answers to its run alone (issue 47, items 1-3), without vLLM.

The impostor here is a real HTTP server on 127.0.0.1 that answers 200 to everything: what a
local process that bound the run's port first would be. The run's "server" is a real child
process that never listens (a vLLM start takes a minute; what is tested is what the run
trusts). The real server's key, proof and routes are tested in tests/vllm/test_vllm_server.py.
"""

from __future__ import annotations

import http.server
import logging
import sys
import threading
import time

import pytest

import mrtpo.rollout.vllm_server as vs
from mrtpo.rollout.server_process import PROOF_PATH, proof
from mrtpo.rollout.vllm_server import VLLMServerEngine, VLLMServerError


class _Impostor(http.server.BaseHTTPRequestHandler):
    """Answers 200 and a JSON object to any request; records (path, Authorization)."""

    seen: list = []

    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        type(self).seen.append((self.path, self.headers.get("Authorization")))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"proofs": ["0000"], "status": "ok"}')

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def impostor():
    """(port, requests seen): a process listening on a port of 127.0.0.1."""
    _Impostor.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Impostor)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], _Impostor.seen
    server.shutdown()
    server.server_close()


def _quiet_child(monkeypatch):
    """The started 'server' is a child that lives but never listens."""
    child = [sys.executable, "-c", "import time; time.sleep(300)"]
    monkeypatch.setattr(vs, "launch_command", lambda *a, **k: child)


def test_an_impostor_on_the_free_port_gets_nothing_but_a_nonce(
    impostor, monkeypatch, tmp_path, caplog
):
    """The race of item 1: free_port() found the port free, another process bound it before
    vLLM did. The run must stop before it sends any request but the proof's, and never send
    the key."""
    port, seen = impostor
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setattr(vs, "free_port", lambda host="127.0.0.1": port)
    _quiet_child(monkeypatch)
    eng = VLLMServerEngine("m", log_file=str(tmp_path / "server.log"), start_timeout_s=60)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(VLLMServerError) as err:
        eng.start()
    text = str(err.value)
    assert "is not the vLLM server the run started" in text and "\n" not in text
    assert f"port {port}" in text
    assert [p.split("?")[0] for p, _ in seen] == [PROOF_PATH]
    assert all(auth is None for _, auth in seen)  # the key never left the run
    assert eng.process is None and eng.client is None  # the child was stopped


def test_a_server_given_by_url_must_prove_the_key_before_it_gets_it(
    impostor, monkeypatch, tmp_path
):
    port, seen = impostor
    monkeypatch.setenv("MRTPO_TEST_KEY", "a-key-the-impostor-must-not-learn")
    eng = VLLMServerEngine(
        "m", url=f"http://127.0.0.1:{port}", weight_dir=str(tmp_path), api_key_env="MRTPO_TEST_KEY"
    )
    with pytest.raises(VLLMServerError, match="did not prove that it holds the key in") as err:
        eng.start()
    assert "MRTPO_TEST_KEY" in str(err.value) and "a-key" not in str(err.value)
    assert [p.split("?")[0] for p, _ in seen] == [PROOF_PATH]
    assert all(auth is None for _, auth in seen)


def test_a_fixed_port_already_in_use_is_refused_before_a_start(impostor, monkeypatch, tmp_path):
    port, seen = impostor
    _quiet_child(monkeypatch)
    eng = VLLMServerEngine("m", port=port, log_file=str(tmp_path / "server.log"))
    with pytest.raises(VLLMServerError, match=rf"rollout\.engine\.port={port}: .*in use") as err:
        eng.start()
    assert "\n" not in str(err.value)
    assert seen == [] and eng.process is None


def _environ(pid: int) -> bytes:
    """/proc/<pid>/environ, once the new program has it (it reads empty just after exec)."""
    for _ in range(600):
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
        if data:
            return data
        time.sleep(0.05)
    return b""


def test_a_started_server_gets_a_fresh_key_by_environment_never_argv(monkeypatch, tmp_path, caplog):
    """Each start draws a new key; it reaches the child in its environment (readable by this
    user only), not its command line (world-readable in /proc), and no log line holds it."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    _quiet_child(monkeypatch)
    caplog.set_level(logging.DEBUG)
    keys = []
    for _ in range(2):
        eng = VLLMServerEngine("m", log_file=str(tmp_path / "server.log"))
        eng._prepare_weight_folder()
        try:
            eng._launch()
            key = eng._key
            assert key and len(key) >= 32
            pid = eng.process.pid
            assert f"VLLM_API_KEY={key}".encode() in _environ(pid).split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert key.encode() not in f.read()
            assert key not in caplog.text
            keys.append(key)
        finally:
            eng.close()
    assert keys[0] != keys[1]


def test_the_key_proof_is_bound_to_the_key_the_nonce_and_the_address():
    where = "127.0.0.1:8000"
    a = proof("key-one", "n" * 32, where)
    assert a == proof("key-one", "n" * 32, where)
    assert a != proof("key-two", "n" * 32, where) and a != proof("key-one", "m" * 32, where)
    assert a != proof("key-one", "n" * 32, "127.0.0.1:8001")
    assert "key-one" not in a and len(a) == 64


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["--host", "0.0.0.0"], "rollout.engine.host"),
        (["--host=0.0.0.0"], "rollout.engine.host"),
        (["--ho", "0.0.0.0"], "rollout.engine.host"),  # argparse takes abbreviations
        (["--port", "8000"], "rollout.engine.port"),
        (["--api-key=abc"], "rollout.engine.api_key_env"),
        (["--api_key", "abc"], "rollout.engine.api_key_env"),  # vLLM reads _ as -
        (["--uds", "/tmp/s"], "rollout.engine.host"),
        (["--config", "serve.yaml"], "server_args"),
        (["--model", "/other"], "model.name_or_path"),
        (["--weight-transfer-config.backend", "nccl"], "mrtpo_file"),
        (["--logprobs-mode=raw_logprobs"], "processed_logprobs"),
        (["--no-enable-scale-out"], "--enable-scale-out"),
        (["-tp", "2"], "rollout.engine.tensor_parallel_size"),
        (["--dtype", "float16"], "rollout.engine.dtype"),
        (["--max-model-len", "9"], "rollout.engine.max_model_len"),
    ],
)
def test_server_args_the_launcher_owns_are_refused_naming_the_key(args, key):
    with pytest.raises(ValueError, match=r"rollout\.engine\.server_args") as err:
        VLLMServerEngine("m", server_args=args)
    text = str(err.value)
    assert key in text and args[0].split("=")[0] in text and "\n" not in text
    assert "abc" not in text  # a key given there is not repeated


def test_other_server_args_pass():
    args = ["--max-num-seqs", "8", "--disable-log-stats", "--enable-chunked-prefill"]
    assert VLLMServerEngine("m", server_args=args).server_args == args


def test_a_proof_that_is_not_ascii_is_refused_not_a_traceback():
    """compare_digest raises TypeError on str holding non-ASCII characters."""
    from mrtpo.rollout.server_process import proves

    assert not proves({"proofs": ["é" * 64, "\ud800"]}, "k", "n" * 32, "127.0.0.1:1")


@pytest.mark.parametrize(
    "args",
    [
        ["--api-server-count", "2"],
        ["-asc", "2"],
        ["--api_server_count=2"],
        ["--headless"],
        ["--grpc"],
    ],
)
def test_options_that_start_unguarded_or_no_api_processes_are_refused(args):
    with pytest.raises(ValueError, match=r"rollout\.engine\.server_args") as err:
        VLLMServerEngine("m", server_args=args)
    assert args[0].split("=")[0] in str(err.value) and "\n" not in str(err.value)


# ---- a relay of the key proof (review of issue 47, item 1) ---------------------------------


class _KeyCheck:
    """The base ``_with_proof`` widens (vLLM's AuthenticationMiddleware, which needs vLLM
    to import): a bearer key on every route. tests/vllm checks vLLM's own class."""

    def __init__(self, app, tokens):
        self.app, self.tokens = app, [f"Bearer {t}".encode() for t in tokens]

    def __call__(self, scope, receive, send):
        from starlette.responses import JSONResponse

        if dict(scope.get("headers", [])).get(b"authorization") in self.tokens:
            return self.app(scope, receive, send)
        return JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)


@pytest.fixture
def real_server():
    """(port, key): the real proof middleware on a Starlette app served by uvicorn on
    127.0.0.1 in a thread."""
    uvicorn = pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from mrtpo.rollout.server_process import free_port, new_key
    from mrtpo.rollout.vllm_serve import _with_proof

    key = new_key()
    app = Starlette(routes=[Route("/health", lambda r: JSONResponse({"ok": 1}))])
    app.add_middleware(_with_proof(_KeyCheck), tokens=[key])
    port = free_port("127.0.0.1")
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(600):
        if server.started:
            break
        time.sleep(0.05)
    yield port, key
    server.should_exit = True
    thread.join(30)


def _relay(family_host: str, port: int, target_port: int):
    """A process that passes the proof route on to the real server at 127.0.0.1 and keeps
    what else it is sent (the run's key, if the run trusted it)."""
    import socket
    import urllib.request

    stolen: list = []

    class Relay(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            stolen.append(self.headers.get("Authorization"))
            body = b'{"ok": 1}'
            if self.path.startswith(PROOF_PATH):
                url = f"http://127.0.0.1:{target_port}{self.path}"
                body = urllib.request.urlopen(url, timeout=30).read()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    class Server(http.server.ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in family_host else socket.AF_INET

    relay = Server((family_host, port), Relay)
    threading.Thread(target=relay.serve_forever, daemon=True).start()
    return relay, stolen


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("where", ["another port", "[::1], the same port"])
def test_a_relay_of_the_real_servers_proof_is_refused_and_gets_no_key(
    real_server, monkeypatch, tmp_path, where
):
    """A process that forwards the nonce to the real server and its proof back must not
    pass: the proof is bound to the address the server was reached on."""
    port, key = real_server
    if where.startswith("[::1]") and not _ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    host = "::1" if where.startswith("[::1]") else "127.0.0.1"
    relay, stolen = _relay(host, port if host == "::1" else 0, port)
    try:
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{relay.server_address[1]}"
        monkeypatch.setenv("MRTPO_TEST_KEY", key)
        eng = VLLMServerEngine("m", url=url, weight_dir=str(tmp_path), api_key_env="MRTPO_TEST_KEY")
        with pytest.raises(VLLMServerError, match="did not prove that it holds the key") as err:
            eng.start()
        assert "\n" not in str(err.value) and key not in str(err.value)
        assert stolen == [None]  # the proof request alone, without the key
    finally:
        relay.shutdown()
        relay.server_close()


def test_the_real_server_proves_itself_at_the_address_the_run_reached(real_server, monkeypatch):
    port, key = real_server
    monkeypatch.setenv("MRTPO_TEST_KEY", key)
    eng = VLLMServerEngine("m", url="http://x", weight_dir="/tmp", api_key_env="MRTPO_TEST_KEY")
    eng._key = key
    assert eng._prove(f"http://localhost:{port}") == f"http://127.0.0.1:{port}"  # pinned


@pytest.mark.parametrize(
    ("host", "url_host"), [("localhost", "127.0.0.1"), ("::1", "[::1]"), ("127.0.0.1", "127.0.0.1")]
)
def test_a_started_server_binds_and_is_reached_at_one_numeric_address(
    host, url_host, monkeypatch, tmp_path
):
    """``localhost`` may resolve to ::1 for the client and 127.0.0.1 for the server: the
    launcher resolves it once and uses that literal for --host, the port checks and the URL."""
    if host == "::1" and not _ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    launched = []
    child = [sys.executable, "-c", "import time; time.sleep(300)"]
    monkeypatch.setattr(vs, "launch_command", lambda *a, **k: launched.append(a) or child)
    eng = VLLMServerEngine("m", host=host, log_file=str(tmp_path / "server.log"))
    eng._prepare_weight_folder()
    try:
        eng._launch()
        bind, port = launched[0][0], launched[0][1]
        assert bind == url_host.strip("[]")
        assert eng.url == f"http://{url_host}:{port}"
    finally:
        eng.close()


def test_a_key_sent_over_plain_http_beyond_loopback_is_warned_about(caplog, tmp_path):
    eng = VLLMServerEngine("m", url="http://nodeB:8000", weight_dir=str(tmp_path))
    caplog.set_level(logging.WARNING)
    assert eng._proven_url("http://nodeB:8000", "127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert "clear text" not in caplog.text
    assert eng._proven_url("http://nodeB:8000", "10.0.0.2:8000") == "http://10.0.0.2:8000"
    assert "clear text" in caplog.text and "https" in caplog.text
    assert eng._proven_url("https://nodeB:8000", "10.0.0.2:8000") == "https://nodeB:8000"
