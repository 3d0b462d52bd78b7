"""The vLLM server client (``mrtpo.rollout.server_client``) against real local HTTP servers:
the key on every request, no redirect followed, nothing taken from the environment, kept-alive
connections, and retries only where repeating a request is safe. The engine's use of it is
tested in test_vllm_server_engine.py; the real vLLM server in tests/vllm/test_vllm_server.py."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from mrtpo.rollout.server_client import READ_RETRIES, RequestFailed, ServerClient


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Answers by path; records (method, path, Authorization, client port, Connection) of
    each request."""

    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        seen = self.server.seen  # type: ignore[attr-defined]
        auth, port = self.headers.get("Authorization"), self.client_address[1]
        seen.append((self.command, self.path, auth, port, self.headers.get("Connection")))
        behaviour = self.server.behaviour  # type: ignore[attr-defined]
        kind = behaviour.get(self.path, "ok")
        if kind == "slow":
            time.sleep(1.5)  # the client has given up by then
            return
        if kind == "drop":  # read the request, then close without an answer
            self.close_connection = True
            return
        if kind == "redirect":
            self._send(307, b"", {"Location": self.server.elsewhere})  # type: ignore[attr-defined]
            return
        if kind == "busy-once" and sum(1 for s in seen if s[1] == self.path) == 1:
            self._send(503, b'{"error": {"message": "not ready"}}')
            return
        self._send(200, json.dumps({"path": self.path}).encode())

    def _send(self, status: int, body: bytes, headers: dict | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


def _serve(behaviour: dict | None = None, elsewhere: str = ""):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.seen, server.behaviour, server.elsewhere = [], behaviour or {}, elsewhere
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def servers():
    made = []

    def make(behaviour=None, elsewhere=""):
        server, url = _serve(behaviour, elsewhere)
        made.append(server)
        return server, url

    yield make
    for server in made:
        server.shutdown()
        server.server_close()


def test_every_request_carries_the_key_and_only_repeatable_ones_share_a_connection(servers):
    server, url = servers()
    client = ServerClient(url, "the-key")
    for i in range(3):
        assert client.get(f"/health?i={i}") == {"path": f"/health?i={i}"}
        client.post("/update_weights", {"update_info": {"files": []}})
        client.post("/tokenize", {"prompt": "x"})
    assert len(server.seen) == 9
    assert {s[2] for s in server.seen} == {"Bearer the-key"}
    kept = [s for s in server.seen if s[1] != "/update_weights"]
    once = [s for s in server.seen if s[1] == "/update_weights"]
    assert len({s[3] for s in kept}) == 1  # one kept-alive connection for GETs and /tokenize
    # a weight push never goes out on a connection the server may have closed a moment before
    assert len({s[3] for s in once}) == 3 and {s[4] for s in once} == {"close"}
    assert not {s[3] for s in once} & {s[3] for s in kept}


def test_a_redirect_is_refused_and_the_key_goes_nowhere_else(servers):
    other, other_url = servers()
    _, url = servers({"/health": "redirect", "/update_weights": "redirect"}, other_url + "/x")
    client = ServerClient(url, "the-key")
    for call in (lambda: client.get("/health"), lambda: client.post("/update_weights")):
        with pytest.raises(RequestFailed) as err:
            call()
        assert err.value.kind == "refused" and err.value.status == 307
        assert f"redirect to {other_url}/x (not followed" in err.value.detail
    assert other.seen == []


def test_no_proxy_or_netrc_from_the_environment_sees_the_key(servers, monkeypatch, tmp_path):
    proxy, proxy_url = servers()
    server, url = servers()
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", proxy_url)
    monkeypatch.setenv("http_proxy", proxy_url)
    netrc = tmp_path / ".netrc"
    netrc.write_text("machine 127.0.0.1 login someone password other\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    ServerClient(url, "the-key").get("/health")
    assert proxy.seen == []
    assert [s[2] for s in server.seen] == ["Bearer the-key"]


@pytest.mark.parametrize(
    ("method", "path", "sent"),
    [
        ("POST", "/start_weight_update", 1),
        ("POST", "/update_weights", 1),
        ("POST", "/finish_weight_update", 1),
        ("POST", "/inference/v1/generate", 1),
        ("POST", "/tokenize", 1 + READ_RETRIES),
        ("POST", "/reset_prefix_cache", 1 + READ_RETRIES),
        ("GET", "/server_info", 1 + READ_RETRIES),
    ],
)
def test_a_request_is_sent_again_only_where_that_is_safe(servers, method, path, sent):
    server, url = servers({path: "drop"})
    with pytest.raises(RequestFailed) as err:
        ServerClient(url, "k").request(method, path, {} if method == "POST" else None)
    assert err.value.kind == "unreachable"
    assert [s[1] for s in server.seen] == [path] * sent


def test_a_server_not_ready_is_asked_again_for_a_get_only(servers):
    server, url = servers({"/health": "busy-once", "/update_weights": "busy-once"})
    client = ServerClient(url, "k")
    assert client.get("/health") == {"path": "/health"}
    with pytest.raises(RequestFailed) as err:
        client.post("/update_weights")
    assert err.value.kind == "refused" and err.value.status == 503
    assert err.value.detail == "not ready"
    assert [s[1] for s in server.seen] == ["/health", "/health", "/update_weights"]


def test_a_moved_client_sends_to_its_new_address_only(servers):
    first, first_url = servers({"/tokenize": "drop"})
    second, second_url = servers({"/tokenize": "drop"})
    client = ServerClient(first_url, "k")
    client.url = second_url
    with pytest.raises(RequestFailed):
        client.post("/tokenize", {"prompt": "x"})
    assert first.seen == [] and len(second.seen) == 1 + READ_RETRIES


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_no_answer_within_the_limit_is_waited_for_once(servers, method):
    server, url = servers({"/server_info": "slow"})
    t0 = time.monotonic()
    with pytest.raises(RequestFailed) as err:
        ServerClient(url, "k", timeout_s=0.3).request(method, "/server_info")
    assert err.value.kind == "timeout" and err.value.detail == "no answer within 0.3 s"
    assert time.monotonic() - t0 < 1.0 and len(server.seen) == 1
