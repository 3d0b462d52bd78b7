"""LoRA adapters (PEFT) for the policy: ``model.lora``, wrapping, and what a checkpoint holds.
Base weights stay frozen as loaded; only adapters train and are checkpointed. The KL
reference is the same model with adapters off (``disable_adapter``): no second base copy.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass
class LoraSettings:
    """``model.lora``: LoRA adapters instead of a full fine-tune (off while ``r`` is 0)."""

    r: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=list)

    @classmethod
    def from_mapping(cls, given: Mapping[str, Any] | None) -> LoraSettings:
        given = dict(given or {})
        unknown = sorted(set(given) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(
                f"model.lora has no key(s) {unknown}; its keys are r, alpha, dropout, "
                "target_modules"
            )
        out = cls(**given)
        out.check()
        return out

    @property
    def enabled(self) -> bool:
        return int(self.r) > 0

    def check(self) -> None:
        def need(ok: bool, key: str, allowed: str) -> None:
            if not ok:
                raise ValueError(
                    f"model.lora.{key}={getattr(self, key)!r} is not allowed: {allowed}"
                )

        need(isinstance(self.r, int) and self.r >= 0, "r", "an integer >= 0 (0: no LoRA)")
        if not self.enabled:
            return
        need(isinstance(self.alpha, (int, float)) and self.alpha > 0, "alpha", "a number > 0")
        need(
            isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1,
            "dropout",
            "in [0, 1)",
        )
        targets = self.target_modules
        need(
            isinstance(targets, str)
            or (bool(targets) and all(isinstance(t, str) and t for t in targets)),
            "target_modules",
            "a non-empty list of module names (e.g. [q_proj, v_proj]) or 'all-linear'",
        )


def _adaptable_names(model: torch.nn.Module) -> list[str]:
    """Short names of the layers LoRA can adapt (linear, embedding, conv), for messages."""
    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d)
    # transformers' GPT-2-style Conv1D is not a torch conv
    adaptable = [
        n for n, m in model.named_modules() if isinstance(m, kinds) or type(m).__name__ == "Conv1D"
    ]
    return sorted({n.rsplit(".", 1)[-1] for n in adaptable if n})


def _matches(module_name: str, target: str) -> bool:
    # PEFT's rule for a list of names: the whole name or its last dotted part(s)
    return module_name == target or module_name.endswith("." + target)


def apply_lora(model: torch.nn.Module, settings: LoraSettings):
    """``model`` wrapped in LoRA adapters, every base parameter frozen. Target names matching no
    layer fail here, naming those that exist (PEFT accepts a list where only some match)."""
    from peft import LoraConfig, get_peft_model

    targets = settings.target_modules
    if not isinstance(targets, str):
        targets = [str(t) for t in targets]
        names = [n for n, _ in model.named_modules() if n]
        unmatched = [t for t in targets if not any(_matches(n, t) for n in names)]
        if unmatched:
            raise ValueError(
                f"model.lora.target_modules: {unmatched} match no module of "
                f"{type(model).__name__}; its adaptable layers are named "
                f"{_adaptable_names(model)}. Set model.lora.target_modules to some of these "
                "(or 'all-linear')."
            )
    config = LoraConfig(
        r=int(settings.r),
        lora_alpha=float(settings.alpha),
        lora_dropout=float(settings.dropout),
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as exc:  # e.g. a regex string that matches nothing
        raise ValueError(
            f"model.lora.target_modules={settings.target_modules!r}: {exc}. The adaptable "
            f"layers of {type(model).__name__} are named {_adaptable_names(model)}."
        ) from exc
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    share = 100.0 * trainable / max(1, total)
    log.info(
        f"LoRA r={settings.r} on {targets}: {trainable} of {total} parameters train ({share:.3f}%)"
    )
    return peft_model


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper (its ``save_pretrained`` knows tied weights)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a PEFT model (adapters that can be switched off)."""
    return callable(getattr(model, "disable_adapter", None)) and hasattr(model, "peft_config")


def checkpoint_keys(model: torch.nn.Module) -> set[str]:
    """The state-dict keys a checkpoint of ``model`` holds: every key for a full fine-tune;
    for LoRA only the trainable (adapter) parameters, the base being the frozen
    ``model.name_or_path`` that every run loads again."""
    state = model.state_dict(keep_vars=True)
    if not is_lora(model):
        return set(state)
    return {k for k, v in state.items() if isinstance(v, torch.nn.Parameter) and v.requires_grad}
