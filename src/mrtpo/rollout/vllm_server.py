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

The engine is spread over the rollout wing along its seams: ``server_process`` starts and
stops the process (its command, the arguments the launcher owns, the key proof's HMAC),
``server_client`` sends the HTTP requests, ``server_checks`` proves and checks the server
and words its failures, ``server_answers`` checks what it returns, ``server_push`` pushes
the weights. This module holds the engine's settings, its life and generation.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from mrtpo.core.sampling import vllm_sampling_fields
from mrtpo.rollout import server_answers, snapshots
from mrtpo.rollout.base import Generation, RolloutEngine, SamplingConfig
from mrtpo.rollout.server_checks import ServerChecks, VLLMServerError, _policy_config
from mrtpo.rollout.server_client import RequestFailed, ServerClient
from mrtpo.rollout.server_process import (
    BACKEND,
    LAUNCHER,
    OWNED_ARGS,
    ServerProcess,
    free_port,
    is_loopback,
    launch_command,
    new_key,
    owned_argument,
    port_in_use,
    resolve,
    url_host,
)
from mrtpo.rollout.server_push import WeightPushes, _from_rank0, _ranks, _text
from mrtpo.rollout.vllm import _model_config, prompt_seed
from mrtpo.rollout.weight_sync import SyncStats

#: names other modules and the docs import from here
__all__ = [
    "BACKEND",
    "LAUNCHER",
    "OWNED_ARGS",
    "VLLMServerEngine",
    "VLLMServerError",
    "launch_command",
    "owned_argument",
]

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")


class VLLMServerEngine(ServerChecks, WeightPushes, RolloutEngine):
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
    checks_settings_when_built = True  # the server starts in bind, not here

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

    def _check_place(self) -> None:
        """``port`` a TCP port, ``weight_dir`` an existing folder (the run's checks build the
        engine to run these before anything loads: ``checks_settings_when_built``)."""
        port = self.port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                                 or not 1 <= port <= 65535):  # fmt: skip
            raise ValueError(
                f"rollout.engine.port={port!r} is not allowed: a TCP port from 1 to 65535, or "
                "null for a free one"
            )
        if self.weight_dir is not None and not os.path.isdir(str(self.weight_dir)):
            raise ValueError(
                f"rollout.engine.weight_dir={self.weight_dir}: no such folder (it must exist and "
                "be readable by the server as its MRTPO_WEIGHT_ROOT)"
            )

    def _check_settings(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        self._check_place()
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
                self.client = ServerClient(
                    self.url, self._key, self.request_timeout_s, self.max_concurrency
                )
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
            client = ServerClient(self.url, self._key, self.request_timeout_s, self.max_concurrency)
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
        client, self.client = self.client, None
        if client is not None:
            client.close()
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
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the in-process engine's, if set
        if self._device() == "cpu" and self.tensor_parallel_size == 1:
            # the engine core runs the model itself (vLLM's uni executor) instead of handing
            # each step to a worker process over shared memory: two processes share the
            # server's cores instead of three (measured: 5% less server CPU time per step)
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
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
