"""A ``vllm serve`` process that the run started, the guarantee that it ends with the run, and
what the run checks before it trusts a server.

The server runs in a process group of its own (``start_new_session``), so stopping it stops
what it started: SIGTERM to the group, SIGKILL to what is left after ``stop_timeout_s``. It is
stopped by ``ServerProcess.stop`` (the engine's ``close``), at exit (``atexit``), and by the
kernel when the trainer dies without either (``PR_SET_PDEATHSIG``, ``mrtpo.rollout.vllm_serve``).
No signal handler is installed: the run's own unwinds the run. Popen must be called from the
main thread: the kernel's parent-death signal follows the thread that started the child.

``ServerChecks`` is the part of ``VLLMServerEngine`` that talks to a server before the run
uses it: the key proof, ``/health`` and the start-up checks (backend, architecture,
tokenizer, the token-in/token-out route, tempered log-probs). ``_failure`` and
``_bad_answer`` turn a failed request or an unusable answer into one line naming the server.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hmac
import http.client
import ipaddress
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from mrtpo.core.errors import CompactHydraException
from mrtpo.rollout import server_answers
from mrtpo.rollout.server_answers import BadAnswer, as_object, field
from mrtpo.rollout.server_client import RequestFailed, ServerClient
from mrtpo.rollout.vllm import _model_config, torch_dtype
from mrtpo.rollout.vllm_serve import PROOF_PATH, _canonical_ip, canonical_address, proof
from mrtpo.safe_files import open_fd

log = logging.getLogger(__name__)

LAUNCHER = "mrtpo.rollout.vllm_serve"
BACKEND = "mrtpo_file"  # mrtpo.rollout.vllm_file_transfer.BACKEND (that module imports vLLM)


def new_key() -> str:
    """A fresh API key for one started server (256 random bits)."""
    return secrets.token_urlsafe(32)


def proves(answer: object, key: str, nonce: str, address: str) -> bool:
    """Whether a server's answer on ``PROOF_PATH`` holds ``proof(key, nonce, address)``
    (compared as bytes: ``compare_digest`` refuses a str that is not ASCII)."""
    proofs = answer.get("proofs") if isinstance(answer, dict) else None
    want = proof(key, nonce, address).encode()
    return isinstance(proofs, list) and any(
        isinstance(p, str) and hmac.compare_digest(p.encode("utf-8", "replace"), want)
        for p in proofs
    )


def resolve(host: str) -> str:
    """The one numeric address ``host`` names here (the first the resolver gives), which
    the launcher binds, checks and connects to: a name resolved twice may give two
    addresses (``localhost``: 127.0.0.1 for the server, ::1 for the client), and another
    process may listen on the second. ValueError when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise ValueError(f"{host!r} does not resolve to an address here ({exc})") from None
    return _canonical_ip(infos[0][4][0]) or str(infos[0][4][0])


def ask_proof(url: str, nonce: str, timeout_s: float = 10.0) -> tuple[object, str]:
    """GET ``PROOF_PATH`` at ``url`` without a key: (the answer, the ``ip:port`` this
    connection reached), the address the proof must be bound to. Failures are
    ``RequestFailed`` as for ``ServerClient``."""
    parts = urlsplit(url)
    https = parts.scheme == "https"
    conn_type = http.client.HTTPSConnection if https else http.client.HTTPConnection
    conn = conn_type(parts.hostname or "", parts.port or (443 if https else 80), timeout=timeout_s)
    try:
        conn.request("GET", f"{parts.path.rstrip('/')}{PROOF_PATH}?nonce={nonce}")
        peer = conn.sock.getpeername() if conn.sock is not None else ("", None)
        resp = conn.getresponse()
        raw, status = resp.read(), resp.status
    except TimeoutError:
        raise RequestFailed("timeout", f"no answer within {timeout_s:g} s") from None
    except (OSError, http.client.HTTPException) as exc:
        raise RequestFailed("unreachable", f"{type(exc).__name__}: {exc}") from None
    finally:
        conn.close()
    text = raw.decode("utf-8", errors="replace")
    if status >= 400:
        raise RequestFailed("refused", " ".join(text.split())[:500], status)
    try:
        answer: object = json.loads(text)
    except ValueError:
        answer = text
    return answer, canonical_address(peer[0], peer[1])


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (another process may bind it before the
    server does: the run trusts the key proof, never the port)."""
    with socket.socket(_family(host)) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    """Whether another socket already holds ``host:port`` (a port in TIME_WAIT is free, as
    for the server, which binds with SO_REUSEADDR)."""
    with socket.socket(_family(host)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
        except OSError:
            return True
    return False


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def group_members(pgid: int) -> list[int]:
    """Processes of process group ``pgid`` still running (zombies left out: a container
    whose first process reaps nothing keeps them in the table)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(entry.name))
    return alive


@dataclasses.dataclass(eq=False)  # compared and hashed by identity (atexit)
class ServerProcess:
    """Start ``cmd`` in its own process group with its output in ``log_path``."""

    cmd: list[str]
    env: dict[str, str] = dataclasses.field(repr=False)  # holds the API key
    log_path: Path
    stop_timeout_s: float = 30.0
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        fd = open_fd(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            self.proc = subprocess.Popen(
                self.cmd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            os.close(fd)
        atexit.register(self.stop)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def how_it_ended(self) -> str:
        """ "was killed by SIGKILL", "exited with status 1", or "is still running"."""
        code = None if self.proc is None else self.proc.poll()
        if code is None:
            return "is still running"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def log_tail(self, lines: int = 1) -> str:
        """The last non-empty lines of the server's log (for an error message)."""
        with contextlib.suppress(OSError):
            text = self.log_path.read_text(errors="replace").splitlines()
            return " | ".join([t.strip() for t in text if t.strip()][-lines:])
        return ""

    def stop(self) -> None:
        """SIGTERM the group, SIGKILL what is left after ``stop_timeout_s``, reap the server."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        pgid = proc.pid  # a session leader's group id is its pid
        for sig, wait_s in ((signal.SIGTERM, self.stop_timeout_s), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.2)
                if proc.poll() is not None and not group_members(pgid):
                    return
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def launch_command(url_host: str, port: int, model: str, args: Sequence[str]) -> list[str]:
    """The command that starts a server for ``rollout=vllm_server`` (also for docs/scaling.md:
    the same arguments start one on another node)."""
    where = ["--model", model, "--host", url_host, "--port", str(port)]
    needed = ["--enable-scale-out", "--logprobs-mode", "processed_logprobs"]
    backend = ["--weight-transfer-config", json.dumps({"backend": BACKEND})]
    return [sys.executable, "-m", LAUNCHER, *where, *needed, *backend, *args]


#: ``vllm serve`` arguments the launcher sets, and what sets each instead (None: the run
#: needs the launcher's value). vLLM's parser reads ``_`` as ``-``, takes ``--name=value`` and
#: unique abbreviations, and ``--name.field`` sets one field of a JSON argument.
_ONE_API = "nothing: remove it (the run serves one HTTP API process, the one that checks the key)"
OWNED_ARGS: dict[str, str | None] = {
    "--host": "rollout.engine.host",
    "--port": "rollout.engine.port",
    "--uds": "rollout.engine.host and rollout.engine.port",
    "--api-key": "rollout.engine.api_key_env (the environment variable that holds the key)",
    "--config": "one server_args entry per argument (a config file can set any of these)",
    "--model": "model.name_or_path",
    "--dtype": "rollout.engine.dtype",
    "--seed": "rollout.engine.seed",
    "--tensor-parallel-size": "rollout.engine.tensor_parallel_size",
    "-tp": "rollout.engine.tensor_parallel_size",
    "--max-model-len": "rollout.engine.max_model_len",
    "--kv-cache-memory-bytes": "rollout.engine.kv_cache_gb",
    "--enable-prefix-caching": "rollout.engine.enable_prefix_caching",
    "--no-enable-prefix-caching": "rollout.engine.enable_prefix_caching",
    "--weight-transfer-config": None,
    "--logprobs-mode": None,
    "--enable-scale-out": None,
    "--no-enable-scale-out": None,
    # more API processes (or none, or gRPC) than the one the launcher guards with the key
    "--api-server-count": _ONE_API,
    "-asc": _ONE_API,
    "--headless": _ONE_API,
    "--grpc": _ONE_API,
}


def _owner(arg: str) -> str | None:
    """The launcher's argument that ``arg`` would set, if any."""
    if not arg.startswith("-"):
        return None
    name = arg.split("=", 1)[0]
    if name.startswith("--"):
        name = "--" + name[2:].split(".", 1)[0].replace("_", "-")
        hits = [
            o for o in OWNED_ARGS if o.startswith("--") and len(name) > 2 and o.startswith(name)
        ]
    else:  # -tp 2, -tp2, -t 2 (argparse also matches single-dash prefixes)
        hits = [
            o
            for o in OWNED_ARGS
            if not o.startswith("--") and (name.startswith(o) or o.startswith(name))
        ]
    return (hits or [None])[0]


def owned_argument(args: Sequence[str]) -> str | None:
    """One line refusing the first of ``args`` that the launcher owns (None: all are free)."""
    for arg in args:
        owner = _owner(arg)
        if owner is None:
            continue
        fixed = OWNED_ARGS[owner]
        shown = arg.split("=", 1)[0] + ("=..." if "=" in arg else "")  # never echo a key
        instead = (
            fixed
            if fixed == _ONE_API
            else f"set {fixed} instead"
            if fixed
            else f"remove it (the run needs the launcher's {owner}: {BACKEND} weight transfer, "
            "processed_logprobs, --enable-scale-out)"
        )
        return (
            f"rollout.engine.server_args holds {shown!r}, which sets {owner}, an argument the "
            f"launcher owns (where the server listens and who may call it): {instead}"
        )
    return None


#: what must agree between the policy's config and the served model's config.json
ARCH_KEYS = (
    "architectures",
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)
_PROBE = [{"role": "user", "content": "Write three words about rivers, then stop."}]
PROBE_TOP = 5  # top log-probs per token in the log-prob probe (vLLM allows 20 by default)


class VLLMServerError(CompactHydraException, RuntimeError):
    """The vLLM server died, cannot be reached, did not answer in time, refused a request,
    or cannot serve this run. Its message is one line (Hydra prints it alone)."""


def _policy_config(model: torch.nn.Module) -> dict[str, Any]:
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    cfg = getattr(base, "config", None)
    return cfg.to_dict() if cfg is not None and hasattr(cfg, "to_dict") else {}


def _architecture(cfg: dict[str, Any]) -> str:
    arch = cfg.get("architectures") or [cfg.get("model_type", "?")]
    return (
        f"{'/'.join(map(str, arch))}, hidden {cfg.get('hidden_size')}, "
        f"{cfg.get('num_hidden_layers')} layers, vocab {cfg.get('vocab_size')}"
    )


class ServerChecks:
    """The key proof, the health wait, the start-up checks and the one-line failures of
    ``VLLMServerEngine``, whose attributes they read and set (``url``, ``process``,
    ``logprobs_mode``, ``_key``, ``_push_dtype``, ``served``, ...)."""

    def _wait_healthy(self, client: ServerClient) -> None:
        """Wait for the key proof (``_prove``), then for ``/health`` (with the key)."""
        deadline = time.monotonic() + float(self.start_timeout_s)
        last = ""
        while time.monotonic() < deadline:
            if self.process is not None and not self.process.alive():
                raise VLLMServerError(
                    f"the vLLM server for {self.model} {self.process.how_it_ended()} while "
                    f"starting ({self.process.log_tail()}); its log: {self.process.log_path}"
                )
            try:
                client.url = self.url = self._prove(client.url)
                client.get("/health", timeout_s=10)
                return
            except RequestFailed as exc:
                last = exc.detail
            time.sleep(1.0)
        where = f"; its log: {self.process.log_path}" if self.process is not None else ""
        raise VLLMServerError(
            f"the vLLM server at {client.url} did not answer /health within "
            f"{self.start_timeout_s:g} s (rollout.engine.start_timeout_s; last: {last}){where}"
        )

    def _prove(self, url: str) -> str:
        """The server at ``url`` must answer a fresh nonce with ``proof(key, nonce, address)``
        before it gets any request or the key (docs/rollout.md, "Security"): a process that
        bound the port first cannot, and a relay gets a proof for another address. Any other
        answer stops the run; no answer yet is asked again. Returns the URL to use from now
        on: over http, the proven numeric address (a name resolved again may lead elsewhere)."""
        if self._key is None:
            log.warning("no API key in %s: the run cannot check that %s is the server meant "
                        "(and anyone who reaches it can call its RL routes)", self.api_key_env,
                        url)  # fmt: skip
            return url
        nonce = secrets.token_hex(16)
        try:
            answer, address = ask_proof(url, nonce)
        except RequestFailed as exc:
            if exc.kind != "refused":
                raise
            answer, address = f"HTTP {exc.status}: {exc.detail}", ""
        if proves(answer, self._key, nonce, address):
            return self._proven_url(url, address)
        seen = " ".join(str(answer).split())[:120]
        if self.process is None:
            raise VLLMServerError(
                f"the server at {url} did not prove that it holds the key in {self.api_key_env} "
                f"for the address the run reached ({address or 'none'}; it answered {seen!r}; "
                f"the key was not sent): start it with `python -m {LAUNCHER}` of this version "
                "and that key, reach it directly (no relay or port mapping), and check "
                "rollout.engine.url"
            )
        raise VLLMServerError(
            f"the process answering at {url} is not the vLLM server the run started: it could "
            f"not prove that it holds the run's key (it answered {seen!r}; nothing else and no "
            f"key was sent). Another process holds port {urlsplit(url).port}: stop it, or set "
            "rollout.engine.port to a free port"
        )

    def _proven_url(self, url: str, address: str) -> str:
        parts = urlsplit(url)
        if parts.scheme != "http":
            return url  # https: the certificate names the host
        if not is_loopback(address.rsplit(":", 1)[0].strip("[]")):
            log.warning("the run sends the key in %s to %s over plain http, in clear text "
                        "for anyone on the network path: serve https (vLLM's --ssl-keyfile and "
                        "--ssl-certfile) or use an SSH tunnel that keeps the address and port "
                        "(ssh -L 127.0.0.1:P:127.0.0.1:P, the server on 127.0.0.1:P there, "
                        "rollout.engine.url=http://127.0.0.1:P); a tunnel that maps the port "
                        "fails the key proof", self.api_key_env, url)  # fmt: skip
        return f"http://{address}{parts.path.rstrip('/')}"

    # -- what the server must be -------------------------------------------------------------

    def _check_server(self, client: ServerClient) -> None:
        """Refuse a server that lacks the routes or backend this run needs, or that serves
        another model; read its dtype and log-prob mode."""
        what = "the start-up check"
        info = self._call(lambda: as_object(client.get("/server_info?config_format=json")),
                          what=what)  # fmt: skip
        vcfg = info.get("vllm_config") if isinstance(info.get("vllm_config"), dict) else {}
        wcfg = vcfg.get("weight_transfer_config")
        backend = wcfg.get("backend") if isinstance(wcfg, dict) else None
        if backend != BACKEND:
            raise VLLMServerError(
                f"the vLLM server at {client.url} has weight transfer backend {backend!r}, not "
                f"{BACKEND!r}: start it with `python -m {LAUNCHER} ... --weight-transfer-config "
                f'\'{{"backend": "{BACKEND}"}}\'` and MRTPO_WEIGHT_ROOT=<weight folder> '
                "(docs/scaling.md)"
            )
        mcfg = vcfg.get("model_config") if isinstance(vcfg.get("model_config"), dict) else {}
        self.logprobs_mode = mcfg.get("logprobs_mode")
        self._push_dtype = torch_dtype(mcfg.get("dtype"))
        self.served = self._call(lambda: server_answers.served_model(client.get("/v1/models")),
                                 what=what)  # fmt: skip
        self._check_architecture(client.url)
        self._check_tokenizer(client)
        self._probe_generate(client)

    def _check_architecture(self, url: str) -> None:
        if self._policy is None:
            return
        mine, theirs = _policy_config(self._policy), _model_config(self.served)
        if not theirs:
            log.info(
                "cannot read %s/config.json here: the first weight push checks it", self.served
            )
            return
        diff = [k for k in ARCH_KEYS if k in mine and k in theirs and mine[k] != theirs[k]]
        if diff:
            raise VLLMServerError(
                f"the vLLM server at {url} serves {self.served} ({_architecture(theirs)}) but the "
                f"policy is {self.model} ({_architecture(mine)}; {', '.join(diff)} differ): "
                "start the server with --model <the policy's folder>"
            )

    def _check_tokenizer(self, client: ServerClient) -> None:
        tok = self._tokenizer
        if tok is None:
            return
        try:
            text = tok.apply_chat_template(_PROBE, add_generation_prompt=True, tokenize=False)
        except Exception:
            text = _PROBE[0]["content"]
        mine = list(tok(text, add_special_tokens=False)["input_ids"])
        body = {"prompt": text, "add_special_tokens": False}
        theirs = self._call(lambda: field(client.post("/tokenize", body), "tokens", list),
                            what="the tokenizer check")  # fmt: skip
        if mine != theirs:
            at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), len(mine))
            raise VLLMServerError(
                f"the vLLM server at {client.url} serves {self.served}, whose tokenizer does "
                f"not match the policy's ({self.model}): the probe text {text[:60]!r} gives "
                f"{len(theirs)} tokens there and {len(mine)} here, first different at token "
                f"{at}. Start the server with --model <the policy's folder>"
            )

    def _probe_generate(self, client: ServerClient) -> None:
        """Refuse a server without the token-in/token-out route, or whose log-probs are not
        those of the distribution it samples (the loss needs log softmax(z / T)). One token
        is sampled at temperature 1 and at 0.5 from the same prompt: tempered log-probs
        double every gap between two tokens' log-probs at 0.5, the model's own keep it."""
        tops = [self._probe_top(client, t) for t in (1.0, 0.5)]
        common = set(tops[0]) & set(tops[1])
        if not common:  # tempering keeps the tokens' order: the same prompt shares its top
            raise self._bad_answer("the log-prob probe", BadAnswer(
                f"no top token in common at temperature 1 ({sorted(tops[0])[:PROBE_TOP]}) and "
                f"0.5 ({sorted(tops[1])[:PROBE_TOP]}) for the same seeded prompt"))  # fmt: skip
        gaps = [max(top[t] for t in common) - min(top[t] for t in common) for top in tops]
        if gaps[0] > 1e-3:  # else the tokens are too close to tell: trust the server's word
            tempered, seen = gaps[1] / gaps[0] > 1.5, f"{gaps[1] / gaps[0]:.2f} x"
        else:
            tempered, seen = self.logprobs_mode == "processed_logprobs", "too close to tell"
        if not tempered:
            raise VLLMServerError(
                f"the vLLM server at {client.url} reports the model's own log-probs, not those "
                f"of the distribution it samples (logprobs mode {self.logprobs_mode!r}; the "
                f"gaps between its top log-probs at temperature 0.5 are {seen} those at "
                "temperature 1, where they would be 2 x): start it with --logprobs-mode "
                "processed_logprobs"
            )

    def _probe_top(self, client: ServerClient, temperature: float) -> dict[int, float]:
        """The top log-probs of one token sampled at ``temperature`` (a seeded request)."""
        params = {"n": 1, "max_tokens": 1, "temperature": temperature, "seed": self.seed,
                  "logprobs": PROBE_TOP, "detokenize": False}  # fmt: skip
        body = {"token_ids": [0], "sampling_params": params}
        try:
            answer = client.post("/inference/v1/generate", body)
        except RequestFailed as exc:
            if exc.status in (403, 404):
                raise VLLMServerError(
                    f"the vLLM server at {client.url} does not offer /inference/v1/generate "
                    f"(HTTP {exc.status}): start it with --enable-scale-out"
                ) from None
            raise self._failure("the start-up check", exc) from None
        return self._call(lambda: server_answers.top_logprobs(answer, PROBE_TOP),
                          what="the log-prob probe")  # fmt: skip

    # -- failures ----------------------------------------------------------------------------

    def _call(self, fn, *args: Any, what: str) -> Any:
        """``fn(*args)``: a request and what reads its answer; a failure is one line."""
        try:
            return fn(*args)
        except RequestFailed as exc:
            raise self._failure(what, exc) from None
        except BadAnswer as exc:
            raise self._bad_answer(what, exc) from None

    def _bad_answer(self, what: str, exc: BadAnswer) -> VLLMServerError:
        return VLLMServerError(
            f"the vLLM server at {self.url} sent an answer the run cannot use during {what}: {exc}"
        )

    def _failure(self, what: str, exc: RequestFailed) -> VLLMServerError:
        """One line: what happened to the server during ``what``."""
        proc = self.process
        if proc is not None and exc.kind != "refused" and proc.proc is not None:
            with contextlib.suppress(Exception):
                proc.proc.wait(timeout=5)  # a killed server may still be exiting
        if proc is not None and not proc.alive():
            message = (
                f"the vLLM server the run started (pid {proc.pid}, {self.url}) "
                f"{proc.how_it_ended()} during {what}; its log: {proc.log_path}"
            )
            proc.stop()  # what is left of its process group
            return VLLMServerError(message)
        said = {
            "refused": f"refused {what} (HTTP {exc.status}: {exc.detail})",
            "timeout": f"did not answer {what} within {self.request_timeout_s:g} s "
            f"(rollout.engine.request_timeout_s): {exc.detail}",
        }.get(exc.kind)
        said = said or (
            f"cannot be reached during {what} ({exc.detail}): it is not running, or the "
            "network to it is down"
        )
        return VLLMServerError(f"the vLLM server at {self.url} {said}")
