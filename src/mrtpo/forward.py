"""Forward passes over (context, response) pairs, scoring only the response positions.

Contexts are left-padded and responses right-padded, so every response starts at the same
column: the logits that predict response token t sit at column ``P - 1 + t``. The LM head
runs only on the last ``T + 1`` columns (``logits_to_keep``), never on the prompt.

Replay wants more than one log-prob per position (the whole next-token distribution), so it
asks for hidden states instead of logits (``response_hidden``) and applies the LM head a few
positions at a time: the ``[n, T, V]`` logits tensor, the largest thing in a forward at a
152k vocabulary, is then never materialized.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mrtpo.loss import token_logprobs


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
    inputs = _joined(model, prompt_ids, prompt_mask, response_ids, response_mask)
    out = model(**inputs, logits_to_keep=response_ids.shape[1] + 1, use_cache=False)
    return out.logits[:, :-1]


def _joined(model, prompt_ids, prompt_mask, response_ids, response_mask) -> dict[str, Tensor]:
    """The model's keyword inputs for context + response rows, on the model's device.
    Positions count only real tokens, so left padding does not shift them."""
    device = next(model.parameters()).device
    ids = torch.cat([prompt_ids, response_ids], dim=1).to(device)
    attn = torch.cat([prompt_mask, response_mask], dim=1).to(device)
    pos = (attn.long().cumsum(-1) - 1).clamp_min(0)
    return {"input_ids": ids, "attention_mask": attn.long(), "position_ids": pos}


# Architectures whose logits are exactly ``lm_head(decoder(...).last_hidden_state)``: no
# logit soft-capping or scaling after the head (Gemma 2/3, Cohere, Granite have one).
PLAIN_HEAD_MODEL_TYPES = frozenset(
    {"qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "llama", "mistral", "mixtral", "phi3"}
)


def split_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """``(decoder, lm_head)`` when logits are the head applied to the decoder's last hidden
    state, else ``None`` (callers then fall back to full logits)."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
        return None
    get_dec = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if get_dec is None or get_head is None:
        return None
    dec, head = get_dec(), get_head()
    if dec is None or dec is model or not isinstance(head, torch.nn.Linear):
        return None
    return dec, head


def response_hidden(
    decoder: torch.nn.Module,
    prompt_ids: Tensor,  # [n, P] left-padded
    prompt_mask: Tensor,  # [n, P]
    response_ids: Tensor,  # [n, T] right-padded
    response_mask: Tensor,  # [n, T]
) -> Tensor:
    """Final hidden states that predict each response token: [n, T, H] (model dtype)."""
    inputs = _joined(decoder, prompt_ids, prompt_mask, response_ids, response_mask)
    t = response_ids.shape[1]
    h = decoder(**inputs, use_cache=False).last_hidden_state
    return h[:, h.shape[1] - t - 1 : h.shape[1] - 1]


def response_hidden_shared_prefix(
    decoder: torch.nn.Module,
    prefix_ids: Tensor,  # [R, L] left-padded prefixes
    prefix_mask: Tensor,  # [R, L]
    row_prefix: Tensor,  # [n] long, which prefix each row continues
    prefix_keep: Tensor,  # [n] long, how many of that prefix's tokens the row sees
    suffix_ids: Tensor,  # [n, S] left-padded, S >= 1 (the last context token is here)
    suffix_mask: Tensor,  # [n, S]
    response_ids: Tensor,  # [n, T] right-padded
    response_mask: Tensor,  # [n, T]
) -> Tensor:
    """Like ``response_hidden`` for contexts ``prefix[row_prefix[i]][:prefix_keep[i]] +
    suffix[i]``: each prefix runs once, and every row continuing it reuses the first
    ``prefix_keep[i]`` positions of its key/value cache (the rest is masked out).

    Left-padded prefixes and suffixes put padding (and masked-out prefix tokens) in the
    middle of a row; positions count visible tokens only and hidden keys are masked, so each
    row is computed as if its context were one unpadded sequence.
    """
    device = next(decoder.parameters()).device
    p_mask = prefix_mask.to(device)
    p_pos = (p_mask.long().cumsum(-1) - 1).clamp_min(0)
    out = decoder(
        input_ids=prefix_ids.to(device),
        attention_mask=p_mask.long(),
        position_ids=p_pos,
        use_cache=True,
    )
    cache = out.past_key_values
    rows = row_prefix.to(device)
    cache.reorder_cache(rows)
    width = p_mask.shape[1]
    start = width - p_mask[rows].sum(-1)  # first real column of each row's prefix
    cols = torch.arange(width, device=device)[None, :]
    seen = p_mask[rows] & (cols < (start + prefix_keep.to(device))[:, None])
    seg_ids = torch.cat([suffix_ids, response_ids], dim=1).to(device)
    seg_mask = torch.cat([suffix_mask, response_mask], dim=1).to(device)
    full = torch.cat([seen, seg_mask], dim=1)
    pos = (full.long().cumsum(-1) - 1).clamp_min(0)[:, width:]
    out = decoder(
        input_ids=seg_ids,
        attention_mask=full.long(),
        position_ids=pos,
        past_key_values=cache,
        use_cache=True,
    )
    h = out.last_hidden_state
    s, t = suffix_ids.shape[1], response_ids.shape[1]
    return h[:, s - 1 : s - 1 + t]


def response_logprobs(
    model, prompt_ids, prompt_mask, response_ids, response_mask, temperature: float = 1.0
) -> Tensor:
    """log pi_tau(y_t | context, y_<t) in float32: [n, T] (0 on pads), where
    ``pi_tau = softmax(logits / temperature)`` is the distribution the tokens were sampled
    from (``RolloutBatch.temperature``)."""
    logits = response_logits(model, prompt_ids, prompt_mask, response_ids, response_mask)
    lp = token_logprobs(logits, response_ids.to(logits.device), temperature=temperature)
    return lp * response_mask.to(lp.device)
