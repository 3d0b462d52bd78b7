"""Sharded training (``trainer=fsdp``): FSDP2 ``fully_shard`` per decoder layer, then the root;
``PolicyModule.configure_model`` calls ``shard_module_policies``. What is sharded, the mixed
precision and the lockstep of sharded forwards: docs/scaling.md, "What is sharded".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from mrtpo.core.lora import hf_model  # the wrapping rules name its modules
from mrtpo.core.models import DTYPES as _DTYPES
from mrtpo.distributed import dummy_batch, is_sharded  # noqa: F401  (re-exported)

# model_type -> its transformer blocks, each its own FSDP unit (one layer's full weights are
# resident at a time); embeddings, final norm and LM head stay in the root unit.
LAYER_RULES: dict[str, Callable[[torch.nn.Module], list[torch.nn.Module]]] = dict.fromkeys(
    ("qwen2", "qwen3", "llama", "mistral"), lambda model: list(model.model.layers)
)


def model_type(model: torch.nn.Module) -> str | None:
    return getattr(getattr(hf_model(model), "config", None), "model_type", None)


def check_shardable(model: torch.nn.Module) -> None:
    """Refuse an architecture that has no wrapping rule (before anything is sharded)."""
    kind = model_type(model)
    if kind not in LAYER_RULES:
        raise ValueError(
            f"trainer=fsdp has no layer-wrapping rule for model_type={kind!r} (the model at "
            f"model.name_or_path); supported model_types: {sorted(LAYER_RULES)}. Use "
            "trainer=ddp (or trainer=gpu), or add a rule to mrtpo.lightning.sharding.LAYER_RULES"
        )


def resolve_dtype(name: str | None, key: str) -> torch.dtype | None:
    if name is None:
        return None
    if name not in _DTYPES:
        raise ValueError(f"{key}={name!r} is not a dtype; use one of {sorted(_DTYPES)} or null")
    return _DTYPES[name]


def shard_policy(
    model: torch.nn.Module,
    mesh: Any,
    mp_policy: Any = None,
    master_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """``fully_shard`` each decoder layer of ``model`` by its architecture's rule, then the
    root; in place. ``master_dtype`` casts each unit's parameters before it is sharded (a
    bf16 checkpoint then trains on float32 master shards, one full layer cast at a time)."""
    from torch.distributed.fsdp import fully_shard

    check_shardable(model)
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    layers = LAYER_RULES[model_type(model)](hf_model(model))
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    # fully_shard replaces a unit's parameters: list the root unit's before the layers go
    rest = [p for p in model.parameters() if id(p) not in in_layers]
    for layer in layers:
        if master_dtype is not None:
            layer.to(master_dtype)
        fully_shard(layer, **kwargs)
    if master_dtype is not None:
        # what is left for the root unit: embeddings, final norm, head
        for p in rest:
            if p.is_floating_point() and p.dtype != master_dtype:
                p.data = p.data.to(master_dtype)
    fully_shard(model, **kwargs)
    return model


class FSDP2Strategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` for pure FSDP2: every process is one data-parallel shard (on
    one node, ``ModelParallelStrategy`` alone shards nothing). Its settings
    (``trainer.strategy.*``): configs/trainer/fsdp.yaml; ``param_dtype: null`` computes in the
    parameters' dtype, ``reshard_after_forward: false`` is ZeRO-2-like (faster, more memory)."""

    def __init__(
        self,
        param_dtype: str | None = "auto",
        reduce_dtype: str | None = "fp32",
        master_dtype: str | None = "fp32",
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        if param_dtype != "auto":
            resolve_dtype(param_dtype, "trainer.strategy.param_dtype")
        self.param_dtype = param_dtype
        self.reduce_dtype = resolve_dtype(reduce_dtype, "trainer.strategy.reduce_dtype")
        self.master_dtype = resolve_dtype(master_dtype, "trainer.strategy.master_dtype")
        self.reshard_after_forward = bool(reshard_after_forward)

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto" and self._tensor_parallel_size == "auto":
            self._tensor_parallel_size = 1
            self._data_parallel_size = self.num_processes * self.num_nodes
        super().setup_environment()

    def compute_dtype(self) -> torch.dtype | None:
        if self.param_dtype == "auto":
            return torch.bfloat16 if self.root_device.type == "cuda" else None
        return resolve_dtype(self.param_dtype, "trainer.strategy.param_dtype")

    def mp_policy(self):
        """FSDP2's ``MixedPrecisionPolicy``, or None (compute in the parameters' dtype)."""
        param = self.compute_dtype()
        if param is None and self.reduce_dtype is None:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=self.reduce_dtype)


def shard_module_policies(module) -> None:
    """``PolicyModule.configure_model``'s body: shard the policy (and a frozen reference
    copy) when the trainer's strategy is a ``ModelParallelStrategy``; a no-op otherwise."""
    trainer = getattr(module, "_trainer", None)
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    if not isinstance(strategy, ModelParallelStrategy) or is_sharded(module.policy):
        return
    mesh = strategy.device_mesh
    if "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            "trainer=fsdp shards over data-parallel ranks only; set "
            "trainer.strategy.tensor_parallel_size=1 (or leave both sizes at auto)"
        )
    dp = mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh
    settings = (None, None, True)  # a plain ModelParallelStrategy: FSDP2's defaults
    if isinstance(strategy, FSDP2Strategy):
        settings = (strategy.mp_policy(), strategy.master_dtype, strategy.reshard_after_forward)
    for model in (module.policy, getattr(module, "ref_policy", None)):
        if model is not None:
            shard_policy(model, dp, *settings)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of a sharded ``model``, on rank 0's CPU (empty on the
    other ranks). A collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)
