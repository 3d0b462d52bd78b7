"""Talking to a vLLM server over HTTP: requests with timeouts, and the weight snapshots.

``ServerClient`` is a small JSON client (standard library only, so a trainer needs no vLLM
to use a remote server) that sends the API key on every request. Its failures are
``RequestFailed`` with a ``kind``: ``unreachable`` (connection refused or reset: the server
is gone), ``timeout`` (no answer within the limit) or ``refused`` (an HTTP error status, with
the server's message). The engine turns them into one line saying what died or refused.

vLLM ships a client for its RL routes (``vllm.distributed.weight_transfer.clients.
HTTPVLLMWeightSyncClient``); it is not used here because it sends no API key, needs
``requests`` and vLLM in the trainer, and loses the server's error message.

``write_snapshot`` writes the weights of one push as safetensors files (one per bucket)
that the server's ``mrtpo_file`` backend reads (``mrtpo.rollout.vllm_file_transfer``).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


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


class ServerClient:
    """JSON over HTTP to ``url`` (``http://host:port``), with ``api_key`` as a bearer token."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = float(timeout_s)

    def request(
        self, method: str, path: str, body: Any = None, timeout_s: float | None = None
    ) -> Any:
        data = None if body is None else json.dumps(body).encode("utf-8")
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        limit = self.timeout_s if timeout_s is None else float(timeout_s)
        try:
            with urllib.request.urlopen(req, timeout=limit) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise RequestFailed("refused", _error_message(exc.read()), exc.code) from None
        except TimeoutError as exc:
            raise RequestFailed("timeout", f"no answer within {limit:g} s ({exc})") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise RequestFailed("timeout", f"no answer within {limit:g} s") from None
            raise RequestFailed("unreachable", str(exc.reason)) from None
        except (ConnectionError, OSError) as exc:  # reset while reading, refused, ...
            raise RequestFailed("unreachable", f"{type(exc).__name__}: {exc}") from None
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode("utf-8", errors="replace")

    def get(self, path: str, timeout_s: float | None = None) -> Any:
        return self.request("GET", path, None, timeout_s)

    def post(self, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        return self.request("POST", path, {} if body is None else body, timeout_s)
