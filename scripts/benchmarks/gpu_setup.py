"""The GPU check's sizes (``FULL`` on the GPU, ``DRY`` for --dry-run), its JSON report, and
the torch / transformers features each stage needs (a missing one skips the stage)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import importlib
import importlib.util
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import QWEN25_05B

STAGES = ("environment", "model", "steps", "numerics", "jsd_memory", "generation", "vllm")
REPORT_NAME = "gpu_report.json"
SUMMARY_NAME = "gpu_report.md"

TOY_SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


@dataclasses.dataclass
class Sizes:
    """Everything a run's size depends on (``FULL`` on the GPU, ``DRY`` for --dry-run)."""

    device: str
    dtype: str  # the policy's dtype ("bf16" or "fp32")
    shape: dict[str, int]
    prompts: int  # B
    group: int  # G
    rewards: int  # K
    prompt_tokens: tuple[int, int]  # shortest, longest sampling prompt (tokens)
    block_tokens: int  # each verifier block appended for replay
    response_tokens: int
    share: float  # replayed share of (prompt, reward) cells
    rounds: int  # measured rounds of MRTPO / GDPO (plus one warm-up round)
    micro_batch: int
    jsd_vocab: int
    jsd_lengths: tuple[int, ...]
    jsd_chunk: int
    jsd_one_process: bool  # every JSD configuration in one worker (dry run: plumbing only)
    gen_prompts: int
    gen_samples: int
    gen_prompt_tokens: int
    gen_new_tokens: int
    vllm_timeout_s: int


FULL = Sizes(
    device="cuda",
    dtype="bf16",
    shape=QWEN25_05B,
    prompts=8,
    group=4,
    rewards=4,
    prompt_tokens=(1024, 2048),
    block_tokens=48,
    response_tokens=320,
    share=0.15,
    rounds=4,
    micro_batch=4,
    jsd_vocab=151936,
    jsd_lengths=(1024, 4096),
    jsd_chunk=256,
    jsd_one_process=False,
    gen_prompts=32,
    gen_samples=8,
    gen_prompt_tokens=256,
    gen_new_tokens=256,
    vllm_timeout_s=300,
)
DRY = Sizes(
    device="cpu",
    dtype="fp32",
    shape=TOY_SHAPE,
    prompts=2,
    group=2,
    rewards=4,
    prompt_tokens=(48, 96),
    block_tokens=8,
    response_tokens=8,
    share=0.25,
    rounds=1,
    micro_batch=2,
    jsd_vocab=512,
    jsd_lengths=(16, 32),
    jsd_chunk=8,
    jsd_one_process=True,
    gen_prompts=2,
    gen_samples=2,
    gen_prompt_tokens=16,
    gen_new_tokens=4,
    vllm_timeout_s=60,
)


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Skipped(Exception):
    """A stage that cannot run here (a missing feature or package): recorded, not failed."""


class Report:
    """The JSON report, rewritten atomically after every stage."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "schema": 2,
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "status": "running",
            **meta,
            "stages": {},
        }
        self.write()

    @contextlib.contextmanager
    def stage(self, name: str):
        """Records ``ok``/``skipped``/``failed``, seconds, and the error of one stage; an
        exception inside it is recorded and swallowed."""
        log(f">> {name}")
        t0 = time.perf_counter()
        rec: dict[str, Any] = {"status": "failed", "seconds": None}
        self.data["stages"][name] = rec
        try:
            yield rec
            rec["status"] = "ok"
        except Skipped as exc:
            rec["status"], rec["reason"] = "skipped", str(exc)
        except Exception as exc:  # a failed stage is recorded, the run goes on
            rec["error"] = f"{type(exc).__name__}: {exc}"
            rec["traceback"] = traceback.format_exc()[-4000:]
            log(f"!! {name} failed: {rec['error']}")
        finally:
            rec["seconds"] = round(time.perf_counter() - t0, 2)
            log(f"<< {name} ({rec['seconds']} s, {rec['status']})")
            self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=_jsonable) + "\n")
        tmp.replace(self.path)


def _jsonable(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


# ---- features --------------------------------------------------------------------------
def _has(path: str) -> bool:
    """True when dotted attribute ``path`` (``torch.cuda.reset_peak_memory_stats``) exists."""
    mod, *attrs = path.split(".")
    try:
        obj = importlib.import_module(mod)
    except ImportError:
        return False
    for a in attrs:
        if not hasattr(obj, a):
            return False
        obj = getattr(obj, a)
    return True


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # ValueError: present in sys.modules as None
        return False


def _bf16_ok(sizes: Sizes) -> bool:
    import torch

    if sizes.dtype != "bf16":
        return True
    return sizes.device != "cuda" or torch.cuda.is_bf16_supported()


def _dynamic_cache_reorder() -> bool:
    try:
        from transformers import DynamicCache
    except ImportError:
        return False
    return hasattr(DynamicCache, "reorder_cache")


# What each stage needs beyond the packages themselves: (feature, check). The trainer was
# written against torch >= 2.13; these are the pieces it actually calls that older releases
# could lack, so an old torch skips a stage by name instead of failing the run.
NEEDS: dict[str, list[tuple[str, Callable[[Sizes], bool]]]] = {
    "model": [("bf16 on this device (torch.cuda.is_bf16_supported)", _bf16_ok)],
    "steps": [
        ("torch.OutOfMemoryError (replay's retry)", lambda s: _has("torch.OutOfMemoryError")),
        ("lightning.pytorch.Trainer", lambda s: _has("lightning.pytorch.Trainer")),
        ("bf16 on this device (torch.cuda.is_bf16_supported)", _bf16_ok),
    ],
    "numerics": [
        (
            "transformers.DynamicCache.reorder_cache (shared-prefix replay)",
            lambda s: _dynamic_cache_reorder(),
        ),
    ],
    "jsd_memory": [
        (
            "torch.cuda.reset_peak_memory_stats",
            lambda s: s.device != "cuda" or _has("torch.cuda.reset_peak_memory_stats"),
        )
    ],
    "generation": [],
}


def require(stage: str, sizes: Sizes) -> None:
    missing = [name for name, ok in NEEDS.get(stage, []) if not ok(sizes)]
    if missing:
        raise Skipped("needs " + "; ".join(missing))


def _sync(sizes: Sizes) -> None:
    import torch

    if sizes.device == "cuda":
        torch.cuda.synchronize()


def _free(sizes: Sizes) -> None:
    import gc

    import torch

    gc.collect()
    if sizes.device == "cuda":
        torch.cuda.empty_cache()


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None
