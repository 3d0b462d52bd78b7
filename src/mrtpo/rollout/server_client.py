"""Talking to a vLLM server over HTTP: ``requests`` sessions with urllib3's ``Retry`` (as TRL's
``vllm_client.py``) and timeouts; docs/rollout.md, "Faults", says what is retried and why.

GET and the ``IDEMPOTENT`` POST routes share kept-alive connections and are retried after a
failed connection, a reset or a 502/503/504; any other request goes once on a connection of
its own, retried only when none could be made. A timed-out request is never sent again, no
redirect is followed, and the environment is not read (``trust_env=False``) but for the
trusted certificates. Failures are ``RequestFailed`` with a ``kind``: ``unreachable``,
``timeout`` or ``refused``. (vLLM's ``HTTPVLLMWeightSyncClient`` sends no API key, needs vLLM
in the trainer, and loses the server's error message.)
"""

from __future__ import annotations

import json
import os
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.exceptions import ReadTimeoutError
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


class _Retry(Retry):
    """urllib3's ``Retry``, except that a request that got no answer within its time limit
    is not sent again: the limit is the longest the run waits for one answer."""

    def increment(self, method=None, url=None, response=None, error=None, _pool=None,
                  _stacktrace=None):  # fmt: skip
        if isinstance(error, ReadTimeoutError):
            raise error
        return super().increment(method, url, response, error, _pool, _stacktrace)


def _retry(repeatable: bool) -> Retry:
    """Connection failures retried for every request; failed reads and 502/503/504 for
    ``repeatable`` ones only; no redirect followed."""
    return _Retry(
        total=None,
        connect=CONNECT_RETRIES,
        read=READ_RETRIES if repeatable else False,  # False: the read's own error comes back
        status=READ_RETRIES if repeatable else 0,
        other=0,
        redirect=0,
        allowed_methods=frozenset({"GET", "POST"}),
        status_forcelist=RETRY_STATUS if repeatable else (),
        backoff_factor=BACKOFF_S,
        raise_on_status=False,  # the last answer comes back: its status is the refusal
        raise_on_redirect=False,
        respect_retry_after_header=False,
    )


def _session(api_key: str | None, repeatable: bool, connections: int) -> requests.Session:
    session = requests.Session()
    session.trust_env = False
    session.verify = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("SSL_CERT_FILE") or True
    session.headers["Content-Type"] = "application/json"
    if not repeatable:
        session.headers["Connection"] = "close"  # a new connection for each request
    if api_key:
        session.headers["Authorization"] = f"Bearer {api_key}"
    adapter = HTTPAdapter(pool_maxsize=connections, max_retries=_retry(repeatable))
    session.adapters.clear()  # only the two schemes below, each with these retries
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


class ServerClient:
    """JSON over HTTP to ``url`` (``http://host:port``), with ``api_key`` as a bearer token.
    ``connections``: how many requests may be in flight at once."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        connections: int = 10,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = float(timeout_s)
        size = max(int(connections), 1)
        self._repeatable = _session(api_key, True, size)
        self._once = _session(api_key, False, size)

    def close(self) -> None:
        self._repeatable.close()
        self._once.close()

    def request(
        self, method: str, path: str, body: Any = None, timeout_s: float | None = None
    ) -> Any:
        data = None if body is None else json.dumps(body).encode("utf-8")
        limit = self.timeout_s if timeout_s is None else float(timeout_s)
        try:
            # sending a GET or an IDEMPOTENT route twice changes nothing
            repeatable = method == "GET" or path.split("?", 1)[0] in IDEMPOTENT
            session = self._repeatable if repeatable else self._once
            resp = session.request(
                method, self.url + path, data=data, timeout=limit, allow_redirects=False
            )
        except requests.Timeout:  # no connection or no answer within the limit
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
    """The innermost reason of a failed request, in one line: what the requests exception
    wraps (urllib3's MaxRetryError holds the last failure), without the wrapping."""
    reason: BaseException = exc
    while reason.args and isinstance(reason.args[0], BaseException):
        reason = reason.args[0]
    inner = getattr(reason, "reason", None)
    reason = inner if isinstance(inner, BaseException) else reason
    text = " ".join(str(reason).split())
    return f"{type(reason).__name__}: {text}"[:500]
