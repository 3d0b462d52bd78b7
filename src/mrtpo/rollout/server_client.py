"""Talking to a vLLM server over HTTP: a ``requests`` session with retries and timeouts.

``ServerClient`` sends JSON to one server with the API key on every request, over kept-alive
connections (one TCP connection per concurrent request, not one per request). Retries are
urllib3's ``Retry`` (as TRL's ``vllm_client.py``), limited to what is safe to repeat:

* a connection that could not be made (refused, reset while connecting, DNS) is tried
  ``CONNECT_RETRIES`` more times for every request: nothing reached the server;
* a read that failed (reset mid-answer, no answer in time) and an answer of 502/503/504 are
  tried ``READ_RETRIES`` more times only for GET and the POST routes in ``IDEMPOTENT``
  (``/tokenize``, ``/reset_prefix_cache``): repeating them changes nothing. The weight push's
  routes and generation are never sent twice (a push is not idempotent; a generation sent
  twice costs the server the work twice, and its failure usually means the server died).

What the client never does: follow a redirect (a 3xx is a refusal naming where it pointed:
the key goes to the server named and nowhere else), read proxies, ``.netrc`` or other settings
from the environment (``trust_env=False``: a proxy would see the key, a ``.netrc`` entry would
replace it, and the key proof was made on a direct connection; ``REQUESTS_CA_BUNDLE`` or
``SSL_CERT_FILE`` still name the trusted certificates of an https server). Its failures are
``RequestFailed`` with a ``kind``: ``unreachable`` (the server is gone), ``timeout`` (no answer
within the limit) or ``refused`` (an HTTP error status or a redirect, with the server's
message). The engine turns them into one line saying what died or refused.

vLLM ships a client for its RL routes (``vllm.distributed.weight_transfer.clients.
HTTPVLLMWeightSyncClient``); it is not used here because it sends no API key, needs vLLM in
the trainer, and loses the server's error message.
"""

from __future__ import annotations

import json
import os
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.util import Retry

#: POST routes that may be sent again after a failed read: they change no state twice
IDEMPOTENT = ("/tokenize", "/reset_prefix_cache")
CONNECT_RETRIES = 3
READ_RETRIES = 2
RETRY_STATUS = (502, 503, 504)  # a proxy or a server that is not ready: nothing was done
BACKOFF_S = 0.25  # urllib3 waits 0, 2 x, 4 x this between tries


class RequestFailed(Exception):
    """One request did not get an answer it could use; ``kind`` says how."""

    def __init__(self, kind: str, detail: str, status: int | None = None) -> None:
        super().__init__(detail)
        self.kind, self.detail, self.status = kind, detail, status


def _error_message(body: bytes) -> str:
    """The message of a vLLM or FastAPI error body, else the start of the body."""
    text = body.decode("utf-8", errors="replace")
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:500]
    err = data.get("error", data.get("detail", data)) if isinstance(data, dict) else data
    if isinstance(err, dict):
        err = err.get("message", err)
    return str(err)[:1000]


def _retry(methods: frozenset[str]) -> Retry:
    """Connection failures retried for any method; failed reads and 502/503/504 for
    ``methods`` only; no redirect followed."""
    return Retry(
        total=None,
        connect=CONNECT_RETRIES,
        read=READ_RETRIES,
        status=READ_RETRIES,
        other=0,
        redirect=0,
        allowed_methods=methods,
        status_forcelist=RETRY_STATUS,
        backoff_factor=BACKOFF_S,
        raise_on_status=False,  # the last answer comes back: its status is the refusal
        raise_on_redirect=False,
        respect_retry_after_header=False,
    )


class ServerClient:
    """JSON over HTTP to ``url`` (``http://host:port``), with ``api_key`` as a bearer token.
    ``connections``: how many requests may be in flight at once (kept-alive connections)."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        connections: int = 10,
    ) -> None:
        self.api_key = api_key
        self.timeout_s = float(timeout_s)
        self.connections = max(int(connections), 1)
        self.session = requests.Session()
        self.session.trust_env = False
        self.session.verify = (
            os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("SSL_CERT_FILE") or True
        )
        self.session.headers["Content-Type"] = "application/json"
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self.url = url

    @property
    def url(self) -> str:
        return self._url

    @url.setter
    def url(self, url: str) -> None:
        """Point the client at ``url`` (the engine moves it to the proven address)."""
        self._url = url.rstrip("/")
        self.session.adapters.clear()
        self._mount(self._url + "/", frozenset({"GET"}))
        for path in IDEMPOTENT:
            self._mount(self._url + path, frozenset({"GET", "POST"}))

    def _mount(self, prefix: str, methods: frozenset[str]) -> None:
        size = self.connections
        adapter = HTTPAdapter(pool_maxsize=size, max_retries=_retry(methods))
        self.session.mount(prefix, adapter)

    def close(self) -> None:
        self.session.close()

    def request(
        self, method: str, path: str, body: Any = None, timeout_s: float | None = None
    ) -> Any:
        data = None if body is None else json.dumps(body).encode("utf-8")
        limit = self.timeout_s if timeout_s is None else float(timeout_s)
        try:
            resp = self.session.request(
                method, self._url + path, data=data, timeout=limit, allow_redirects=False
            )
        except requests.Timeout:
            raise RequestFailed("timeout", f"no answer within {limit:g} s") from None
        except requests.RequestException as exc:  # refused, reset, TLS, ...
            raise RequestFailed("unreachable", _reason(exc)) from None
        if resp.is_redirect:
            where = resp.headers.get("Location", "?")
            raise RequestFailed(
                "refused",
                f"a redirect to {where[:200]} (not followed: the run talks to the server it "
                "named only)",
                resp.status_code,
            )
        if resp.status_code >= 400:
            raise RequestFailed("refused", _error_message(resp.content), resp.status_code)
        if not resp.content:
            return None
        try:
            return json.loads(resp.content)
        except ValueError:
            return resp.content.decode("utf-8", errors="replace")

    def get(self, path: str, timeout_s: float | None = None) -> Any:
        return self.request("GET", path, None, timeout_s)

    def post(self, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        return self.request("POST", path, {} if body is None else body, timeout_s)


def _reason(exc: requests.RequestException) -> str:
    """The innermost reason of a failed connection, in one line (no urllib3 wrapping)."""
    reason: BaseException = exc
    while reason.args and isinstance(reason.args[0], BaseException):
        reason = reason.args[0]
    inner = getattr(reason, "reason", None)
    if isinstance(inner, BaseException):
        reason = inner
    text = " ".join(str(reason).split())
    return f"{type(reason).__name__}: {text}"[:500]
