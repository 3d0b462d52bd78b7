"""Rollouts from a separate vLLM server (``rollout=vllm_server``).

The engine is a real ``vllm serve`` process, started by the run (``mrtpo.rollout.vllm_serve``
on the cores or GPUs the config names, listening on 127.0.0.1) or an existing one given by
``rollout.engine.url``. At start the engine asks the server to prove that it holds the run's
key (a started server gets a fresh one; ``_prove``), then waits for ``/health`` and checks
that the server can take this run: it has the RL routes (``VLLM_SERVER_DEV_MODE=1``), the
``mrtpo_file`` weight-transfer backend and the token-in/token-out route (``--enable-scale-out``),
it serves the policy's architecture, and its tokenizer splits text as the policy's does.

Samples come from ``/inference/v1/generate`` (token ids in, token ids and their log-probs
out, and the weight version that sampled each token). After every update the weights go
through vLLM's RL routes: the trainer writes them as safetensors files into a folder the
server also reads (``rollout.engine.weight_dir``; the tied ``lm_head.weight`` included), and
calls ``/start_weight_update``, ``/update_weights`` (the file names),
``/finish_weight_update`` (the new version) and ``/reset_prefix_cache``. Each push counts
one weight version (``weight_version``); each ``Generation`` carries the version that
sampled it. docs/rollout.md says why this path and what it costs.

Every request has a timeout. A failed one ends the run with one line saying what happened:
the server the run started died (and how), the server cannot be reached, it did not answer
in time, or it refused (its message). A server the run started is stopped by ``close``, at
interpreter exit, and when the trainer dies (``mrtpo.rollout.server_process``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from mrtpo.core.errors import CompactHydraException
from mrtpo.core.sampling import vllm_sampling_fields
from mrtpo.rollout import server_answers, snapshots
from mrtpo.rollout.base import Generation, RolloutEngine, SamplingConfig
from mrtpo.rollout.server_answers import BadAnswer, as_object, field
from mrtpo.rollout.server_client import RequestFailed, ServerClient, write_snapshot
from mrtpo.rollout.server_process import (
    ServerProcess,
    ask_proof,
    free_port,
    is_loopback,
    new_key,
    new_nonce,
    port_in_use,
    proves,
    resolve,
    url_host,
)
from mrtpo.rollout.vllm import _model_config, prompt_seed
from mrtpo.rollout.weight_sync import SyncStats, buckets, exported_weights, gathered
from mrtpo.safe_files import make_dirs

log = logging.getLogger(__name__)

LAUNCHER = "mrtpo.rollout.vllm_serve"
BACKEND = "mrtpo_file"  # mrtpo.rollout.vllm_file_transfer.BACKEND (that module imports vLLM)
DEVICES = ("auto", "cpu", "cuda")
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
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PROBE = [{"role": "user", "content": "Write three words about rivers, then stop."}]
PROBE_TOP = 5  # top log-probs per token in the log-prob probe (vLLM allows 20 by default)


class VLLMServerError(CompactHydraException, RuntimeError):
    """The vLLM server died, cannot be reached, did not answer in time, refused a request,
    or cannot serve this run. Its message is one line (Hydra prints it alone)."""


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


def _ranks() -> tuple[int, int]:
    """(rank, world size) of the training processes; (0, 1) without torch.distributed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _from_rank0(value: Any) -> Any:
    """``value`` as rank 0 has it, on every rank (a collective)."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _text(error: BaseException | None) -> str | None:
    return None if error is None else f"{error}"


class VLLMServerEngine(RolloutEngine):
    """Generation by a vLLM server behind the ``RolloutEngine`` protocol.

    Args:
        model: what a started server loads (``${model.name_or_path}``).
        url: an existing server (``http://host:port``); None: the run starts one.
        host, port: where a started server listens (port None: a free one). A host other
            than loopback needs an API key: the server's RL and development routes can load
            files into the model and call methods on its workers.
        api_key_env: the environment variable that holds the API key (never the key itself:
            the config is saved in the run folder).
        cpus: cores of a started server (CPU build: it and its OpenMP threads stay there).
        devices: GPUs of a started server (``CUDA_VISIBLE_DEVICES``).
        device: ``auto`` (CUDA when torch sees one), ``cpu`` or ``cuda``: which build's
            defaults a started server gets.
        dtype: None: bfloat16 on GPUs, the policy's dtype on CPU.
        kv_cache_gb: a fixed KV cache (None: 1 GiB on CPU, vLLM's share of memory on GPUs).
        weight_dir: where the weight snapshots go, a folder the server also reads (the same
            machine, or a shared filesystem); None: a temporary folder (a started server).
        sync_bucket_mb: megabytes per snapshot file (under FSDP, gathered at once).
        server_args: further ``vllm serve`` arguments for a started server.
        start_timeout_s, request_timeout_s, stop_timeout_s: how long to wait for health at
            start, for any one request, and for a stopped server to exit before SIGKILL.
        log_file: a started server's output (None: ``server.log`` in its weight folder).
    """

    generates_apart = True  # its own process and weights: schedules may overlap it

    def __init__(
        self,
        model: str,
        url: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        api_key_env: str = "VLLM_API_KEY",
        cpus: Sequence[int] | None = None,
        devices: Sequence[int] | None = None,
        device: str = "auto",
        dtype: str | None = None,
        kv_cache_gb: float | None = None,
        max_model_len: int | None = None,
        tensor_parallel_size: int = 1,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        weight_dir: str | None = None,
        sync_bucket_mb: int = 1024,
        sync_on_bind: bool = True,
        per_request_seed: bool = True,
        stop_token_ids: Sequence[int] | None = None,
        max_concurrency: int = 64,
        server_args: Sequence[str] | None = None,
        start_timeout_s: float = 900.0,
        request_timeout_s: float = 600.0,
        stop_timeout_s: float = 30.0,
        log_file: str | None = None,
    ) -> None:
        self.model, self.url = str(model), (str(url).rstrip("/") if url else None)
        self.host, self.port = str(host), port
        self._bind_host = self.host  # its one numeric address (resolved in _check_settings)
        self.api_key_env = str(api_key_env)
        self.cpus = [int(c) for c in cpus] if cpus else []
        self.devices = [int(d) for d in devices] if devices else []
        self.device = str(device)
        self.dtype, self.max_model_len = dtype, max_model_len
        self.kv_cache_gb = kv_cache_gb
        self.tensor_parallel_size = int(tensor_parallel_size)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.seed = int(seed)
        self.weight_dir = weight_dir
        self.sync_bucket_bytes = int(sync_bucket_mb) << 20
        self.sync_on_bind, self.per_request_seed = bool(sync_on_bind), bool(per_request_seed)
        self.stop_token_ids = [int(t) for t in (stop_token_ids or [])]
        self.max_concurrency = int(max_concurrency)
        self.server_args = [str(a) for a in (server_args or [])]
        self.start_timeout_s, self.request_timeout_s = start_timeout_s, request_timeout_s
        self.stop_timeout_s = float(stop_timeout_s)
        self.log_file = log_file
        self._check_settings()
        self._unbound()

    def _unbound(self) -> None:
        """The state ``bind`` and the server fill in, before they have."""
        self.eos_ids: list[int] = []
        self.weight_version = 0  # pushes so far; the server's version after the last one
        self.last_sync: SyncStats | None = None
        self.startup_seconds: float | None = None
        self.process: ServerProcess | None = None
        self.client: ServerClient | None = None
        self._key: str | None = None  # the run's key, sent once the server proved it holds it
        self.logprobs_mode: str | None = None
        self.vocab_size: int | None = None  # token ids of an answer must be below it
        self._push_dtype: torch.dtype | None = None
        self._policy: torch.nn.Module | None = None
        self._tokenizer: Any = None
        self._root: Path | None = None  # the folder the server reads weights from
        self._pushes: Path | None = None  # this engine's folder inside it
        self._own_root = False

    # -- settings ----------------------------------------------------------------------------

    @property
    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) or None

    def _check_settings(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(self.device in DEVICES, f"rollout.engine.device={self.device!r}: use one of {DEVICES}")
        owned = owned_argument(self.server_args)
        need(owned is None, str(owned))
        for key in ("start_timeout_s", "request_timeout_s"):
            value = getattr(self, key)
            need(
                isinstance(value, (int, float)) and 0 < value <= 86400,
                f"rollout.engine.{key}={value!r}: use a number of seconds in (0, 86400]",
            )
        need(self.max_concurrency >= 1, "rollout.engine.max_concurrency: use an integer >= 1")
        if self.url is not None:
            need(
                self.url.startswith(("http://", "https://")),
                f"rollout.engine.url={self.url!r}: use http://host:port (or https://)",
            )
            need(
                self.weight_dir is not None,
                "rollout.engine.url is set but rollout.engine.weight_dir is not: name the "
                "folder that this machine and the server both see (the server's "
                "MRTPO_WEIGHT_ROOT; docs/scaling.md)",
            )
            for key in ("cpus", "devices", "server_args"):
                need(
                    not getattr(self, key),
                    f"rollout.engine.{key} applies to a server the run starts, and "
                    "rollout.engine.url names an existing one: drop one of them",
                )
            return
        try:
            self._bind_host = resolve(self.host)
        except ValueError as exc:
            raise ValueError(f"rollout.engine.host={self.host}: {exc}") from None
        need(
            is_loopback(self._bind_host) or self.api_key is not None,
            f"rollout.engine.host={self.host} would expose the server beyond this machine "
            f"without an API key, and its RL and development routes load files into the model "
            f"and call methods on its workers: set the key in the environment variable "
            f"{self.api_key_env} (rollout.engine.api_key_env), or use host=127.0.0.1",
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def bind(self, model: torch.nn.Module, tokenizer: Any, eos_ids: Sequence[int]) -> None:
        """Remember the policy, start (or reach) the server and check it; push the policy's
        weights when ``sync_on_bind`` (a resumed run never samples from the file's weights)."""
        self._policy, self._tokenizer = model, tokenizer
        self.eos_ids = [int(t) for t in eos_ids]
        vocab = _policy_config(model).get("vocab_size")
        self.vocab_size = int(vocab) if isinstance(vocab, int) and vocab > 0 else None
        self.start()
        if self.sync_on_bind:
            self.sync_weights(model)

    def start(self) -> ServerClient:
        """Start or reach the server once, wait for its health and check it. With several
        training processes, rank 0 does it and tells the others where the server is."""
        if self.client is not None:
            return self.client
        rank, world = _ranks()
        error: Exception | None = None
        if rank == 0:
            try:
                self._start_here()
            except Exception as exc:
                if world == 1:
                    raise
                error = exc
        if world > 1:
            dtype = None if self._push_dtype is None else str(self._push_dtype)
            shared = _from_rank0((self.url, self.logprobs_mode, dtype, _text(error), self._key))
            if error is not None:
                raise error
            if shared[3] is not None:
                raise VLLMServerError(f"rank 0 could not start the vLLM server: {shared[3]}")
            if rank != 0:
                self.url, self.logprobs_mode, self._key = shared[0], shared[1], shared[4]
                self._push_dtype = (
                    getattr(torch, shared[2].removeprefix("torch.")) if shared[2] else None
                )
                self.client = ServerClient(self.url, self._key, self.request_timeout_s)
        assert self.client is not None
        return self.client

    def _start_here(self) -> None:
        t0 = time.perf_counter()
        try:
            self._prepare_weight_folder()
            self._key = self.api_key
            if self.url is None:
                self._launch()  # with a key of its own
            assert self.url is not None
            client = ServerClient(self.url, self._key, self.request_timeout_s)
            self._wait_healthy(client)
            self._check_server(client)
        except BaseException:
            self.close()
            raise
        self.client = client
        self.startup_seconds = time.perf_counter() - t0
        log.info("vLLM server %s ready in %.1f s", self.url, self.startup_seconds)

    def close(self) -> None:
        """Stop a server the run started and remove this engine's weight snapshots."""
        self.client = None
        process, self.process = self.process, None
        if process is not None:
            process.stop()
        self._remove_snapshots()

    def _remove_snapshots(self) -> None:
        """This engine's snapshot folder (its temporary root too); also at interpreter exit."""
        with contextlib.suppress(Exception):
            atexit.unregister(self._remove_snapshots)
        pushes, self._pushes = self._pushes, None
        snapshots.remove(pushes)
        if self._own_root:
            snapshots.remove(self._root)

    shutdown = close

    def _prepare_weight_folder(self) -> None:
        snapshots.remove_leftovers(self.weight_dir)  # of runs killed with SIGKILL
        if self.weight_dir is None:
            self._root, self._own_root = snapshots.make_folder(snapshots.OWN_ROOT), True
        else:
            self._root = Path(self.weight_dir)
            if not self._root.is_dir():
                raise ValueError(
                    f"rollout.engine.weight_dir={self.weight_dir}: no such folder (it must exist "
                    "and be readable by the server as its MRTPO_WEIGHT_ROOT)"
                )
        self._pushes = snapshots.make_folder(snapshots.PUSHES, self._root)
        atexit.register(self._remove_snapshots)

    # -- the started server ------------------------------------------------------------------

    def _device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if (self.devices or torch.cuda.is_available()) else "cpu"

    def _dtype(self) -> str:
        if self.dtype is not None:
            return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(
                str(self.dtype), str(self.dtype)
            )
        if self._device() == "cuda":
            return "bfloat16"
        params = self._policy.parameters() if self._policy is not None else iter(())
        dt = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
        return str(dt).removeprefix("torch.")

    def server_arguments(self) -> list[str]:
        """The ``vllm serve`` arguments of a started server (besides ``launch_command``'s)."""
        args = ["--dtype", self._dtype(), "--seed", str(self.seed)]
        args += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        args.append(
            "--enable-prefix-caching"
            if self.enable_prefix_caching
            else "--no-enable-prefix-caching"
        )
        if self.max_model_len is not None:
            args += ["--max-model-len", str(int(self.max_model_len))]
        if self._device() == "cpu":
            # as for the in-process engine (mrtpo.rollout.vllm): no CUDA graphs, a fixed KV
            # cache, and whole prompts per step (seeded requests fail under chunked prefill)
            longest = self.max_model_len or _model_config(self.model).get(
                "max_position_embeddings", 32768
            )
            kv = int(float(self.kv_cache_gb or 1.0) * (1 << 30))
            args += ["--enforce-eager", "--kv-cache-memory-bytes", str(kv)]
            args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens"]
            args.append(str(max(int(longest), 4096)))
        elif self.kv_cache_gb is not None:
            args += ["--kv-cache-memory-bytes", str(int(float(self.kv_cache_gb) * (1 << 30)))]
        return args + self.server_args

    def _server_env(self) -> dict[str, str]:
        env = dict(os.environ)
        # set for the in-process engine in this process; the server keeps vLLM's default
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env["MRTPO_WEIGHT_ROOT"] = str(self._root)
        env["MRTPO_SERVER_PARENT"] = str(os.getpid())
        if self.cpus:
            env["MRTPO_SERVER_CPUS"] = ",".join(map(str, self.cpus))
        if self.devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.devices))
        # the key goes by environment, which only this user can read (argv is world-readable)
        env["VLLM_API_KEY"] = str(self._key)
        return env

    def _launch(self) -> None:
        assert self._root is not None
        if self.model.startswith(("/", ".")) and not Path(self.model).is_dir():
            raise ValueError(
                f"rollout.engine.model={self.model}: no such folder for the server to load "
                "(it follows model.name_or_path)"
            )
        bind = self._bind_host
        if self.port and port_in_use(bind, int(self.port)):
            raise VLLMServerError(
                f"rollout.engine.port={self.port}: {url_host(bind)}:{self.port} is already in use by "
                "another process, and the run talks to the server it starts only: choose a free "
                "port, or leave rollout.engine.port unset (a free one)"
            )
        port = int(self.port) if self.port else free_port(bind)
        self._key = self.api_key or new_key()  # a fresh key unless the user set one
        cmd = launch_command(bind, port, self.model, self.server_arguments())
        log_path = Path(self.log_file) if self.log_file else self._root / "server.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.process = ServerProcess(cmd, self._server_env(), log_path, self.stop_timeout_s)
        log.info("starting the vLLM server: %s (log: %s)", " ".join(cmd), log_path)
        self.process.start()
        log.info("vLLM server started: pid %s", self.process.pid)
        shown = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(bind, bind)
        self.url = f"http://{url_host(shown)}:{port}"

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
        """The server at ``url`` must prove that it holds the run's key before it gets any
        request or the key: it answers a fresh nonce with ``proof(key, nonce, address)`` (an
        HMAC) on the one route that needs no key (``mrtpo.rollout.vllm_serve``), ``address``
        being where this connection reached it. A process that bound the port first sees the
        nonce alone and cannot answer it; one that relays it to the real server gets a proof
        for another address. Any answer but the proof stops the run; no answer yet (not
        listening, busy starting) is asked again. Returns the URL to use from now on: over
        http, the proven numeric address (a name resolved again may lead elsewhere)."""
        if self._key is None:
            log.warning("no API key in %s: the run cannot check that %s is the server meant "
                        "(and anyone who reaches it can call its RL routes)", self.api_key_env,
                        url)  # fmt: skip
            return url
        nonce = new_nonce()
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
        self._push_dtype = _TORCH_DTYPES.get(str(mcfg.get("dtype", "")).removeprefix("torch."))
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
            f"the vLLM server at {self.url} sent an answer the run cannot use during {what}: "
            f"{exc.detail}"
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
        if exc.kind == "refused":
            return VLLMServerError(
                f"the vLLM server at {self.url} refused {what} (HTTP {exc.status}: {exc.detail})"
            )
        if exc.kind == "timeout":
            return VLLMServerError(
                f"the vLLM server at {self.url} did not answer {what} within "
                f"{self.request_timeout_s:g} s (rollout.engine.request_timeout_s): {exc.detail}"
            )
        return VLLMServerError(
            f"the vLLM server at {self.url} cannot be reached during {what} ({exc.detail}): it "
            "is not running, or the network to it is down"
        )

    # -- weights -----------------------------------------------------------------------------

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push ``model``'s weights (LoRA merged, FSDP shards gathered) as one new version.

        Every training process walks the weights in the same buckets (gathering shards is a
        collective); rank 0 writes and pushes them, then tells the others how it went, so no
        rank samples before the server holds the new version."""
        client = self.start()
        rank, world = _ranks()
        t0 = time.perf_counter()
        version = self.weight_version + 1
        files: list[str] = []
        count = nbytes = 0
        error: Exception | None = None
        with exported_weights(model) as pairs:
            for i, group in enumerate(buckets(pairs, self.sync_bucket_bytes)):
                tensors = gathered(group, self._push_dtype)
                count += len(tensors)
                nbytes += sum(t.numel() * t.element_size() for _, t in tensors)
                if rank == 0 and error is None:
                    try:
                        files.append(self._write(version, i, tensors))
                    except Exception as exc:  # keep gathering with the other ranks
                        error = exc
                del tensors
        if rank == 0 and error is None:
            try:
                self._post_push(client, files, version)
            except Exception as exc:
                error = exc
        if world > 1:
            message = _from_rank0(_text(error))
            if error is None and message is not None:
                raise VLLMServerError(f"rank 0's weight push failed: {message}")
        if error is not None:
            raise error
        if self._pushes is not None:
            shutil.rmtree(self._pushes / f"v{self.weight_version:06d}", ignore_errors=True)
        self.weight_version = version
        self.last_sync = SyncStats(BACKEND, count, nbytes, time.perf_counter() - t0)

    def _write(self, version: int, index: int, tensors: list[tuple[str, torch.Tensor]]) -> str:
        """One snapshot file of push ``version``; its name relative to the server's folder."""
        assert self._pushes is not None and self._root is not None
        folder = self._pushes / f"v{version:06d}"
        make_dirs(folder, self._pushes)
        name = write_snapshot(folder, index, tensors)
        return str((folder / name).relative_to(self._root))

    def _post_push(self, client: ServerClient, files: list[str], version: int) -> None:
        """The RL routes of one push. A refused push is closed on the server (a second
        ``/finish_weight_update``), so that the server can take the next one."""
        what = f"the weight push of version {version}"
        try:
            client.post("/start_weight_update")
            client.post("/update_weights", {"update_info": {"files": files}})
            client.post("/finish_weight_update", {"weight_version": str(version)})
            client.post("/reset_prefix_cache")
        except RequestFailed as exc:
            if exc.kind == "refused":
                with contextlib.suppress(RequestFailed):
                    client.post("/finish_weight_update", timeout_s=60)
            raise self._failure(what, exc) from None

    # -- generation --------------------------------------------------------------------------

    def reports_sampling_logprobs(self, sampling: SamplingConfig) -> bool:
        """As the in-process engine: the server's log-probs are those of the sampling
        distribution with ``--logprobs-mode processed_logprobs`` (a started server has it)."""
        if sampling.greedy or sampling.temperature <= 0 or sampling.truncated:
            return False
        self.start()
        return self.logprobs_mode == "processed_logprobs" or float(sampling.temperature) == 1.0

    def sampling_params(
        self, sampling: SamplingConfig, n: int, seed: int | None, logprobs: bool
    ) -> dict[str, Any]:
        """vLLM ``SamplingParams`` as JSON (``mrtpo.core.sampling.vllm_sampling_fields``, as the
        in-process engine's)."""
        return vllm_sampling_fields(
            sampling, n, [*self.eos_ids, *self.stop_token_ids], seed, logprobs
        )

    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int
    ) -> list[Generation]:
        """``n`` samples per prompt, one request per prompt, sent together."""
        if not prompts:
            return []
        client = self.start()
        want = self.reports_sampling_logprobs(sampling)
        bodies = [
            {
                "token_ids": [int(t) for t in p],
                "sampling_params": self.sampling_params(
                    sampling, n, prompt_seed(seed, i) if self.per_request_seed else None, want
                ),
            }
            for i, p in enumerate(prompts)
        ]

        def send(body: dict) -> Any:
            return client.post("/inference/v1/generate", body)

        # not a `with` block: a failure or an interrupt must not wait for the other requests
        pool = ThreadPoolExecutor(min(len(bodies), self.max_concurrency))
        try:
            answers = [f.result() for f in [pool.submit(send, b) for b in bodies]]
        except RequestFailed as exc:
            raise self._failure("generation", exc) from None
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return [g for a in answers for g in self._generations(a, n, sampling, want)]

    def _generations(self, answer: Any, n: int, sampling: SamplingConfig, logprobs: bool
                     ) -> list[Generation]:  # fmt: skip
        """The checked samples of one answer (``mrtpo.rollout.server_answers``)."""
        return self._call(
            server_answers.generations, answer, n, int(sampling.max_new_tokens),
            self.vocab_size, logprobs, self.weight_version, what="generation",
        )  # fmt: skip
