"""Copy the trainer's weights into a running ``vllm.LLM``, whatever vLLM release is installed.

The adapter picks a path by what the installed ``LLM`` offers, in this order (signatures read
from the vLLM sources, vllm-project/vllm on GitHub):

1. ``weight_transfer``: the RL weight-transfer API (``vllm/entrypoints/llm.py``), with the
   engine built with ``weight_transfer_config=WeightTransferConfig(backend="ipc")``:
   ``init_weight_transfer_engine({"init_info": {}})`` once, then per sync
   ``start_weight_update()`` (older releases lack it; some take ``is_checkpoint_format``),
   ``update_weights({"update_info": ...})`` per bucket, ``finish_weight_update()``. The IPC
   ``update_info`` (``IPCWeightTransferUpdateInfo``) holds ``names``, ``dtype_names``,
   ``shapes`` and ``ipc_handles`` (``{gpu_uuid: reduce_tensor(t)}`` per tensor) or, in newer
   releases, ``ipc_handles_pickled``; both need ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.
2. ``reload_weights``: ``LLM.collective_rpc("reload_weights", kwargs=...)``, which recent
   workers forward to ``GPUModelRunner.reload_weights(weights_iterator=...)``; older ones only
   re-read the disk, so the runner's signature is inspected first. The weights cross a
   process boundary: one list of CPU tensors.
3. ``load_weights``: the legacy in-process ``model_runner.model.load_weights(iter)``, reachable
   only with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``.

Every sync ends with ``LLM.reset_prefix_cache()``: cached KV blocks hold the old weights'.

Weights leave in Hugging Face naming (``model.state_dict()``); a PEFT model's adapted weights
go as ``W + Δ`` (``MergedWeight``), computed out of place, so the frozen base never changes.
Under ``trainer=fsdp`` each rank casts its shards to the engine's dtype and all-gathers one
bucket of at most ``bucket_bytes`` at a time (``DTensor.full_tensor``, a collective in the
same order on every rank): a rank's extra memory is one bucket. ``reload_weights`` needs every
tensor in one call, so there the gathered buckets collect in CPU memory.
"""

from __future__ import annotations

import base64
import dataclasses
import inspect
import logging
import pickle
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import EllipsisType
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

log = logging.getLogger(__name__)

MODES = ("weight_transfer", "reload_weights", "load_weights")

_PEFT_PREFIX = "base_model.model."
_COMPILE_PREFIX = "_orig_mod."
_MODULES_TO_SAVE = re.compile(r"\.modules_to_save\.[^.]+\.")


@dataclass
class SyncStats:
    mode: str
    num_tensors: int
    num_bytes: int
    seconds: float


# -- exporting the trainer's weights -------------------------------------------------------------


def hf_name(key: str, peft: bool) -> str | None:
    """Map a state-dict key to the base model's checkpoint name; None drops the tensor.
    PEFT keys look like ``base_model.model.<name>``, adapted layers keep their weight under
    ``.base_layer.``, the adapter matrices are not part of the base checkpoint, and
    ``modules_to_save`` keeps a trained copy next to the ``original_module``."""
    while key.startswith(_COMPILE_PREFIX):
        key = key[len(_COMPILE_PREFIX) :]
    key = key.replace("." + _COMPILE_PREFIX, ".")
    if not peft:
        return key
    if ".lora_" in key or key.startswith("lora_") or ".original_module." in key:
        return None
    if key.startswith(_PEFT_PREFIX):
        key = key[len(_PEFT_PREFIX) :]
    key = key.replace(".base_layer.", ".")
    return _MODULES_TO_SAVE.sub(".", key)


class MergedWeight:
    """A LoRA layer's weight as the engine must see it, ``W + Δ``, computed when a bucket is
    gathered (``materialize``), never written into the model: an in-place merge and unmerge
    leaves rounding residue in the frozen base (measured: up to 7.5e-9 per sync in fp32,
    whole ulps in bf16), which would drift a little at every step."""

    def __init__(self, layer, base: torch.Tensor) -> None:
        self.layer, self.base = layer, base

    def numel(self) -> int:
        return self.base.numel()

    def element_size(self) -> int:
        return self.base.element_size()

    def materialize(self) -> torch.Tensor:
        delta = None
        for adapter in self.layer.active_adapters:
            if adapter in self.layer.lora_A:
                d = self.layer.get_delta_weight(adapter)
                delta = d if delta is None else delta + d
        w = self.base.detach()
        return w if delta is None else (w + delta).to(w.dtype)


def merged_weights(model: torch.nn.Module) -> dict[str, MergedWeight]:
    """State-dict key of each adapted layer's base weight -> its ``MergedWeight``."""
    from peft.tuners.lora import LoraLayer

    return {
        f"{name}.base_layer.weight": MergedWeight(mod, mod.get_base_layer().weight)
        for name, mod in model.named_modules()
        if isinstance(mod, LoraLayer) and not getattr(mod, "merged", False)
    }


@contextmanager
def exported_weights(model: torch.nn.Module) -> Iterator[list[tuple[str, object]]]:
    """``(name, tensor)`` pairs in checkpoint naming, valid inside the ``with`` block; a PEFT
    model's adapted weights are ``MergedWeight``s (the model is never modified)."""
    peft = all(callable(getattr(model, m, None)) for m in ("merge_adapter", "unmerge_adapter"))
    merged = merged_weights(model) if peft else {}
    pairs: list[tuple[str, object]] = []
    for key, tensor in model.state_dict().items():
        name = hf_name(key, peft)
        if name is not None:
            pairs.append((name, merged.get(key, tensor.detach())))
    yield pairs


def is_shard(t: torch.Tensor) -> bool:
    """A DTensor (an FSDP2 parameter): this rank holds a piece, ``full_tensor`` gathers it."""
    return callable(getattr(t, "full_tensor", None)) and callable(getattr(t, "to_local", None))


def gathered(
    group: Sequence[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
) -> list[tuple[str, torch.Tensor]]:
    """One bucket with every shard all-gathered into its full tensor, cast to ``dtype`` first
    (so an fp32 trainer moves bf16 bytes). A collective when the bucket holds shards: every
    rank must call it with the same bucket."""
    out = []
    for name, t in group:
        if isinstance(t, MergedWeight):
            t = t.materialize()
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        out.append((name, t.full_tensor() if is_shard(t) else t))
    return out


def buckets(
    pairs: Sequence[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Split the weights into groups of at most ``max_bytes`` (a larger tensor goes alone);
    a shard counts at its full size (``numel`` of a DTensor is the global one)."""
    group: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in pairs:
        nbytes = t.numel() * t.element_size()
        if group and size + nbytes > max_bytes:
            yield group
            group, size = [], 0
        group.append((name, t))
        size += nbytes
    if group:
        yield group


# -- feature detection ---------------------------------------------------------------------------


def has_weight_transfer_api(llm_or_cls: Any) -> bool:
    return callable(getattr(llm_or_cls, "init_weight_transfer_engine", None)) and callable(
        getattr(llm_or_cls, "update_weights", None)
    )


def reload_weights_params() -> frozenset[str] | None:
    """Keyword names the installed worker's ``reload_weights`` accepts, or None when it
    cannot take weights from memory (vLLM missing, or a release that only re-reads disk)."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        from vllm.v1.worker.gpu_worker import Worker

        runner = inspect.signature(GPUModelRunner.reload_weights).parameters
        worker = inspect.signature(Worker.reload_weights).parameters
    except Exception:  # no vLLM, or a release without the method
        return None
    forwards = "weights_iterator" in worker or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in worker.values()
    )
    if "weights_iterator" not in runner or not forwards:
        return None
    return frozenset(runner)


def ipc_supports_pickled_handles() -> bool:
    """Newer ``IPCWeightTransferUpdateInfo`` accepts the handles as one pickled string."""
    try:
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

        fields = dataclasses.fields(IPCWeightTransferUpdateInfo)
    except Exception:
        return False
    return "ipc_handles_pickled" in {f.name for f in fields}


def driver_model(llm: Any) -> Any:
    """The in-process vLLM ``nn.Module`` (legacy path), or raise saying how to expose it."""
    try:
        worker = llm.llm_engine.model_executor.driver_worker
    except AttributeError as exc:
        raise RuntimeError(
            "vLLM's model is not reachable in this process (llm.llm_engine.model_executor is "
            "missing): the legacy load_weights sync needs VLLM_ENABLE_V1_MULTIPROCESSING=0 "
            "set before the engine starts, or a vLLM release with the weight-transfer API "
            "(set rollout.engine.weight_sync=auto)."
        ) from exc
    for holder in (worker, getattr(worker, "worker", None)):
        runner = getattr(holder, "model_runner", None)
        model = getattr(runner, "model", None)
        if model is not None and callable(getattr(model, "load_weights", None)):
            return model
    raise RuntimeError("vLLM driver worker has no model_runner.model.load_weights")


def _current_gpu_uuid() -> str:
    index = torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


# -- the adapter ---------------------------------------------------------------------------------


class WeightSync:
    """Pushes a ``torch.nn.Module``'s weights into ``llm`` (a started ``vllm.LLM``) through
    one supported path: ``mode`` ``auto`` detects it, one of ``MODES`` forces it.

    ``dtype``: floating tensors are cast to it before sending (an fp32 trainer sends a bf16
    engine half the bytes). ``bucket_bytes``: the most per ``update_weights`` call (the extra
    memory of the cast copies, and under FSDP of one all-gather). ``transfer_configured``:
    whether the engine was built with a ``weight_transfer_config`` (the API exists either way
    and only works then; None reads the engine's config). ``prefer_reload``: try
    ``reload_weights`` first (tensor parallel: IPC handles name only the trainer's GPU).
    ``reload_params``: the keywords the worker's ``reload_weights`` accepts, None when it
    cannot take weights from memory (``...``: inspect vLLM); ``pickled_handles``: send IPC
    handles pickled (newer vLLM; None inspects vLLM).
    """

    def __init__(
        self,
        llm: Any,
        mode: str = "auto",
        *,
        dtype: torch.dtype | None = None,
        bucket_bytes: int = 1 << 30,
        transfer_configured: bool | None = None,
        prefer_reload: bool = False,
        reload_params: frozenset[str] | EllipsisType | None = ...,  # ...: inspect vLLM
        pickled_handles: bool | None = None,
    ) -> None:
        if mode != "auto" and mode not in MODES:
            raise ValueError(
                f"rollout.engine.weight_sync={mode!r} is not a sync path; use auto or one of {MODES}"
            )
        self.llm = llm
        self.dtype = dtype
        self.bucket_bytes = int(bucket_bytes)
        self._reload_params = reload_weights_params() if reload_params is ... else reload_params
        self._pickled = (
            ipc_supports_pickled_handles() if pickled_handles is None else pickled_handles
        )
        if transfer_configured is None:  # read the engine's config; cannot tell: trust the API
            config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
            transfer_configured = getattr(config, "weight_transfer_config", True) is not None
        self._transfer_configured = transfer_configured
        self._transfer_ready = False
        self.mode = self._choose(mode, prefer_reload)
        self.num_syncs = 0
        log.info("vLLM weight sync path: %s", self.mode)

    # -- detection ---------------------------------------------------------------------------

    def available(self) -> dict[str, bool]:
        """Which paths this engine supports (what ``auto`` chooses from)."""
        legacy = True
        try:
            driver_model(self.llm)
        except RuntimeError:
            legacy = False
        return {
            "weight_transfer": has_weight_transfer_api(self.llm) and self._transfer_configured,
            "reload_weights": callable(getattr(self.llm, "collective_rpc", None))
            and self._reload_params is not None,
            "load_weights": legacy,
        }

    def _choose(self, mode: str, prefer_reload: bool) -> str:
        avail = self.available()
        if mode != "auto":
            if not avail[mode]:
                raise RuntimeError(
                    f"rollout.engine.weight_sync={mode} is not supported by the installed vLLM "
                    f"for this engine (supported here: {[m for m, ok in avail.items() if ok]}); "
                    "set rollout.engine.weight_sync=auto"
                )
            return mode
        order = ("reload_weights", "weight_transfer", "load_weights") if prefer_reload else MODES
        for m in order:
            if avail[m]:
                return m
        raise RuntimeError(
            "no way to update weights in this vLLM engine: it has neither the weight-transfer "
            "API (init_weight_transfer_engine/update_weights with weight_transfer_config), nor "
            "a worker reload_weights that accepts weights_iterator, nor an in-process model "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0). Install a newer vLLM (`pip install 'mrtpo[vllm]'`)."
        )

    # -- sync --------------------------------------------------------------------------------

    def sync(self, model: torch.nn.Module) -> SyncStats:
        """Copy ``model``'s current weights into the engine, then reset its prefix cache."""
        t0 = time.perf_counter()
        with exported_weights(model) as pairs:
            num_bytes = sum(t.numel() * t.element_size() for _, t in pairs)
            getattr(self, f"_sync_{self.mode}")(pairs)  # one method per path of MODES
        ok = self.llm.reset_prefix_cache()
        if ok is False:
            log.warning("vLLM refused to reset its prefix cache after a weight sync")
        self.num_syncs += 1
        return SyncStats(self.mode, len(pairs), num_bytes, time.perf_counter() - t0)

    def _sync_weight_transfer(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        llm = self.llm
        if not self._transfer_ready:
            llm.init_weight_transfer_engine({"init_info": {}})  # IPC needs no init info
            self._transfer_ready = True
        start = getattr(llm, "start_weight_update", None)
        finish = getattr(llm, "finish_weight_update", None)
        if callable(start):  # a few releases take is_checkpoint_format
            takes = "is_checkpoint_format" in inspect.signature(start).parameters
            start(**({"is_checkpoint_format": True} if takes else {}))
        cuda = torch.cuda.is_available()
        for group in buckets(pairs, self.bucket_bytes):
            # IPC shares device memory, so every tensor must live on this GPU, contiguous; the
            # copies must stay referenced until update_weights has returned. Shards are
            # gathered here, one bucket at a time (a collective over the FSDP ranks).
            staged = []
            for name, t in gathered(group, self.dtype):
                if cuda and not t.is_cuda:
                    t = t.to("cuda", non_blocking=True)
                staged.append((name, t.contiguous()))
            if cuda:
                torch.cuda.synchronize()  # the engine process reads on its own stream
            llm.update_weights({"update_info": self._ipc_update_info(staged)})
            del staged
        if callable(finish):
            finish()
        if cuda:
            torch.cuda.ipc_collect()  # free the shared copies once the engine let go of them

    def _ipc_update_info(self, staged: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        uuid = _current_gpu_uuid()
        handles = [{uuid: reduce_tensor(t)} for _, t in staged]
        info: dict[str, Any] = {
            "names": [n for n, _ in staged],
            "dtype_names": [str(t.dtype).split(".")[-1] for _, t in staged],
            "shapes": [list(t.shape) for _, t in staged],
        }
        if self._pickled:
            info["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(handles)).decode("ascii")
        else:
            info["ipc_handles"] = handles
        return info

    def _sync_reload_weights(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        # One call with every tensor: a reload restarts the model's layer-wise loading, so a
        # partial set would leave layers without weights. Shards are gathered a bucket at a
        # time and each bucket moves to CPU memory before the next is gathered.
        weights = [
            (n, t.to("cpu").contiguous())
            for group in buckets(pairs, self.bucket_bytes)
            for n, t in gathered(group, self.dtype)
        ]
        kwargs: dict[str, Any] = {"weights_iterator": weights}
        if self._reload_params and "is_checkpoint_format" in self._reload_params:
            kwargs["is_checkpoint_format"] = True
        self.llm.collective_rpc("reload_weights", kwargs=kwargs)

    def _sync_load_weights(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        # Same process: the vLLM weight loaders copy (and cast) from our tensors directly, so
        # plain tensors go as they are; shards are gathered lazily, a bucket at a time, as the
        # loader consumes them.
        if not any(is_shard(t) or isinstance(t, MergedWeight) for _, t in pairs):
            driver_model(self.llm).load_weights(iter(pairs))
            return
        stream = (
            p for group in buckets(pairs, self.bucket_bytes) for p in gathered(group, self.dtype)
        )
        driver_model(self.llm).load_weights(stream)
