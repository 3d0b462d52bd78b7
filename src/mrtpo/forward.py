"""Forward passes over (context, response) pairs, scoring only the response positions.

Contexts are left-padded and responses right-padded, so every response starts at the same
column: the logits that predict response token t sit at column ``P - 1 + t``. The LM head
runs only on the last ``T + 1`` columns (``logits_to_keep``), never on the prompt.
"""

from __future__ import annotations

import torch
from torch import Tensor


def pad_left(seqs: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """[n, P] ids and bool mask from variable-length token lists, padded on the left."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = True
    return ids, mask


def pad_right(seqs: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """[n, T] ids and bool mask, padded on the right (T >= 1)."""
    width = max(1, max((len(s) for s in seqs), default=0))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        if s:
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = True
    return ids, mask


def response_logits(
    model: torch.nn.Module,
    prompt_ids: Tensor,  # [n, P] left-padded
    prompt_mask: Tensor,  # [n, P]
    response_ids: Tensor,  # [n, T] right-padded
    response_mask: Tensor,  # [n, T]
) -> Tensor:
    """Logits predicting each response token: [n, T, V] (in the model's dtype)."""
    device = next(model.parameters()).device
    ids = torch.cat([prompt_ids, response_ids], dim=1).to(device)
    attn = torch.cat([prompt_mask, response_mask], dim=1).to(device)
    # Positions count only real tokens, so left padding does not shift them.
    pos = (attn.long().cumsum(-1) - 1).clamp_min(0)
    t = response_ids.shape[1]
    out = model(
        input_ids=ids,
        attention_mask=attn.long(),
        position_ids=pos,
        logits_to_keep=t + 1,
        use_cache=False,
    )
    return out.logits[:, :-1]


def response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask) -> Tensor:
    """log pi(y_t | context, y_<t) in float32: [n, T] (0 on pads)."""
    from mrtpo.loss import token_logprobs

    logits = response_logits(model, prompt_ids, prompt_mask, response_ids, response_mask)
    lp = token_logprobs(logits, response_ids.to(logits.device))
    return lp * response_mask.to(lp.device)
