"""A vLLM weight-transfer backend, ``mrtpo_file``, that reads the trainer's weights from
safetensors files in a folder the trainer and the server both see (vLLM's own backends all need
GPUs); docs/rollout.md, "Weights through vLLM's RL routes". A layer that got none of its
weights (which vLLM only warns about) fails the push, naming it. Only the server imports it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "mrtpo_file"
ROOT_ENV = "MRTPO_WEIGHT_ROOT"


@dataclass
class FileInitInfo(WeightTransferInitInfo):
    """Nothing to agree on: the folder is fixed when the server starts."""


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    files: list[str] = field(default_factory=list)  # safetensors files below the root


def weight_file(root: str, name: str) -> Path:
    """``name`` inside ``root``, or ValueError: a request may only name files of that folder."""
    base = Path(root).resolve()
    path = (base / name).resolve()
    if not path.is_relative_to(base) or path.suffix != ".safetensors":
        raise ValueError(f"weight file {name!r} is not a .safetensors file inside {base}")
    return path


def layers_without_weights(model: torch.nn.Module) -> list[str]:
    """Layers with parameters of their own that a layerwise reload got no weight for.

    Layers holding only buffers (rotary tables) and attention layers (whose scales a
    checkpoint may leave out; vLLM restores them) are not counted."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    missing = []
    for name, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load() or is_deferred_attention_layer(layer):
            continue
        params, _buffers = info.restore_metadata
        if params and info.load_numel <= 0:
            missing.append(name or type(layer).__name__)
    return missing


class FileWeightTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    """Loads each pushed file into the model between start and finish of an update."""

    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.root = os.environ.get(ROOT_ENV)
        self.loaded = 0

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        if not self.root:
            raise RuntimeError(
                f"the {BACKEND} weight transfer needs the folder it reads from: start the "
                f"server with {ROOT_ENV}=<folder> (rollout=vllm_server does)"
            )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.loaded = 0
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        # The base class synchronizes torch.accelerator, which raises on a CPU-only server.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        from safetensors.torch import load_file
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        self.init_transfer_engine(FileInitInfo())
        for name in update_info.files:
            tensors = load_file(str(weight_file(self.root, name)), device=str(self.device))
            with disable_mtp_completeness_check():
                self.model.load_weights(list(tensors.items()))
            self.loaded += len(tensors)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        missing = layers_without_weights(self.model)
        finalize_layerwise_reload(self.model, self.model_config)
        if missing:
            raise RuntimeError(
                f"the weight push held no weights for {missing} ({self.loaded} tensors "
                "loaded): those layers kept their old values. The trainer must send every "
                "tensor of the model, the tied lm_head.weight included"
            )

    def shutdown(self) -> None:
        pass
