"""A ``vllm serve`` process that the run started, and the guarantee that it ends with the run.

The server runs in a process group of its own (``start_new_session``), so stopping it stops
everything it started (vLLM's engine core and workers): SIGTERM to the group, then SIGKILL
to what is left after ``stop_timeout_s``. It is stopped by ``ServerProcess.stop`` (the
engine's ``close``), at interpreter exit (``atexit``), and, when the trainer ends without
running either (SIGKILL, ``os._exit``), by the kernel: the launcher asks for SIGTERM when its
parent dies (``PR_SET_PDEATHSIG``, ``mrtpo.rollout.vllm_serve``). No signal handler is
installed: the run's own SIGTERM/SIGINT handling (``mrtpo.core.faults``) unwinds the run, and
the server stops on the way out. Popen must be called from the thread that lives as long as
the run (the main thread): the kernel's parent-death signal follows that thread.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import hmac
import http.client
import ipaddress
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from mrtpo.rollout.server_client import RequestFailed
from mrtpo.safe_files import open_fd

LAUNCHER = "mrtpo.rollout.vllm_serve"
BACKEND = "mrtpo_file"  # mrtpo.rollout.vllm_file_transfer.BACKEND (that module imports vLLM)

#: the one route a started server answers without its key: it proves that it holds the key
PROOF_PATH = "/mrtpo/proof"
_PROOF_CONTEXT = b"mrtpo-server-proof\0"


def new_key() -> str:
    """A fresh API key for one started server (256 random bits)."""
    return secrets.token_urlsafe(32)


def proof(key: str, nonce: str, address: str) -> str:
    """What a server holding ``key`` answers to the run's ``nonce`` on ``PROOF_PATH`` when
    reached at ``address`` (``ip:port``, ``canonical_address``): an HMAC-SHA256, which shows
    the key is known without revealing it or being reusable for another nonce or address. The
    address stops a relay: a process that passes the nonce on to the real server gets back a
    proof for the real server's address, not its own."""
    message = _PROOF_CONTEXT + nonce.encode() + b"\0" + address.encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def new_nonce() -> str:
    return secrets.token_hex(16)


def proves(answer: object, key: str, nonce: str, address: str) -> bool:
    """Whether a server's answer on ``PROOF_PATH`` holds ``proof(key, nonce, address)``
    (compared as bytes: ``compare_digest`` refuses a str that is not ASCII)."""
    proofs = answer.get("proofs") if isinstance(answer, dict) else None
    want = proof(key, nonce, address).encode()
    return isinstance(proofs, list) and any(
        isinstance(p, str) and hmac.compare_digest(p.encode("utf-8", "replace"), want)
        for p in proofs
    )


def _canonical_ip(host: str) -> str | None:
    """A numeric address as both ends write it (an IPv4-mapped IPv6 address, which a
    dual-stack socket reports, as IPv4; no zone); None for anything else."""
    try:
        ip = ipaddress.ip_address(str(host).split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.compressed


def canonical_address(host: str, port: int | None) -> str:
    """``ip:port`` (``[ip]:port`` for IPv6), as the proof binds it."""
    ip = _canonical_ip(host)
    return f"{host}:{port}" if ip is None else f"{url_host(ip)}:{port}"


def url_host(ip: str) -> str:
    """``ip`` as the host of a URL (brackets around IPv6)."""
    return f"[{ip}]" if ":" in ip else ip


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


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "is still running"
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


class ServerProcess:
    """Start ``cmd`` in its own process group with its output in ``log_path``."""

    def __init__(
        self,
        cmd: Sequence[str],
        env: Mapping[str, str],
        log_path: str | Path,
        stop_timeout_s: float = 30.0,
    ) -> None:
        self.cmd, self.env = list(cmd), dict(env)
        self.log_path = Path(log_path)
        self.stop_timeout_s = float(stop_timeout_s)
        self.proc: subprocess.Popen | None = None

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
        return describe_exit(None if self.proc is None else self.proc.poll())

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
    return [
        sys.executable,
        "-m",
        LAUNCHER,
        "--model",
        model,
        "--host",
        url_host,
        "--port",
        str(port),
        "--enable-scale-out",
        "--logprobs-mode",
        "processed_logprobs",
        "--weight-transfer-config",
        json.dumps({"backend": BACKEND}),
        *args,
    ]


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
