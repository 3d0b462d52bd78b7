"""The vLLM adapter against the real engine: start-up defaults, sampling, seeds, stops,
log-probs, weight sync and the prefix cache."""

from __future__ import annotations

import pytest
import torch
from tests.vllm.conftest import hf_logprobs, perturbed_copy

from mrtpo.rollout.base import SamplingConfig
from mrtpo.rollout.build import build_rollout
from mrtpo.rollout.vllm import VLLMEngine, VLLMUnavailableError
from mrtpo.tasks.base import Example

PROMPT = [5, 17, 42, 99, 7, 3]


def sample(engine, prompts, n=4, seed=0, **kw) -> list:
    kw.setdefault("max_new_tokens", 8)
    return engine.generate(prompts, n, SamplingConfig(**kw), seed)


def test_cpu_defaults_reach_the_engine(engine, tiny32):
    assert engine.device == "cpu"
    assert engine.enforce_eager is True
    assert engine.resolved_dtype() == "float32"  # the trainer's dtype
    assert engine.kv_cache_gb == 1.0
    assert engine.logprobs_mode == "processed_logprobs"
    assert engine.weight_sync.mode == "reload_weights"
    cfg = engine.llm.llm_engine.vllm_config
    assert cfg.cache_config.kv_cache_memory_bytes == 1 << 30
    assert cfg.model_config.dtype == torch.float32
    assert cfg.model_config.enforce_eager is True


def test_sampling_params_are_accepted_and_complete(engine):
    s = SamplingConfig(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, max_new_tokens=6)
    p = engine.sampling_params(s, 3, 11, logprobs=True)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (3, 0.7, 0.9, 5, 0.1)
    assert (p.max_tokens, p.seed, p.logprobs) == (6, 11, 0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert set(engine.eos_ids) <= set(p.stop_token_ids)
    g = engine.sampling_params(SamplingConfig(greedy=True), 1, None, logprobs=False)
    assert g.temperature == 0.0 and g.top_k in (-1, 0) and g.logprobs is None


def test_same_seed_same_tokens_other_seed_other_tokens(engine, tiny32):
    engine.sync_weights(tiny32[1])
    a = [g.token_ids for g in sample(engine, [PROMPT, PROMPT[:3]], seed=3)]
    b = [g.token_ids for g in sample(engine, [PROMPT, PROMPT[:3]], seed=3)]
    c = [g.token_ids for g in sample(engine, [PROMPT, PROMPT[:3]], seed=4)]
    assert a == b
    assert a != c
    assert len({tuple(t) for t in a[:4]}) > 1  # the n samples of one prompt differ


def test_max_tokens_truncates_and_the_mask_covers_the_response(engine, tiny32):
    _, model, tok = tiny32
    engine.sync_weights(model)
    ex = [Example(id="a", messages=[{"role": "user", "content": "hi"}])]
    s = SamplingConfig(temperature=1.0, max_new_tokens=5)
    # with the EOS ids off, nothing can stop a sample before max_new_tokens
    eos, engine.eos_ids = engine.eos_ids, []
    try:
        roll = build_rollout(engine, tok, ex, 3, s, seed=0, eos_ids=())
    finally:
        engine.eos_ids = eos
    assert roll.response_ids.shape == (3, 5)
    assert roll.response_mask.all()
    assert not roll.finished.any()


def test_stop_tokens_end_a_sample_and_are_kept_in_the_mask(engine, tiny32):
    _, model, tok = tiny32
    engine.sync_weights(model)
    stops, engine.stop_token_ids = engine.stop_token_ids, list(range(model.config.vocab_size))
    ex = [Example(id="a", messages=[{"role": "user", "content": "hi"}])]
    try:
        roll = build_rollout(engine, tok, ex, 2, SamplingConfig(max_new_tokens=8), 0, ())
    finally:
        engine.stop_token_ids = stops
    assert roll.finished.all()
    assert roll.response_mask.sum(1).tolist() == [1, 1]  # the stop token itself only


def test_eos_of_the_tokenizer_stops_generation(engine, tiny32):
    model = tiny32[1]
    eos = engine.eos_ids[0]
    boosted = perturbed_copy(model, scale=0.0)
    with torch.no_grad():  # the final norm's output points at the EOS row of the head
        boosted.lm_head.weight[eos] += 50 * boosted.model.norm.weight.sign()
    before = engine.finished_without_eos
    engine.sync_weights(boosted)
    gens = sample(engine, [PROMPT], n=3)
    engine.sync_weights(model)
    assert all(g.finished and g.token_ids[-1] == eos for g in gens)
    assert engine.finished_without_eos == before


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_token_logprobs_equal_the_trainers(engine, tiny32, temperature):
    _, model, _ = tiny32
    engine.sync_weights(model)
    gens = sample(engine, [PROMPT], n=4, temperature=temperature, max_new_tokens=12)
    for g in gens:
        ref = hf_logprobs(model, PROMPT, g.token_ids, temperature)
        assert torch.allclose(torch.tensor(g.logprobs), ref, atol=1e-5), (g.logprobs, ref)


def test_truncated_and_greedy_sampling_report_no_logprobs_and_agree(engine, tiny32):
    engine.sync_weights(tiny32[1])
    greedy = sample(engine, [PROMPT], n=1, greedy=True)
    top1 = sample(engine, [PROMPT], n=2, top_k=1)
    assert greedy[0].logprobs is None and top1[0].logprobs is None
    assert all(g.token_ids == greedy[0].token_ids for g in top1)


def test_reload_weights_sync_makes_the_engine_hold_the_trainers_weights(engine, tiny32):
    _, model, _ = tiny32
    new = perturbed_copy(model)
    engine.sync_weights(new)
    assert engine.last_sync.mode == "reload_weights"
    assert engine.last_sync.num_bytes == sum(t.numel() * 4 for t in new.state_dict().values())
    g = sample(engine, [PROMPT], n=2, temperature=0.7)[0]
    gap_new = (torch.tensor(g.logprobs) - hf_logprobs(new, PROMPT, g.token_ids, 0.7)).abs()
    gap_old = (torch.tensor(g.logprobs) - hf_logprobs(model, PROMPT, g.token_ids, 0.7)).abs()
    engine.sync_weights(model)
    assert gap_new.max() < 1e-5
    assert gap_old.max() > 1e-2  # a skipped sync is visible in the gap


def test_prefix_cache_is_reset_after_a_sync(engine, tiny32, monkeypatch):
    """A long shared prompt fills cached KV blocks; after a sync the same prompt must be
    recomputed with the new weights. With the reset switched off the stale KV shows."""
    _, model, _ = tiny32
    prompt = [(7 * i) % 300 + 10 for i in range(200)]
    new = perturbed_copy(model, seed=5)

    def gap_after_sync(reset: bool) -> float:
        engine.sync_weights(model)
        sample(engine, [prompt], n=1, temperature=1.0, max_new_tokens=2)  # fills the cache
        if not reset:
            monkeypatch.setattr(engine.llm, "reset_prefix_cache", lambda *a, **k: True)
        engine.sync_weights(new)
        monkeypatch.undo()
        g = sample(engine, [prompt], n=1, temperature=1.0, max_new_tokens=4)[0]
        ref = hf_logprobs(new, prompt, g.token_ids, 1.0)
        return float((torch.tensor(g.logprobs) - ref).abs().max())

    with_reset, without = gap_after_sync(True), gap_after_sync(False)
    engine.sync_weights(model)
    assert with_reset < 1e-5
    assert without > 1e-3


def test_forcing_the_cuda_only_paths_fails_naming_the_key(tiny32, vllm_module):
    path = str(tiny32[0])
    with pytest.raises(ValueError, match=r"rollout.engine.weight_sync=auto"):
        VLLMEngine(path, weight_sync="weight_transfer").start()
    with pytest.raises(ValueError, match=r"rollout.engine.enable_sleep_mode=false"):
        VLLMEngine(path, enable_sleep_mode=True)
    with pytest.raises(VLLMUnavailableError, match=r"rollout.engine.device=auto"):
        VLLMEngine(path, device="cuda")


def test_a_model_the_cpu_kernels_cannot_run_fails_naming_the_setting(cache_dir, vllm_module):
    from mrtpo.core.models import TinyModelConfig, build_tiny_model

    path = build_tiny_model(cache_dir / "models" / "tiny-head16", TinyModelConfig())
    with pytest.raises(VLLMUnavailableError, match=r"model.tiny.num_attention_heads=2"):
        VLLMEngine(str(path)).start()


def test_a_long_seeded_prompt_is_not_split_across_steps(engine, tiny32):
    """Prompts longer than vLLM's default step budget (4096 tokens) used to be prefilled in
    chunks, which the CPU build cannot do for seeded requests; they are scheduled whole."""
    engine.sync_weights(tiny32[1])
    long_prompt = [(11 * i) % 300 + 10 for i in range(5000)]
    gens = sample(engine, [long_prompt, PROMPT], n=2, temperature=0.7, max_new_tokens=4)
    assert len(gens) == 4 and all(len(g.token_ids) == 4 for g in gens)
    ref = hf_logprobs(tiny32[1], long_prompt, gens[0].token_ids, 0.7)
    assert torch.allclose(torch.tensor(gens[0].logprobs), ref, atol=1e-5)
