"""How many CPU threads torch (and OpenMP) uses in a run: the ``threads`` key.

For the tiny and toy models (~0.1M parameters) handing work between threads costs more than
it saves: ``python src/train.py`` took 47-154 s with torch's default on 2 busy cores, 12-17 s
on one thread (issue 41). ``threads=auto`` (default): ``OMP_NUM_THREADS`` if set; else one
thread for a model under ``SMALL_MODEL`` parameters on the CPU trainer; else torch's choice
divided among the CPU trainer's processes. ``threads=N``: N. ``threads=null``: untouched.
``configure`` runs before the model loads, logs the choice and sets ``OMP_NUM_THREADS``
(unless set) for the processes the run starts.
"""

from __future__ import annotations

import logging
import os

from omegaconf import OmegaConf

from mrtpo.run.settings import ConfigError

log = logging.getLogger(__name__)

#: Models below this many parameters run on one CPU thread under ``threads=auto``.
SMALL_MODEL = 50e6

_said: set[tuple[int, str]] = set()  # (threads, why) already logged by this process


def choose(cfg) -> tuple[int | None, str]:
    """(threads, why) for ``cfg``: None leaves torch's setting as it is."""
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
    if accelerator not in ("cpu", "auto") or _has_gpu(accelerator):
        return None, "threads=auto: the model runs on a GPU, torch's own choice"
    from mrtpo.run.placement import model_parameters

    n = model_parameters(OmegaConf.select(cfg, "model"))
    if n is not None and n < SMALL_MODEL:
        return 1, f"threads=auto: a model of {_size(n)} parameters on the CPU"
    processes = _cpu_processes(cfg)
    if processes > 1:
        return max(1, (os.cpu_count() or 1) // processes), (
            f"threads=auto: the cores shared by {processes} processes on the CPU"
        )
    return None, "threads=auto: a larger model on the CPU, torch's own choice"


def configure(cfg) -> int:
    """Set torch's (and OpenMP's) thread count for ``cfg``; return the count in effect."""
    import torch

    threads, why = choose(cfg)
    if threads is not None:
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    now = torch.get_num_threads()
    if (now, why) not in _said:
        _said.add((now, why))
        log.info("CPU threads: %d (%s; set threads=N to change)", now, why)
    return now


def _has_gpu(accelerator: str) -> bool:
    if accelerator == "cpu":
        return False
    import torch

    return torch.cuda.is_available()


def _cpu_processes(cfg) -> int:
    """Processes a CPU trainer starts on this machine (``trainer.devices``)."""
    devices = OmegaConf.select(cfg, "trainer.devices", default=1)
    return devices if isinstance(devices, int) and not isinstance(devices, bool) else 1


def _size(n: float) -> str:
    return f"~{n / 1e9:.1f}B" if n >= 1e9 else f"~{n / 1e6:.1f}M"
