"""A forward drops the leading columns that are padding in every row (a micro-batch padded to
the whole rollout's longest prompt): same log-probs and gradients, fewer tokens computed."""

from __future__ import annotations

import copy

import torch

from mrtpo.core.forward import pad_left, pad_right, response_logprobs


def _logp_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    lp = response_logprobs(model, *batch, temperature=0.7)
    weights = torch.linspace(-1.0, 2.0, lp.numel()).reshape(lp.shape)
    (lp * weights).sum().backward()
    return lp.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def test_all_padding_prompt_columns_are_not_computed(tiny):
    model, tok = tiny
    model = copy.deepcopy(model).float().train()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 600, (k,), generator=g).tolist() for k in (9, 4, 6)]
    responses = [torch.randint(5, 600, (k,), generator=g).tolist() for k in (3, 5, 1)]
    p_ids, p_mask = pad_left(prompts, tok.pad_token_id)
    r_ids, r_mask = pad_right(responses, tok.pad_token_id)
    # the same rows inside a rollout whose longest prompt is 40 tokens longer
    wide_ids = torch.cat([torch.full((3, 40), tok.pad_token_id), p_ids], dim=1)
    wide_mask = torch.cat([torch.zeros((3, 40), dtype=torch.bool), p_mask], dim=1)
    widths = []
    hook = model.register_forward_pre_hook(
        lambda mod, args, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        lp0, g0 = _logp_and_grads(model, (p_ids, p_mask, r_ids, r_mask))
        lp1, g1 = _logp_and_grads(model, (wide_ids, wide_mask, r_ids, r_mask))
    finally:
        hook.remove()
    assert widths == [9 + 5, 9 + 5]  # the longest prompt of the rows + the response width
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-6)
    assert g0.keys() == g1.keys() and g0
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-6, msg=name)
