"""The trained policy as a Hugging Face folder: what vLLM, lm-eval, ``src/eval.py`` and the hub read.

``save_policy`` writes merged weights, the tokenizer, ``generation_config.json`` (the trained
``rollout.sampling``) and ``mrtpo_export.json`` (provenance); every RL run does it at its end
(``callbacks.export.ExportPolicy``), ``src/export.py`` for any checkpoint. It is written beside
the target and renamed into place (a crash never leaves half an export); an existing folder is
replaced only when it is a previous export.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shlex
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from mrtpo.core.lora import hf_model, is_lora
from mrtpo.core.models import eos_token_ids, load_policy, resolve_dtype
from mrtpo.evaluate.analysis.runs import read_metrics
from mrtpo.evaluate.analysis.summary import MARKDOWN
from mrtpo.rollout.base import SamplingConfig
from mrtpo.rollout.hf import generation_config as sampling_generation_config
from mrtpo.rollout.weight_sync import hf_name, merged_weights
from mrtpo.run.trained_run import (
    MARKER,
    from_training_run,
    load_checkpoint_weights,
    run_config_path,
)

log = logging.getLogger(__name__)


def merged_state_dict(
    model: torch.nn.Module, state: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The policy's weights under the base model's checkpoint names, LoRA merged. The merged tensors
    are new ones (``W + scale * B @ A``): the policy itself is not touched, so its frozen base
    weights stay bit-identical (an in-place merge followed by an unmerge would leave rounding
    residue in them)."""
    peft = is_lora(model)
    merged = merged_weights(model) if peft else {}
    out: dict[str, torch.Tensor] = {}
    # ``state``: the model's full state dict gathered from its shards (FSDP), read instead
    for key, tensor in (model.state_dict() if state is None else state).items():
        name = hf_name(key, peft)
        if name is not None:
            out[name] = (merged[key].materialize() if key in merged else tensor).detach()
    return out


def generation_config(model, tokenizer, sampling: Mapping[str, Any] | None):
    """A generation config that samples as training did: built whole from the training
    sampling settings (``mrtpo.rollout.hf.generation_config``), so none of the checkpoint's
    own defaults (a repetition penalty, top-k) come back with the exported model."""
    s = SamplingConfig(**dict(sampling or {}))
    eos = eos_token_ids(tokenizer, model)
    gen = sampling_generation_config(s, eos, tokenizer.pad_token_id)
    gen.eos_token_id = eos if len(eos) != 1 else eos[0]
    return gen


def save_model(target: torch.nn.Module, folder: str | Path, gen, state=None) -> None:
    """``target.save_pretrained(folder)`` with ``gen`` standing in for the model's own
    generation config, which ``save_pretrained`` validates strictly: a checkpoint's loose one
    (``top_k`` without ``do_sample``, which loading only warns about) would fail the export at
    the end of a run, although none of its fields are exported. The model's own is put back."""
    own = getattr(target, "generation_config", None)
    if own is not None:
        target.generation_config = gen
    try:
        target.save_pretrained(folder, state_dict=state)
    finally:
        if own is not None:
            target.generation_config = own


def check_destination(out: str | Path, protected: Iterable[tuple[str, str | Path]]) -> Path:
    """``out`` as a Path, or an error if writing there could destroy something. ``protected`` is
    (what, folder) pairs: the user's model folder, the run's checkpoints. A folder that exists must
    be empty or a previous export (it holds ``MARKER``)."""
    out = Path(out)
    for what, folder in protected:
        a, b = out.resolve(), Path(folder).resolve()
        if folder and Path(folder).exists() and (a.is_relative_to(b) or b.is_relative_to(a)):
            raise ValueError(
                f"out={out} would write into (or over) {what} {folder}; choose another out="
            )
    if out.exists():
        if not out.is_dir():
            raise ValueError(f"out={out} is a file; choose a folder for out=")
        if any(out.iterdir()) and not (out / MARKER).is_file():
            raise ValueError(
                f"out={out} is not empty and holds no previous export ({MARKER}); refusing to "
                "write into it: choose a new or empty folder for out="
            )
    return out


def save_policy(
    model: torch.nn.Module,
    tokenizer,
    out: str | Path,
    sampling: Mapping[str, Any] | None = None,
    info: Mapping[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    state: Mapping[str, torch.Tensor] | None = None,
    card: str | None = None,
) -> Path:
    """Write ``model`` (LoRA merged) and ``tokenizer`` as a Hugging Face folder at ``out``.
    ``dtype`` casts the floating-point weights (default: as trained); ``state`` is the full state
    dict of a sharded ``model`` (``mrtpo.lightning.sharding.full_state_dict``); ``card`` is the
    folder's ``README.md`` (``model_card``). Returns ``out``."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise ValueError(f"{out} is not empty and is no previous export; refusing to replace it")
    state = merged_state_dict(model, state)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    target = hf_model(model)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        gen = generation_config(model, tokenizer, sampling)
        save_model(target, tmp, gen, state)
        tokenizer.save_pretrained(tmp)
        gen.save_pretrained(tmp)
        record = {"lora_merged": is_lora(model), **dict(info or {})}
        (tmp / MARKER).write_text(json.dumps(record, indent=2, default=str) + "\n")
        if card is not None:
            (tmp / "README.md").write_text(card, encoding="utf-8")
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old{os.getpid()}")
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ---- the model card (README.md): base model, task, method and settings, rewards, steps, final
# metrics and the commands that made it (issue 41, item 6), from the run's own records
# (``.hydra/``, ``job.json``, ``csv/metrics.csv``); a record missing or unreadable leaves its
# part of the card out, saying so.

#: The metrics a card shows, by prefix of their metrics.csv name.
SHOWN = ("train/reward/", "train/success", "train/extra/", "train/response_len/mean")
#: The settings sections a card shows besides the method.
SETTINGS = ("rl", "optim", "replay")


def _load(path: Path):
    try:
        return OmegaConf.load(path) if path.is_file() else None
    except Exception as exc:  # a damaged record costs its part of the card only
        log.warning("model card: cannot read %s (%s)", path, exc)
        return None


def _plain(node) -> Any:
    """A config node as plain data, interpolations resolved where they can be."""
    try:
        return OmegaConf.to_container(node, resolve=True)
    except Exception:
        return OmegaConf.to_container(node, resolve=False)


def final_metrics(rows: Sequence[Mapping[str, float]], step: int | None) -> dict[str, float]:
    """The last logged value of each shown metric over the RL steps up to ``step``."""
    out: dict[str, float] = {}
    for r in rows:
        it = r.get("train/iteration")
        if step is not None and it is not None and it > step:
            continue
        for k, v in r.items():
            if k.startswith(SHOWN) and not math.isnan(v):
                out[k] = v
    return out


def _reward_names(rows: Sequence[Mapping[str, float]]) -> list[str]:
    names = dict.fromkeys(
        k.removeprefix("train/reward/").removesuffix("/mean")
        for r in rows
        for k in r
        if k.startswith("train/reward/") and k.endswith("/mean")
    )
    return [n for n in names if n != "total"]


def _command(script: str, overrides: Sequence[str]) -> str:
    return " ".join(["python", script, *(shlex.quote(str(o)) for o in overrides)])


def model_card(
    run_dir: Path,
    *,
    base_model: str,
    step: int | None,
    checkpoint: Path,
    export_overrides: Sequence[str] = (),
) -> str:
    """The card of an export of ``checkpoint`` at ``step``, from the records of run ``run_dir``."""
    cfg = _load(run_dir / ".hydra" / "config.yaml")
    hydra = _load(run_dir / ".hydra" / "hydra.yaml")
    choices = OmegaConf.select(hydra, "hydra.runtime.choices", default=None) if hydra else None
    choices = _plain(choices) if choices is not None else {}
    job: Any = {}
    with contextlib.suppress(OSError, ValueError):  # no job.json: the card says so
        job = json.loads((run_dir / "job.json").read_text(encoding="utf-8"))
    job = job if isinstance(job, dict) else {}
    metrics = run_dir / "csv" / "metrics.csv"
    rows = read_metrics(metrics) if metrics.is_file() else []
    return MARKDOWN.get_template("model_card.md.j2").render(
        name=job.get("run_name") or run_dir.name, run_dir=run_dir, step=step,
        task=choices.get("task", job.get("task")) or "unknown",
        method=choices.get("method", job.get("method")) or "unknown",
        base_model=base_model, model=choices.get("model", "?"), checkpoint=checkpoint,
        rewards=", ".join(f"`{r}`" for r in _reward_names(rows)) or "(none logged)",
        seed=OmegaConf.select(cfg, "seed", default="?") if cfg else "?",
        settings=_settings(cfg), final=sorted(final_metrics(rows, step).items()),
        commands=_commands(job, checkpoint, export_overrides),
    )  # fmt: skip


def _settings(cfg) -> str | None:
    """The method and ``SETTINGS`` sections as YAML (None: no config)."""
    if cfg is None:
        return None
    shown = {k: _plain(cfg[k]) for k in ("method", *SETTINGS) if k in cfg}
    if "warm_start" in cfg and cfg.warm_start:
        shown["warm_start"] = _plain(cfg.warm_start)
    return OmegaConf.to_yaml(OmegaConf.create(shown)).rstrip()


def _commands(
    job: Mapping[str, Any], checkpoint: Path, export_overrides: Sequence[str]
) -> list[str]:
    runs = [i.get("overrides") for i in job.get("invocations") or [] if isinstance(i, dict)]
    runs = [r for r in runs if isinstance(r, list)] or [job.get("overrides")]
    lines = [_command("src/train.py", r) for r in runs if isinstance(r, list)]
    if not lines:
        lines = ["# (the run's job.json is missing: its command is not known)"]
    return [*lines, _command("src/export.py", export_overrides or [f"ckpt_path={checkpoint}"])]


# ---- src/export.py -------------------------------------------------------------------------


def _sampling(cfg: DictConfig, ckpt_path: str) -> dict[str, Any] | None:
    """``sampling=``, else ``rollout.sampling`` of the run behind ``ckpt_path`` (None: unknown)."""
    if cfg.get("sampling") is not None:
        return dict(OmegaConf.to_container(cfg.sampling, resolve=True))
    saved = run_config_path(ckpt_path)
    if not saved.is_file():
        return None
    node = OmegaConf.select(OmegaConf.load(saved), "rollout.sampling", default=None)
    if node is None:
        return None
    try:
        return dict(OmegaConf.to_container(node, resolve=True))
    except Exception as exc:  # an interpolation into a key this config lacks
        log.warning("export: cannot read rollout.sampling from %s (%s)", saved, exc)
        return None


def _card(ckpt_file: Path, base_model: str, step: int | None) -> str:
    """The model card of an export of ``ckpt_file`` (``model_card``)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task)
    except Exception:  # called without Hydra's runtime (a library caller)
        overrides = []
    run_dir = run_config_path(ckpt_file).parent.parent
    return model_card(run_dir, base_model=base_model, step=step, checkpoint=ckpt_file,
                  export_overrides=overrides)  # fmt: skip


def run(cfg: DictConfig) -> Path:
    """Export the policy of ``cfg.ckpt_path`` to ``cfg.out`` (see configs/export.yaml)."""
    ckpt = cfg.get("ckpt_path")
    if not ckpt:
        raise ValueError("ckpt_path= is required: the checkpoint to export (a .ckpt file)")
    if not cfg.get("out"):
        raise ValueError("out= is required: the folder to write the Hugging Face model to")
    cfg, source = from_training_run(cfg, builds_task=False)  # the run's task: never built
    ckpt_file = Path(str(ckpt)).resolve()
    model_dir = Path(str(cfg.model.name_or_path))
    model = ("the model folder (model.name_or_path)", model_dir if model_dir.is_dir() else "")
    out = check_destination(str(cfg.out), [model, ("the checkpoint folder", ckpt_file.parent)])
    policy, tokenizer = load_policy(**OmegaConf.to_container(cfg.model, resolve=True))
    step = load_checkpoint_weights(
        policy, str(ckpt_file), source.get("model_source", ""), use="export one"
    )
    sampling = _sampling(cfg, str(ckpt_file))
    dtype = resolve_dtype(str(cfg.dtype)) if cfg.get("dtype") else None
    info = {"checkpoint": str(ckpt_file), "step": step, **source}
    card = _card(ckpt_file, str(cfg.model.name_or_path), step)
    save_policy(policy, tokenizer, out, sampling=sampling, info=info, dtype=dtype, card=card)
    print(
        f"exported {ckpt_file} (step {step}) to {out} (model card: {out / 'README.md'})", flush=True
    )
    print(f"evaluate it with: python src/eval.py model.name_or_path={out}", flush=True)
    return out
