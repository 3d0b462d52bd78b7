"""The ``vllm`` tier: the rollout engine against the real vLLM (its CPU build on a CPU machine).

Every test here carries the ``vllm`` marker. ``make test`` deselects the tier;
``make test-vllm`` installs vLLM's CPU build into the environment and runs it with
``MRTPO_REQUIRE_VLLM=1``, which turns a missing vLLM into a failure instead of a skip.

vLLM's CPU attention needs a head size of at least 32, so the tier's tiny model has two
heads of 32 (``TINY_OVERRIDES``). One engine is started per session and shared: each test
pushes the weights it needs into it first.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

TINY_OVERRIDES = ["model.tiny.num_attention_heads=2", "model.tiny.num_key_value_heads=1"]
TINY_SHAPE = {"num_attention_heads": 2, "num_key_value_heads": 1}


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)


def _vllm_or_skip():
    try:
        import vllm
    except ImportError as exc:
        if os.environ.get("MRTPO_REQUIRE_VLLM") == "1":
            pytest.fail(f"MRTPO_REQUIRE_VLLM=1 but vLLM does not import: {exc}")
        pytest.skip(f"vLLM is not installed (make test-vllm installs its CPU build): {exc}")
    return vllm


@pytest.fixture(scope="session")
def vllm_module():
    return _vllm_or_skip()


@pytest.fixture(scope="session")
def tiny32(cache_dir, vllm_module):
    """(path, model, tokenizer): the tiny model with head_dim 32, where the train configs
    with ``TINY_OVERRIDES`` build it (so training tests and the engine share one folder)."""
    from mrtpo.core.models import TinyModelConfig, build_tiny_model, load_policy

    path = build_tiny_model(cache_dir / "models" / "tiny-qwen2", TinyModelConfig(**TINY_SHAPE))
    model, tok = load_policy(str(path), tiny=None)
    return path, model, tok


@pytest.fixture(scope="session")
def engine(tiny32):
    """One started vLLM engine for the session (CPU defaults: device auto)."""
    from mrtpo.core.models import eos_token_ids
    from mrtpo.rollout.vllm import VLLMEngine

    path, model, tok = tiny32
    eng = VLLMEngine(str(path), seed=0)
    eng.bind(model, tok, eos_token_ids(tok, model))
    yield eng
    eng.shutdown()


def hf_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """The trainer-side log-prob of each response token under softmax(z / temperature)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    z = logits[len(prompt) - 1 : len(prompt) + len(response) - 1] / temperature
    return torch.log_softmax(z, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def perturbed_copy(model, scale: float = 0.05, seed: int = 1):
    """A deep copy of ``model`` with every floating weight moved by seeded noise."""
    import copy

    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return new
