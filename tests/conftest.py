"""Shared fixtures: the real public data folder (skip when absent) and the tiny offline model."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

import mrtpo.run.config  # noqa: F401  (registers the resolvers the configs use)

# Tests never reach the network: any hub access must fail at once, not wait for a timeout.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tiny model is ~3x faster on one thread than on two (thread hand-off dominates its
# small matrices); subprocesses inherit this too.
_THREADS = os.environ.get("OMP_NUM_THREADS", "").strip()
if not (_THREADS.isdigit() and int(_THREADS) >= 1):  # unset, empty, 0 or not a count
    os.environ["OMP_NUM_THREADS"] = "1"
# ATEN_CPU_CAPABILITY lowers torch's own kernels only; oneDNN still picks AMX/AVX-512 from the
# CPU, and torch 2.13's bf16 attention then fails ("pack_vnni2 is only supported when avx512 is
# supported"). Lower oneDNN with it, as on a CPU that has no more (issue 47).
_ONEDNN_ISA = {"default": "SSE41", "avx2": "AVX2"}.get(os.environ.get("ATEN_CPU_CAPABILITY", ""))
if _ONEDNN_ISA:
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", _ONEDNN_ISA)
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("MRTPO_DATA_DIR", ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` (or $MRTPO_DATA_DIR); tests that need it skip when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"public benchmark files not found at {SHARED_DATA} (set MRTPO_DATA_DIR)")
    return SHARED_DATA


CONFIG_DIR = ROOT / "configs"

#: A one-process command-line run small enough for a test: two prompts of two samples, four new
#: tokens, nothing printed or dumped, a checkpoint every step (tests add their own steps).
SMALL_RUN = (
    "print_config=false",
    "rl.prompts_per_step=2",
    "rl.group_size=2",
    "rollout.sampling.max_new_tokens=4",
    "callbacks.progress=null",
    "callbacks.sample_table=null",
    "callbacks.relevance_dump=null",
    "callbacks.model_checkpoint.every_n_train_steps=1",
)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """A cache folder shared by the session: the tiny model is built here once."""
    return tmp_path_factory.mktemp("cache")


def compose_config(name: str, overrides: list[str]):
    """The real Hydra config, composed as the entry points compose it."""
    from mrtpo.run.config import compose

    return compose(name, overrides, config_dir=CONFIG_DIR)


@pytest.fixture
def train_cfg(tmp_path, cache_dir):
    """``train_cfg(*overrides)``: the train config shrunk for a CPU smoke run in tmp_path."""

    def make(*overrides: str):
        base = [
            f"paths.output_dir={tmp_path}",
            f"paths.log_dir={tmp_path}/logs",
            f"paths.cache_dir={cache_dir}",
            f"paths.data_dir={SHARED_DATA}",
            "print_config=false",
            "trainer.max_steps=2",
            "rl.prompts_per_step=2",
            "rl.group_size=2",
            "rollout.sampling.max_new_tokens=8",
            "callbacks.progress=null",
        ]
        return compose_config("train.yaml", base + list(overrides))

    return make


@pytest.fixture(scope="session")
def tiny(cache_dir):
    """(model, tokenizer) of the tiny offline model, built once and loaded from disk."""
    from mrtpo.core.models import load_policy

    model, tok = load_policy(str(cache_dir / "models" / "tiny-qwen2"), tiny={})
    return model, tok


@pytest.fixture(autouse=True)
def _mrtpo_log_left_as_found():
    """A test that leaves the mrtpo logger muted makes every later caplog test fail far from
    the cause (a harness run in-process once did): fail the test that did it instead."""
    lg = logging.getLogger("mrtpo")
    before = (lg.level, lg.disabled, lg.propagate)
    yield
    after = (lg.level, lg.disabled, lg.propagate)
    if after != before:
        lg.setLevel(before[0])
        lg.disabled, lg.propagate = before[1], before[2]
        pytest.fail(
            f"the test left the mrtpo logger changed (level, disabled, propagate): "
            f"{before} -> {after}"
        )


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test: the tiny model runs about 3x faster on one thread than
    on two contended ones here."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
