"""Export the trained policy at the end of every RL run: ``<run>/policy/`` (``mrtpo.export``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
from omegaconf import OmegaConf

log = logging.getLogger(__name__)


class ExportPolicy(L.Callback):
    """At the end of training, write the policy as a Hugging Face folder (LoRA merged).

    Only the RL module is exported here; the SFT stage saves its own ``<run>/policy``
    (``mrtpo.sft.SavePolicy``). A run that stops on an error exports nothing.
    """

    def __init__(self, dirpath: str, sampling: Mapping[str, Any] | None = None) -> None:
        self.dirpath = dirpath
        if sampling is not None and not isinstance(sampling, dict):
            sampling = OmegaConf.to_container(sampling, resolve=True)
        self.sampling = dict(sampling) if sampling else None
        self.path: Path | None = None

    def on_train_end(self, trainer, pl_module) -> None:
        from mrtpo.module import PolicyModule

        if not isinstance(pl_module, PolicyModule) or not trainer.is_global_zero:
            return
        from mrtpo.export import save_policy

        info = {
            "step": int(trainer.global_step),
            "iteration": int(pl_module.iteration),
            **pl_module.identity(),
        }
        self.path = save_policy(
            pl_module.policy, pl_module.tokenizer, self.dirpath, sampling=self.sampling, info=info
        )
        log.info(
            "exported the policy to %s (evaluate: src/eval.py model.name_or_path=%s)",
            self.path,
            self.path,
        )
