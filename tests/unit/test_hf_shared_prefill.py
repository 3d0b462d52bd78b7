"""The HF engine's shared prefill (rl.shared_prompt_forward, passed to the engine as share_prompt): the G samples of a prompt run
its prefix once and continue its cache, and sample what the plain prefill samples."""

from __future__ import annotations

import copy

import pytest
import torch

from mrtpo.core import forward
from mrtpo.core.lora import LoraSettings, apply_lora
from mrtpo.rollout.base import SamplingConfig
from mrtpo.rollout.hf import HFEngine


def _prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (k,), generator=g).tolist() for k in lengths]


def _sample(tiny, mode: str, n: int, batch_size: int = 64, lengths=(40, 9, 23), seed: int = 3):
    model, tok = tiny
    engine = HFEngine(batch_size=batch_size, share_prompt=mode)
    engine.bind(model, tok, [tok.eos_token_id])
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=12)
    return engine.generate(_prompts(len(tok), lengths), n, sampling, seed=seed)


@pytest.mark.parametrize("batch_size", [64, 5])  # one generate call, or groups split across calls
def test_shared_prefill_samples_what_the_plain_prefill_samples(tiny, monkeypatch, batch_size):
    calls = []
    real = forward.prompt_prefix_cache

    def counted(model, groups, *args):
        calls.append(len(groups.first))
        return real(model, groups, *args)

    monkeypatch.setattr(forward, "prompt_prefix_cache", counted)
    plain = _sample(tiny, "off", 4, batch_size)
    assert not calls
    shared = _sample(tiny, "always", 4, batch_size)
    assert calls and sum(calls) < 12  # fewer prefixes than rows: prompts were shared
    assert [g.token_ids for g in shared] == [g.token_ids for g in plain]
    assert [g.finished for g in shared] == [g.finished for g in plain]
    for a, b in zip(shared, plain, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-5, atol=1e-5
        )


def test_shared_prefill_under_lora(tiny):
    base, tok = tiny
    settings = LoraSettings.from_mapping({"r": 4, "target_modules": ["q_proj", "v_proj"]})
    model = apply_lora(copy.deepcopy(base).float(), settings)
    for name, p in model.named_parameters():  # LoRA's B starts at 0: make the adapters count
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    plain, shared = (_sample((model, tok), mode, 4) for mode in ("off", "always"))
    assert [g.token_ids for g in shared] == [g.token_ids for g in plain]
    for a, b in zip(shared, plain, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-5, atol=1e-5
        )


def test_auto_shares_long_prompts_only(tiny, monkeypatch):
    calls = []
    real = forward.prompt_prefix_cache
    monkeypatch.setattr(forward, "prompt_prefix_cache", lambda *a: calls.append(1) or real(*a))
    _sample(tiny, "auto", 4, lengths=(6, 9, 5))  # saves < forward.MIN_SAVED_TOKENS: plain
    _sample(tiny, "always", 1)  # one sample per prompt: nothing to share
    assert not calls
    _sample(tiny, "auto", 4, lengths=(200, 150))  # saves ~1000 of ~1500 prompt tokens
    assert calls == [1]


def test_bad_share_prompt_names_the_key():
    with pytest.raises(ValueError, match=r"rl\.shared_prompt_forward=.sometimes."):
        HFEngine(share_prompt="sometimes")
