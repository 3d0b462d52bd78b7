"""Pieces shared by the benchmark sections: model sizes, configs, controlled rewards, timing.

Every section builds the trainer the way ``src/train.py`` does (the real Hydra configs,
``mrtpo.lightning.pipeline.build``), so what is timed is the code a user runs, not a re-implementation.
Hydra is imported only inside the functions that compose a config: the GPU runner
(``benchmarks.gpu``) uses the model sizes and controlled rewards from here on machines
without Hydra.

Where things go: results under ``bench_dir()`` (``logs/bench``, or ``$MRTPO_BENCH_DIR``),
models under ``cache_dir()`` (``.cache``, or ``$MRTPO_CACHE_DIR``); tests point both at a
temporary folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def muted_libraries(
    names: Sequence[str] = ("lightning", "lightning.pytorch", "transformers", "mrtpo"),
):
    """Warnings and the logs of ``names`` below ERROR are muted inside, then restored: the
    harnesses also run inside a test process, whose later tests read the mrtpo log."""
    import logging
    import warnings

    levels = {name: logging.getLogger(name).level for name in names}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        for name in names:
            logging.getLogger(name).setLevel(logging.ERROR)
        try:
            yield
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)


#: The source checkout (scripts/benchmarks/common.py -> <root>).
ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "configs"
DOC = ROOT / "docs" / "benchmarks.md"
#: The folder that holds this package (``scripts/``): worker processes need it on their path.
SCRIPTS = Path(__file__).resolve().parents[1]

# Qwen2 shapes with random weights and the tiny byte-level tokenizer (mrtpo.core.models).
# ``tiny`` is configs/model/tiny.yaml (0.1M parameters: Python overhead dominates); ``mini``
# (~3M) is for the scaling sweeps on CPU; ``small`` is the CPU-sized model (~23M: model
# compute dominates a step); ``medium`` (~0.2B) and ``large`` (~1.1B) are GPU sizes (--full).
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {},
    # configs/model/tiny_wide.yaml: two heads of 32 (vLLM's CPU attention needs >= 32)
    "tiny_wide": {"num_attention_heads": 2, "num_key_value_heads": 1},
    "mini": {
        "hidden_size": 256,
        "intermediate_size": 704,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "small": {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    },
    "medium": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
    },
    "large": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
    },
}


#: Qwen2.5-0.5B's shape, vocabulary included (the LM head is a large share of the work): the
#: GPU runners build it with random weights from the config alone (nothing is downloaded).
QWEN25_05B: dict[str, Any] = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


def cache_dir() -> Path:
    return Path(os.environ.get("MRTPO_CACHE_DIR", ROOT / ".cache"))


def bench_dir() -> Path:
    """Where the sections write ``<section>.json`` and their run folders (``runs/``)."""
    return Path(os.environ.get("MRTPO_BENCH_DIR", ROOT / "logs" / "bench"))


def model_path(size: str) -> Path:
    return cache_dir() / "bench" / "models" / size


def model_overrides(size: str) -> list[str]:
    """Hydra overrides that select the bench model ``size`` (built on first use)."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose from {sorted(MODEL_SIZES)}")
    out = ["model=tiny", f"model.name_or_path={model_path(size)}"]
    out += [f"model.tiny.{k}={v}" for k, v in MODEL_SIZES[size].items()]
    return out


def ensure_model(size: str) -> Path:
    from mrtpo.core.models import TinyModelConfig, build_tiny_model

    return build_tiny_model(model_path(size), TinyModelConfig(**MODEL_SIZES[size]))


def compose(overrides: Sequence[str], run_dir: Path):
    """The real train config with ``overrides``, writing under ``run_dir``."""
    from mrtpo.run.config import compose as compose_config

    base = [
        f"paths.output_dir={run_dir}",
        f"paths.log_dir={run_dir}/logs",
        f"paths.cache_dir={cache_dir()}",
        "print_config=false",
        "callbacks=none",
        "seed=0",
    ]
    return compose_config("train.yaml", base + list(overrides), config_dir=CONFIG_DIR)


def schedule_off(method):
    """``method`` with β from the first step: the bench times a step's cost, not the schedule
    (while a ramped β is 0 the trainer skips replay)."""
    if getattr(method, "beta_warmup_steps", 0):
        method.beta_warmup_steps = 0
    return method


def build_method(name: str):
    """The advantage method ``method=<name>`` gives ``src/train.py`` — the train config
    composed by Hydra with that choice, its ``method`` node instantiated — with its β
    schedule off (``schedule_off``)."""
    from hydra.utils import instantiate

    from mrtpo.run.config import compose as compose_config

    cfg = compose_config("train.yaml", [f"method={name}"], config_dir=CONFIG_DIR)
    return schedule_off(instantiate(cfg.method))


def child_pythonpath() -> str:
    """``PYTHONPATH`` for a worker process: the harness packages, the ``mrtpo`` this process
    imported (installed, or a source tree on ``PYTHONPATH``), then whatever was set."""
    import mrtpo

    package_root = os.path.dirname(os.path.dirname(os.path.abspath(mrtpo.__file__)))
    parts = (str(SCRIPTS), package_root, os.environ.get("PYTHONPATH"))
    return os.pathsep.join(x for x in parts if x)


def set_threads(n: int | None) -> int:
    """Intra-op threads. On a shared CPU, 1 thread avoids OpenMP barrier stalls that make
    small ops 10-100x slower when another process holds the second core."""
    import torch

    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


# ---- controlled rewards ------------------------------------------------------------------
def _groups(examples: Sequence[Any]) -> list[list[int]]:
    """Indices of consecutive responses to the same prompt (the trainer's group layout)."""
    out: list[list[int]] = []
    for i, e in enumerate(examples):
        if out and examples[out[-1][0]] is e:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def controlled_task(base, share: float, seed: int = 0):
    """Wrap ``base`` so that a chosen share of (group, reward) cells vary within their group.

    The base task still scores every response (its verifier time stays in the step); only
    the reward *values* are replaced: cells picked at random get 1/0 alternating over the
    group (they vary, so MRTPO replays them), the others get a constant. The replayed share
    of response-reward pairs is then ``round(share * B * K) / (B * K)`` on every batch, the
    knob the paper's 12-21% corresponds to. Contexts are the base task's, unchanged.
    """
    from mrtpo.tasks.base import Task

    class ControlledRewards(Task):
        name = base.name
        reward_names = tuple(base.reward_names)
        block_order = base.block_order
        rewards_vary_per_prompt = base.rewards_vary_per_prompt
        info_in_prompt = getattr(base, "info_in_prompt", False)
        success_check = getattr(base, "success_check", None)

        def examples(self, split):
            return base.examples(split)

        def score(self, example, response):
            return base.score(example, response)

        def contexts(self, example, score):
            return base.contexts(example, score)

        def score_many(self, examples, responses):
            scores = base.score_many(examples, responses)
            groups = _groups(examples)
            names = self.reward_names
            cells = [(g, k) for g in range(len(groups)) for k in range(len(names))]
            rng = random.Random(seed)
            vary = set(rng.sample(cells, round(share * len(cells))))
            for g, idx in enumerate(groups):
                for k, name in enumerate(names):
                    const = float(rng.random() < 0.5)
                    for r, i in enumerate(idx):
                        scores[i].rewards[name] = float(r % 2) if (g, k) in vary else const
            return scores

    return ControlledRewards()


# ---- timing and stats --------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0


def med(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def iqr(xs: Sequence[float]) -> tuple[float, float]:
    xs = sorted(x for x in xs if x is not None)
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (float("nan"), float("nan"))
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def machine() -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
    }
    with contextlib.suppress(OSError):
        info["loadavg_1m"] = round(os.getloadavg()[0], 2)
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def write_json(name: str, data: dict[str, Any]) -> Path:
    out = bench_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    from mrtpo.evaluate.analysis.runs import source_commit

    data = {
        "generated": time.strftime("%Y-%m-%d %H:%M:%S"),
        "commit": source_commit(),  # the code that produced these numbers
        "machine": machine(),
        **data,
    }
    path.write_text(json.dumps(data, indent=2, default=float))
    return path


def read_json(name: str) -> dict[str, Any] | None:
    path = bench_dir() / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None
