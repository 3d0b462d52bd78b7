"""Rollouts from a separate vLLM server (``rollout=vllm_server``; docs/rollout.md).

The server is one the run starts (``mrtpo.rollout.vllm_serve``) or an existing one at
``rollout.engine.url``; it must prove that it holds the run's key (``_prove``), answer
``/health`` and pass the start-up checks. Samples come from ``/inference/v1/generate``; after
every update the weights go as safetensors files through vLLM's RL routes, each push one
weight version. A failed request ends the run with one line saying what happened.

Its seams: ``server_process`` starts and stops the process, proves and checks the server and
words its failures, ``server_client`` sends the requests, ``server_answers`` checks what it
returns, ``snapshots`` writes and removes the weight files.
This module holds the engine's settings, its life, its weight pushes and generation.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from mrtpo.distributed import Ranks
from mrtpo.rollout import server_answers, snapshots
from mrtpo.rollout.base import Generation, RolloutEngine, SamplingConfig
from mrtpo.rollout.server_client import RequestFailed, ServerClient
from mrtpo.rollout.server_process import (
    BACKEND,
    ServerChecks,
    ServerProcess,
    VLLMServerError,
    _policy_config,
    free_port,
    is_loopback,
    launch_command,
    new_key,
    owned_argument,
    port_in_use,
    resolve,
)
from mrtpo.rollout.vllm import DEVICES, VLLMEngine, cpu_batch_tokens, engine_dtype, torch_dtype
from mrtpo.rollout.vllm_serve import url_host
from mrtpo.rollout.weight_sync import SyncStats, buckets, exported_weights, gathered
from mrtpo.safe_files import make_dirs

log = logging.getLogger(__name__)


class VLLMServerEngine(ServerChecks, RolloutEngine):
    """Generation by a vLLM server behind the ``RolloutEngine`` protocol. Its arguments are
    the ``rollout.engine`` keys, each explained in ``configs/rollout/vllm_server.yaml``;
    ``api_key_env`` names the key's environment variable, never the key (the config is saved
    in the run folder)."""

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
        ranks = Ranks()
        rank, world = ranks.rank, ranks.world_size
        error: Exception | None = None
        if rank == 0:
            try:
                self._start_here()
            except Exception as exc:
                if world == 1:
                    raise
                error = exc
        if world > 1:
            dtype = self._push_dtype and str(self._push_dtype)
            url, mode, dtype, failed, key = ranks.broadcast(
                (self.url, self.logprobs_mode, dtype, error and str(error), self._key)
            )
            if error is not None:
                raise error
            if failed is not None:
                raise VLLMServerError(f"rank 0 could not start the vLLM server: {failed}")
            if rank != 0:
                self.url, self.logprobs_mode, self._key = url, mode, key
                self._push_dtype = torch_dtype(dtype)
                self.client = ServerClient(url, key, self.request_timeout_s, self.max_concurrency)
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
            self._check_place()  # the folder may have gone since the engine was built
            self._root = Path(self.weight_dir)
        self._pushes = snapshots.make_folder(snapshots.PUSHES, self._root)
        atexit.register(self._remove_snapshots)

    # -- the started server ------------------------------------------------------------------

    def _device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if (self.devices or torch.cuda.is_available()) else "cpu"

    def server_arguments(self) -> list[str]:
        """The ``vllm serve`` arguments of a started server (besides ``launch_command``'s)."""
        cpu = self._device() == "cpu"
        args = ["--dtype", engine_dtype(self.dtype, self._device(), self._policy)]
        args += ["--seed", str(self.seed), "--tensor-parallel-size", str(self.tensor_parallel_size)]
        args.append(f"--{'' if self.enable_prefix_caching else 'no-'}enable-prefix-caching")
        if self.max_model_len is not None:
            args += ["--max-model-len", str(int(self.max_model_len))]
        kv = 1.0 if cpu and not self.kv_cache_gb else self.kv_cache_gb  # CPU: 1 GiB by default
        if kv is not None:
            args += ["--kv-cache-memory-bytes", str(int(float(kv) * (1 << 30)))]
        if cpu:
            # as for the in-process engine (mrtpo.rollout.vllm): no CUDA graphs, and whole
            # prompts per step (seeded requests fail under chunked prefill)
            tokens = cpu_batch_tokens(self.max_model_len, self.model)
            args += ["--enforce-eager", "--no-enable-chunked-prefill"]
            args += ["--max-num-batched-tokens", str(tokens)]
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

    # -- weights -----------------------------------------------------------------------------

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push ``model``'s weights (LoRA merged, FSDP shards gathered) as one new version.
        Every rank walks the same buckets (gathering shards is a collective); rank 0 writes
        and pushes them, then tells the others how it went, so no rank samples before the
        server holds the new version."""
        client = self.start()
        ranks = Ranks()
        rank, world = ranks.rank, ranks.world_size
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
            message = ranks.broadcast(error and str(error))  # rank 0's, on every rank
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
        name = snapshots.write_snapshot(folder, index, tensors)
        return str((folder / name).relative_to(self._root))

    def _post_push(self, client: ServerClient, files: list[str], version: int) -> None:
        """The RL routes of one push. A refused push is closed on the server (a second
        ``/finish_weight_update``), so that the server can take the next one."""
        try:
            client.post("/start_weight_update")
            client.post("/update_weights", {"update_info": {"files": files}})
            client.post("/finish_weight_update", {"weight_version": str(version)})
            client.post("/reset_prefix_cache")
        except RequestFailed as exc:
            if exc.kind == "refused":
                with contextlib.suppress(RequestFailed):
                    client.post("/finish_weight_update", timeout_s=60)
            raise self._failure(f"the weight push of version {version}", exc) from None

    # -- generation --------------------------------------------------------------------------

    # as the in-process engine's: a started server has --logprobs-mode processed_logprobs
    reports_sampling_logprobs = VLLMEngine.reports_sampling_logprobs
    prompt_requests = VLLMEngine.prompt_requests
    sampling_params = VLLMEngine.sampling_fields  # as JSON

    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int
    ) -> list[Generation]:
        """``n`` samples per prompt, one request per prompt, sent together."""
        if not prompts:
            return []
        client = self.start()
        want = self.reports_sampling_logprobs(sampling)
        asks = self.prompt_requests(prompts, n, sampling, seed, want)
        bodies = [{"token_ids": ids, "sampling_params": params} for ids, params in asks]

        # not a `with` block: a failure or an interrupt must not wait for the other requests
        pool = ThreadPoolExecutor(min(len(bodies), self.max_concurrency))
        try:
            sent = [pool.submit(client.post, "/inference/v1/generate", b) for b in bodies]
            answers = [f.result() for f in sent]
        except RequestFailed as exc:
            raise self._failure("generation", exc) from None
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        # the checked samples of each answer (mrtpo.rollout.server_answers)
        check = (n, int(sampling.max_new_tokens), self.vocab_size, want, self.weight_version)
        answer_gens = (
            self._call(server_answers.generations, a, *check, what="generation") for a in answers
        )
        return [g for gens in answer_gens for g in gens]
