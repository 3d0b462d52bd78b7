"""Where a run runs: how many ranks its trainer starts, whether this machine can start them,
whether the model fits the CPU trainer (checked before anything loads), and how many CPU
threads torch uses (the ``threads`` key).

``threads=auto`` (default) chooses by the model and trainer: for the tiny and toy models
handing work between threads costs more than it saves (``python src/train.py`` took 47-154 s
with torch's default on 2 busy cores, 12-17 s on one thread: issue 41)."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mrtpo.core.errors import ConfigError

#: Models at least this large (parameters) are refused on the CPU trainer unless +allow_cpu=true.
CPU_PARAMS_LIMIT = 1.0e9


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _on_gpu(trainer, gpus: int) -> bool:
    accelerator = str(trainer.get("accelerator", "auto")).lower()
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and gpus > 0)


def _devices_per_node(value: Any, on_gpu: bool, gpus: int) -> int:
    """Processes per node that ``trainer.devices`` starts, counted as Lightning counts them."""
    if not isinstance(value, (str, int)) and hasattr(value, "__len__"):
        return len(value)  # a list of GPU ids
    text = str(value).strip()
    if text in ("auto", "-1"):
        if text == "-1" and not on_gpu:
            raise ConfigError(
                "trainer.devices=-1 means every GPU; on the CPU trainer give a number of "
                "processes (trainer.devices=1, 2, ...)"
            )
        return max(gpus, 1) if on_gpu else 1
    if "," in text:
        return len([t for t in text.split(",") if t.strip()])
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(
            f"trainer.devices={value!r} is not allowed: a count >= 1, a list of GPU ids, "
            "-1 (every GPU) or auto"
        )
    return int(text)


def world_size(cfg, gpus: int | None = None) -> int:
    """How many training processes ``cfg.trainer`` starts: devices per node x nodes."""
    from omegaconf import OmegaConf

    trainer = OmegaConf.select(cfg, "trainer")
    if trainer is None:
        return 1
    gpus = visible_gpus() if gpus is None else gpus
    per_node = _devices_per_node(trainer.get("devices", "auto"), _on_gpu(trainer, gpus), gpus)
    return per_node * int(trainer.get("num_nodes", 1) or 1)


def dims(d: Mapping) -> tuple[int, int, int, int, int]:
    """(hidden, heads, kv heads, head width, MLP width) of config.json sizes, defaults filled."""
    h = int(d["hidden_size"])
    heads = int(d.get("num_attention_heads") or 1)
    kv, inter = int(d.get("num_key_value_heads") or heads), int(d.get("intermediate_size") or 4 * h)
    return h, heads, kv, int(d.get("head_dim") or h // heads), inter


def _parameter_count(d: Mapping) -> float | None:
    """Parameters of a decoder-only transformer from its config.json sizes (None if absent)."""
    try:
        h, heads, kv, head_dim, inter = dims(d)
        layers, vocab = int(d["num_hidden_layers"]), int(d["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return None
    attention = h * head_dim * 2 * (heads + kv)  # q and o, k and v
    embeddings = vocab * h * (1 if d.get("tie_word_embeddings") else 2)
    return float(layers * (attention + 3 * h * inter) + embeddings)


def model_parameters(model) -> float | None:
    """About how many parameters ``cfg.model`` has, without loading it: from the tiny model's
    sizes, a local folder's config.json, or the size in a hub id (``Qwen2.5-7B-Instruct``)."""
    if model is None:
        return None
    if model.get("tiny"):
        return _parameter_count(model.tiny)
    name = str(model.get("name_or_path") or "")
    config = Path(name) / "config.json"
    if config.is_file():
        try:
            return _parameter_count(json.loads(config.read_text()))
        except (OSError, ValueError):
            return None
    m = re.search(r"(?<![\d.])(\d+(?:\.\d+)?)[Bb](?![A-Za-z0-9])", Path(name).name)
    return float(m.group(1)) * 1e9 if m else None


def hydra_choices(cfg) -> dict[str, Any]:
    """The config group choices of a composed config, else of the running Hydra job, else {}."""
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, "hydra.runtime.choices", default=None)
    if node is None:
        try:
            from hydra.core.hydra_config import HydraConfig

            node = HydraConfig.get().runtime.choices
        except (ValueError, AttributeError):
            return {}
    return {str(k): v for k, v in node.items()}


def _preset(cfg) -> str:
    """``experiment=<name>`` of a composed config, for messages ('' when none)."""
    name = hydra_choices(cfg).get("experiment")
    return f"experiment={name} " if name and name != "null" else ""


def check_placement(cfg, gpus: int | None = None) -> int:
    """Refuse, before anything loads, a trainer this machine cannot start (GPUs it lacks) or a
    model too large for the CPU trainer (unless ``+allow_cpu=true``); the number of ranks."""
    from omegaconf import OmegaConf

    trainer = OmegaConf.select(cfg, "trainer")
    if trainer is None:
        return 1
    gpus = visible_gpus() if gpus is None else gpus
    on_gpu = _on_gpu(trainer, gpus)
    per_node = _devices_per_node(trainer.get("devices", "auto"), on_gpu, gpus)
    if on_gpu and per_node > gpus:
        fix = (
            f"lower trainer.devices to {gpus} where docs/scaling.md says the model fits"
            if gpus
            else "run it on a GPU machine"
        )
        raise ConfigError(
            f"{_preset(cfg)}trains on {per_node} GPU(s) per node (trainer.accelerator="
            f"{trainer.get('accelerator')}, trainer.devices={trainer.get('devices')}), but this "
            f"machine has {gpus or 'no'} CUDA GPU(s): {fix}, or try the pipeline on the CPU "
            "with trainer=cpu trainer.devices=1 model=tiny"
        )
    if not on_gpu and not OmegaConf.select(cfg, "allow_cpu", default=False):
        n = model_parameters(OmegaConf.select(cfg, "model"))
        if n is not None and n >= CPU_PARAMS_LIMIT:
            raise ConfigError(
                f"model.name_or_path={cfg.model.name_or_path} has about {n / 1e9:.1f}B "
                f"parameters: on the CPU trainer its training state in float32 (weights, "
                f"gradients and AdamW moments, 16 B each) is about {16 * n / 1e9:.0f} GB and a "
                "step takes hours. Train it on GPUs (the paper presets compose their trainer; "
                "docs/scaling.md), or add +allow_cpu=true to run it on the CPU anyway"
            )
    return per_node * int(trainer.get("num_nodes", 1) or 1)


log = logging.getLogger(__name__)

#: Models below this many parameters run on one CPU thread under ``threads=auto``.
SMALL_MODEL = 50e6

_said: set[tuple[int, str]] = set()  # (threads, why) already logged by this process


def choose_threads(cfg) -> tuple[int | None, str]:
    """(threads, why) for ``cfg``: None leaves torch's setting as it is."""
    from omegaconf import OmegaConf

    value = OmegaConf.select(cfg, "threads", default="auto")
    if value is None:
        return None, "threads=null: torch's own choice"
    if value != "auto":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"threads={value!r} is not allowed: auto, null (torch's own choice) or a "
                "whole number of CPU threads >= 1"
            )
        return int(value), f"threads={value}"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) >= 1:
        return int(env), "threads=auto: OMP_NUM_THREADS is set"
    accelerator = str(OmegaConf.select(cfg, "trainer.accelerator", default="cpu"))
    if accelerator not in ("cpu", "auto") or (accelerator == "auto" and visible_gpus() > 0):
        return None, "threads=auto: the model runs on a GPU, torch's own choice"
    n = model_parameters(OmegaConf.select(cfg, "model"))
    if n is not None and n < SMALL_MODEL:
        return 1, f"threads=auto: a model of ~{n / 1e6:.1f}M parameters on the CPU"
    processes = OmegaConf.select(cfg, "trainer.devices", default=1)  # a CPU trainer's processes
    processes = processes if isinstance(processes, int) and not isinstance(processes, bool) else 1
    if processes > 1:
        return max(1, (os.cpu_count() or 1) // processes), (
            f"threads=auto: the cores shared by {processes} processes on the CPU"
        )
    return None, "threads=auto: a larger model on the CPU, torch's own choice"


def configure_threads(cfg) -> int:
    """Set torch's (and OpenMP's) thread count for ``cfg``; return the count in effect."""
    import torch

    threads, why = choose_threads(cfg)
    if threads is not None:
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    now = torch.get_num_threads()
    if (now, why) not in _said:
        _said.add((now, why))
        log.info("CPU threads: %d (%s; set threads=N to change)", now, why)
    return now
