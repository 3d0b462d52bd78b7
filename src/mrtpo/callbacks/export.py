"""Export the trained policy at the end of every RL run: ``<run>/policy/`` (``mrtpo.export``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
from omegaconf import OmegaConf

from mrtpo.export import MARKER, hf_model, save_policy
from mrtpo.module import PolicyModule
from mrtpo.sharding import full_state_dict, is_sharded

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
        self.skip: str | None = None

    def _refusal(self, pl_module) -> str | None:
        """Why ``dirpath`` must not be written (None: it may)."""
        out = Path(self.dirpath)
        source = getattr(hf_model(pl_module.policy), "name_or_path", "") or ""
        if source and Path(source).exists() and out.resolve() == Path(source).resolve():
            return f"it is the model this run started from (model.name_or_path={source})"
        if out.exists() and (
            not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).is_file())
        ):
            return "it holds files that are not a previous export"
        return None

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.skip = None
        if isinstance(pl_module, PolicyModule) and trainer.is_global_zero:
            self.skip = self._refusal(pl_module)
            if self.skip:
                # Said before training, so the user can change it; the run itself goes on.
                log.warning(
                    "the policy will not be exported to %s: %s. Set callbacks.export.dirpath "
                    "to a new folder (or export later with src/export.py ckpt_path=...)",
                    self.dirpath,
                    self.skip,
                )

    def on_train_end(self, trainer, pl_module) -> None:
        if not isinstance(pl_module, PolicyModule):
            return

        # Sharded weights are gathered by every rank together (a collective); rank 0 writes.
        state = full_state_dict(pl_module.policy) if is_sharded(pl_module.policy) else None
        if not trainer.is_global_zero:
            return
        if getattr(self, "skip", None) or self._refusal(pl_module):
            return

        info = {
            "step": int(trainer.global_step),
            "iteration": int(pl_module.iteration),
            **pl_module.identity(),
        }
        self.path = save_policy(
            pl_module.policy,
            pl_module.tokenizer,
            self.dirpath,
            sampling=self.sampling,
            info=info,
            state=state,
        )
        log.info(
            "exported the policy to %s (evaluate: src/eval.py model.name_or_path=%s)",
            self.path,
            self.path,
        )
