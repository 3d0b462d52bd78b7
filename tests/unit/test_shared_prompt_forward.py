"""The shared-prompt forward (each distinct prompt once, rows continuing its key/value cache)
gives the plain forward's log-probs and gradients: fp32, ragged prompts and responses, left
padding, temperature != 1, the tiny model and a LoRA-wrapped one."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from mrtpo.core import forward
from mrtpo.core.forward import pad_left, pad_right, prompt_groups, response_logprobs
from mrtpo.core.lora import LoraSettings, apply_lora


def _batch(vocab: int, pad: int, seed: int = 0):
    """Three prompts of ragged lengths (one alone, two repeated), ragged responses."""
    g = torch.Generator().manual_seed(seed)

    def draw(k):
        return torch.randint(5, vocab, (k,), generator=g).tolist()

    prompts = [draw(11), draw(4), draw(7)]
    rows = [0, 1, 0, 2, 0, 1, 2]  # interleaved: groups need not be contiguous
    p_ids, p_mask = pad_left([prompts[i] for i in rows], pad)
    r_ids, r_mask = pad_right([draw(k) for k in (5, 1, 3, 6, 2, 4, 6)], pad)
    return p_ids, p_mask, r_ids, r_mask


def _logp_and_grads(model, batch, mode: str, tau: float):
    model.zero_grad(set_to_none=True)
    lp = response_logprobs(model, *batch, temperature=tau, shared_prompt=mode)
    weights = torch.linspace(-1.0, 2.0, lp.numel()).reshape(lp.shape)
    (lp * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), grads


def _assert_same(model, batch, tau: float = 0.7) -> None:
    lp0, g0 = _logp_and_grads(model, batch, "off", tau)
    lp1, g1 = _logp_and_grads(model, batch, "always", tau)
    assert lp0.abs().sum() > 0
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys() and g0
    for name in g0:  # absolute slack: fp32 rounding of sums taken in another order
        atol = 1e-6 * max(1.0, float(g0[name].abs().max()))
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=atol, msg=name)


def test_shared_prompt_matches_plain_forward(tiny):
    model, tok = tiny
    model = copy.deepcopy(model).float().train()
    batch = _batch(model.config.vocab_size, tok.pad_token_id)
    groups = prompt_groups(model, batch[0], batch[1], batch[2].shape[1], "always")
    assert groups is not None and len(groups.first) == 3 and groups.width == 10
    _assert_same(model, batch)


def test_shared_prompt_matches_plain_forward_under_lora(tiny):
    base, tok = tiny
    settings = LoraSettings.from_mapping({"r": 4, "target_modules": ["q_proj", "v_proj"]})
    model = apply_lora(copy.deepcopy(base).float(), settings).train()
    for name, p in model.named_parameters():  # LoRA's B starts at 0: make the adapters count
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    batch = _batch(base.config.vocab_size, tok.pad_token_id, seed=1)
    _assert_same(model, batch, tau=1.3)
    # under no_grad too (the old-policy and reference passes), adapters off included
    with torch.no_grad(), model.disable_adapter():
        a = response_logprobs(model, *batch, temperature=0.9, shared_prompt="off")
        b = response_logprobs(model, *batch, temperature=0.9, shared_prompt="always")
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_auto_shares_only_where_it_saves_enough(tiny, caplog):
    model, tok = tiny
    pad, t = tok.pad_token_id, 8
    short, _ = pad_left([[7, 8, 9]] * 8, pad)
    long_ids, long_mask = pad_left([list(range(5, 1005))] * 8, pad)
    distinct, distinct_mask = pad_left([[5 + i] * 1000 for i in range(8)], pad)
    assert prompt_groups(model, long_ids, long_mask, t, "auto") is not None
    assert prompt_groups(model, short, torch.ones_like(short, dtype=torch.bool), t, "auto") is None
    assert prompt_groups(model, distinct, distinct_mask, t, "auto") is None  # G = 1
    assert prompt_groups(model, long_ids, long_mask, t, "off") is None
    with pytest.raises(ValueError, match="shared_prompt"):
        prompt_groups(model, long_ids, long_mask, t, "yes")
    # gradient checkpointing while training: off, said once; in eval mode it still shares
    m = copy.deepcopy(model)
    m.gradient_checkpointing_enable()
    forward._said.clear()
    with caplog.at_level(logging.INFO, logger="mrtpo.core.forward"):
        m.train()
        assert prompt_groups(m, long_ids, long_mask, t, "always") is None
        assert prompt_groups(m, long_ids, long_mask, t, "always") is None
        m.eval()
        assert prompt_groups(m, long_ids, long_mask, t, "always") is not None
    said = [r.getMessage() for r in caplog.records if "shared-prompt" in r.getMessage()]
    assert len(said) == 1 and "gradient checkpointing" in said[0]


def test_teacher_states_match_with_shared_contexts(tiny):
    """The OPSD teacher runs a context repeated by several rows once (no grad)."""
    from mrtpo.core.credit.teacher import Teacher

    model, tok = tiny
    model = copy.deepcopy(model).float().eval()
    g = torch.Generator().manual_seed(2)
    ctxs = [torch.randint(5, 600, (k,), generator=g).tolist() for k in (9, 3, 14)]
    ctx = [ctxs[i] for i in (0, 1, 0, 2, 2, 0)]
    r_ids, r_mask = pad_right(
        [torch.randint(5, 600, (k,), generator=g).tolist() for k in (4, 2, 6, 1, 5, 3)], 0
    )
    assert forward.shared_context_layout(model, ctx, 6, tok.pad_token_id, "always") is not None
    with torch.no_grad():
        plain, head = Teacher(model, tok, shared_prompt="off")._states(model, ctx, r_ids, r_mask)
        shared, _ = Teacher(model, tok, shared_prompt="always")._states(model, ctx, r_ids, r_mask)
    valid = r_mask[..., None].expand_as(plain)
    torch.testing.assert_close(shared[valid], plain[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head(shared)[r_mask], head(plain)[r_mask], rtol=1e-5, atol=1e-5)


# ---- the packed form: where the key/value cache cannot be used ------------------------------


def _checkpointed(model, impl: str):
    """A training-mode copy with gradient checkpointing (the cache form is blocked there)."""
    m = copy.deepcopy(model).float()
    m.set_attn_implementation(impl)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return m.train()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_prompt_matches_plain_forward_under_gradient_checkpointing(tiny, impl):
    model, tok = tiny
    m = _checkpointed(model, impl)
    batch = _batch(model.config.vocab_size, tok.pad_token_id, seed=3)
    assert prompt_groups(m, batch[0], batch[1], batch[2].shape[1], "always") is None
    groups = prompt_groups(m, *batch[:2], batch[2].shape[1], "always", packable=True)
    assert groups is not None and groups.packed and len(groups.first) == 3
    assert groups.width == 11  # the longest prompt, every token of it
    _assert_same(m, batch, tau=0.6)


def test_packed_prompt_matches_plain_forward_under_lora(tiny):
    base, tok = tiny
    settings = LoraSettings.from_mapping({"r": 4, "target_modules": ["q_proj", "v_proj"]})
    model = apply_lora(_checkpointed(base, "sdpa"), settings).train()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    batch = _batch(base.config.vocab_size, tok.pad_token_id, seed=4)
    groups = prompt_groups(model, *batch[:2], batch[2].shape[1], "always", packable=True)
    assert groups is not None and groups.packed
    _assert_same(model, batch, tau=1.3)


def test_packed_form_is_used_only_where_it_saves(tiny, caplog):
    model, tok = tiny
    m = _checkpointed(model, "sdpa")
    pad, t = tok.pad_token_id, 8
    long_ids, long_mask = pad_left([list(range(5, 1005))] * 8, pad)
    forward._said.clear()
    with caplog.at_level(logging.INFO, logger="mrtpo.core.forward"):
        groups = prompt_groups(m, long_ids, long_mask, t, "auto", packable=True)
        assert groups is not None and groups.packed and groups.width == 1000
        assert groups.saved == 8 * 1008 - (1000 + 8 * 8)
        # long responses behind a short prompt: one dense mask over 8 responses would attend
        # over more than the 8 plain rows do
        short_ids, short_mask = pad_left([list(range(5, 305))] * 8, pad)
        assert prompt_groups(m, short_ids, short_mask, 600, "auto", packable=True) is None
        # an attention implementation that takes no 4D mask: not packed, said once
        m.config._attn_implementation = "flash_attention_2"
        assert prompt_groups(m, long_ids, long_mask, t, "auto", packable=True) is None
        assert prompt_groups(m, long_ids, long_mask, t, "auto", packable=True) is None
    said = [r.getMessage() for r in caplog.records if "shared-prompt" in r.getMessage()]
    assert any("packs each group" in s and "gradient checkpointing" in s for s in said)
    # the packed form is a shared-prompt forward: its line does not say "not used" (issue 37)
    assert not any("packs each group" in s and "not used" in s for s in said)
    assert sum("flash_attention_2" in s for s in said) == 1


def test_packed_cost_weighs_attention_against_the_model_size():
    """The text-to-SQL preset's shape (a group of 8 sharing an 800-token prompt, 1,024-token
    responses): a 7B model packs it (its linear layers dominate), the tiny one does not (the
    packed sequence's attention would cost more than the tokens it saves)."""
    from types import SimpleNamespace

    def packs(hidden, inter):
        model = SimpleNamespace(config=SimpleNamespace(hidden_size=hidden, intermediate_size=inter))
        first, rows = torch.tensor([0]), torch.zeros(8, dtype=torch.long)
        return forward._packed_groups(model, first, rows, 800, 8, 1024, "auto", "test")

    assert (
        forward._token_cost(
            SimpleNamespace(config=SimpleNamespace(hidden_size=3584, intermediate_size=18944))
        )
        == 35584
    )
    assert packs(3584, 18944) is not None
    assert packs(64, 128) is None


def test_packed_prompt_with_one_response_token_and_an_empty_response(tiny):
    """Edge shapes of the packed layout: T = 1 (only the prompt's last column is kept) and a
    row whose response is all padding."""
    model, tok = tiny
    m = _checkpointed(model, "sdpa")
    p_ids, p_mask, _, _ = _batch(model.config.vocab_size, tok.pad_token_id, seed=5)
    one = pad_right([[7]] * p_ids.shape[0], tok.pad_token_id)
    assert prompt_groups(m, p_ids, p_mask, 1, "always", packable=True).packed
    _assert_same(m, (p_ids, p_mask, *one), tau=0.9)
    r_ids, r_mask = pad_right([[9, 10, 11], [], [12], [13, 14], [], [15], [16, 17, 18]], 0)
    _assert_same(m, (p_ids, p_mask, r_ids, r_mask), tau=0.9)
