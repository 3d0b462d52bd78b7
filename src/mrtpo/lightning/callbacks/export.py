"""Export the trained policy at the end of every RL run: ``<run>/policy/`` (``mrtpo.evaluate.export``),
and print the ``src/eval.py`` command that evaluates it on the run's task."""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
from omegaconf import OmegaConf

from mrtpo.core.lora import hf_model
from mrtpo.evaluate.export import save_policy
from mrtpo.lightning.module import PolicyModule
from mrtpo.lightning.sharding import full_state_dict, is_sharded
from mrtpo.run.resume import _flatten
from mrtpo.run.trained_run import MARKER, exported_step
from mrtpo.safe_files import pid_alive as _alive

log = logging.getLogger(__name__)

# ---- the evaluation command of an exported policy ---------------------------------------------

#: Values that Hydra's override grammar reads as they are written (anything else is quoted).
_PLAIN = re.compile(r"[A-Za-z0-9_./:@+-]+")


def _hydra_value(value: Any) -> str:
    """``value`` as the right-hand side of a Hydra override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{_hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if _PLAIN.fullmatch(text) and text.lower() not in ("null", "true", "false", "nan", "inf"):
        try:
            float(text)  # a string of digits would be read back as a number
        except ValueError:
            return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _group_file(group: str, choice: str) -> Any:
    from mrtpo.run.config import CONFIG_DIR

    path = CONFIG_DIR / group / f"{choice}.yaml"
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False) if path.is_file() else {}


def eval_overrides(saved: Any, task: str) -> list[str]:
    """``src/eval.py`` overrides scoring a policy on the task of the run whose
    ``.hydra/config.yaml`` is ``saved``: ``task=``, every task key the run set beyond the
    group's file (not ``SMOKE_LIMITS``: evaluation scores the whole split), and the data folder,
    token limit and dtype where they are not eval's defaults."""
    from mrtpo.run.trained_run import SMOKE_LIMITS

    raw = OmegaConf.to_container(saved.task, resolve=False)
    # dotted key -> value of every leaf (a list or an empty mapping is one leaf)
    run, default = _flatten(raw, "", {}), _flatten(_group_file("task", task), "", {})
    out = [f"task={task}"]
    for key, value in run.items():
        if key in SMOKE_LIMITS or (key in default and default[key] == value):
            continue
        full = OmegaConf.select(saved, f"task.{key}")  # resolved, with the run's paths
        full = OmegaConf.to_container(full, resolve=True) if OmegaConf.is_config(full) else full
        out.append(f"{'' if key in default else '+'}task.{key}={_hydra_value(full)}")
    out += [f"~task.{key}" for key in default if key not in run]
    data_dir = OmegaConf.to_container(saved.paths, resolve=False).get("data_dir")
    if data_dir != _group_file("paths", "default").get("data_dir"):
        out.append(f"paths.data_dir={_hydra_value(str(saved.paths.data_dir))}")
    tokens = OmegaConf.select(saved, "rollout.sampling.max_new_tokens")
    if tokens != _group_file("rollout", "hf")["sampling"]["max_new_tokens"]:
        out.append(f"eval.max_new_tokens={tokens}")
    if OmegaConf.select(saved, "model.dtype") not in (None, "fp32", "float32"):
        out.append(f"model.dtype={saved.model.dtype}")
    return out


def run_eval_command(policy: str | Path) -> str:
    """The command that evaluates ``policy`` on this run's task (from Hydra's record of the
    run); ``task=`` alone where the run saved no config."""
    words = ["python", "src/eval.py", f"model.name_or_path={_hydra_value(str(policy))}"]
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        task = str(hc.runtime.choices.task)
        saved = Path(str(hc.runtime.output_dir)) / ".hydra" / "config.yaml"
    except Exception:  # composed without Hydra: nothing says which task it was
        return " ".join(shlex.quote(w) for w in words)
    try:
        extra = eval_overrides(OmegaConf.load(saved), task) if saved.is_file() else [f"task={task}"]
    except Exception as exc:  # a config that does not resolve here: the task at least
        log.debug("the eval command of %s holds the task only: %s", policy, exc)
        extra = [f"task={task}"]
    if any(w.partition("=")[2].startswith(("mrtpo-live:", "[mrtpo.live.")) for w in extra):
        # mrtpo.Trainer's data and rewards were objects of its process: name yours instead
        extra = ["task=custom", "task.data.path=<prompts file>", "task.rewards=[<module.reward>]"]
    return " ".join(shlex.quote(w) for w in [*words, *extra])


# ---- an export that a kill interrupted ---------------------------------------------------------

#: The folders ``save_policy`` writes beside its target before renaming (``.policy.tmp<pid>``)
#: and moves the previous export to while it does (``.policy.old<pid>``).
_STAGING = re.compile(r"\.(?P<name>.+)\.(?:tmp|old)(?P<pid>\d+)")


def remove_stale_exports(out: str | Path) -> list[Path]:
    """Remove (and return) the staging folders of exports to ``out`` whose process died; a
    live process's folder and anything but a plain folder (a link) are left alone."""
    out = Path(out)
    removed = []
    try:
        entries = list(out.parent.iterdir())
    except OSError:  # no parent folder yet: nothing was staged there
        return removed
    for entry in sorted(entries):
        m = _STAGING.fullmatch(entry.name)
        if m is None or m["name"] != out.name or _alive(int(m["pid"])):
            continue
        if not stat.S_ISDIR(os.lstat(entry).st_mode):
            continue
        shutil.rmtree(entry)
        removed.append(entry)
        log.info("removed %s, left by an export that was stopped (process %s)", entry, m["pid"])
    return removed


class ExportPolicy(L.Callback):
    """At the end of training, write the policy as a Hugging Face folder (LoRA merged).

    RL only (SFT saves its own, ``sft.SavePolicy``); a run stopped by an error exports nothing.
    A run resumed after training but before its export (``pending_export``) exports from its
    last checkpoint at fit end; a stopped export's staging folders go when a run starts.
    """

    def __init__(self, dirpath: str, sampling: Mapping[str, Any] | None = None) -> None:
        self.dirpath = dirpath
        if sampling is not None and not isinstance(sampling, dict):
            sampling = OmegaConf.to_container(sampling, resolve=True)
        self.sampling = dict(sampling) if sampling else None
        self.path: Path | None = None
        self.skip: str | None = None
        self.exported = False

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
        self.skip, self.exported = None, False
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
            else:
                remove_stale_exports(self.dirpath)

    def on_train_end(self, trainer, pl_module) -> None:
        self._export(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        # A resume of a run whose training had finished (its checkpoint at max_steps) trains
        # no step, so on_train_end never comes: the export it owes is written here.
        if not self.exported and 0 < int(trainer.max_steps) <= int(trainer.global_step):
            self._export(trainer, pl_module, owed=True)

    def _export(self, trainer, pl_module, owed: bool = False) -> None:
        """Export on rank 0; ``owed``: only when ``dirpath`` holds no export of this step."""
        if not isinstance(pl_module, PolicyModule):
            return
        self.exported = True
        # Sharded weights are gathered by every rank together (a collective); rank 0 writes.
        state = full_state_dict(pl_module.policy) if is_sharded(pl_module.policy) else None
        if not trainer.is_global_zero:
            return
        if getattr(self, "skip", None) or self._refusal(pl_module):
            return
        if owed and exported_step(Path(self.dirpath)) == int(trainer.global_step):
            return

        step, iteration = int(trainer.global_step), int(pl_module.iteration)
        info = {"step": step, "iteration": iteration, **pl_module.identity()}
        self.path = save_policy(
            pl_module.policy,
            pl_module.tokenizer,
            self.dirpath,
            sampling=self.sampling,
            info=info,
            state=state,
        )
        log.info("exported the policy to %s (evaluate: %s)", self.path, run_eval_command(self.path))
