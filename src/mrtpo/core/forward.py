"""Forward passes over (context, response) pairs, scoring only the response positions.

Contexts are left-padded and responses right-padded, so every response starts at the same
column: the logits that predict response token t sit at column ``P - 1 + t``. The LM head
runs only on the last ``T + 1`` columns (``logits_to_keep``), never on the prompt.

Each prompt once per group, the cache form and the packed one (``rl.shared_prompt_forward``):
docs/scaling.md. Replay and the teacher take hidden states (``response_hidden``) and apply the
LM head a chunk at a time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mrtpo.core.loss import token_logprobs
from mrtpo.distributed import is_sharded

log = logging.getLogger(__name__)


def shared_prompt_mode(value: Any) -> str | None:
    """``rl.shared_prompt_forward`` as ``auto``, ``off`` or ``always`` (YAML's ``false``/``true``
    read as off/auto); None when it is none of them."""
    mode = str(value).lower()
    mode = {"false": "off", "true": "auto"}.get(mode, mode)
    return mode if mode in ("auto", "off", "always") else None


def pad_left(seqs: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """[n, P] ids and bool mask from variable-length token lists, padded on the left."""
    return _padded(seqs, pad_id, left=True, width=max((len(s) for s in seqs), default=0))


def pad_right(seqs: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """[n, T] ids and bool mask, padded on the right (T >= 1)."""
    return _padded(seqs, pad_id, left=False, width=max(1, max((len(s) for s in seqs), default=0)))


def _padded(seqs: list[list[int]], pad_id: int, left: bool, width: int) -> tuple[Tensor, Tensor]:
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        if s:
            cols = slice(width - len(s), width) if left else slice(0, len(s))
            ids[i, cols] = torch.tensor(s, dtype=torch.long)
            mask[i, cols] = True
    return ids, mask


def response_logits(
    model: torch.nn.Module,
    prompt_ids: Tensor,  # [n, P] left-padded
    prompt_mask: Tensor,  # [n, P]
    response_ids: Tensor,  # [n, T] right-padded
    response_mask: Tensor,  # [n, T]
    shared_prompt: str = "off",  # "auto": each distinct prompt once where that helps
    hidden: Tensor | None = None,  # [n, P] context tokens no other token attends to
) -> Tensor:
    """Logits predicting each response token: [n, T, V] (model dtype); ``hidden`` context tokens
    keep their positions but are hidden from attention."""
    t = response_ids.shape[1]
    mode = "off" if hidden is not None else shared_prompt
    groups = prompt_groups(model, prompt_ids, prompt_mask, t, mode, packable=True)
    if groups is not None:
        run = _packed_prompt_logits if groups.packed else _shared_prompt_logits
        return run(model, groups, prompt_ids, prompt_mask, response_ids, response_mask)
    inputs = _joined(model, prompt_ids, prompt_mask, response_ids, response_mask, hidden)
    out = model(**inputs, logits_to_keep=response_ids.shape[1] + 1, use_cache=False)
    return out.logits[:, :-1]


def positions(mask: Tensor) -> Tensor:
    """Position ids counting only a row's real tokens (``mask``), so padding anywhere does not
    shift them (0 on leading padding)."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


def _joined(
    model, prompt_ids, prompt_mask, response_ids, response_mask, hidden=None
) -> dict[str, Tensor]:
    """The model's keyword inputs for context + response rows, on its device. Leading columns
    that are padding in every row are dropped (41% of a text-to-SQL forward's tokens were).
    ``hidden`` [n, P] (``method.context=mask``): tokens no later token attends to."""
    device = next(model.parameters()).device
    real = prompt_mask.any(0)
    if bool(real.any()) and not bool(real[0]):
        first = int(real.to(torch.int8).argmax())
        prompt_ids, prompt_mask = prompt_ids[:, first:], prompt_mask[:, first:]
        hidden = None if hidden is None else hidden[:, first:]
    ids = torch.cat([prompt_ids, response_ids], dim=1).to(device)
    attn = torch.cat([prompt_mask, response_mask], dim=1).to(device)
    pos = positions(attn)
    if hidden is not None:
        hid = torch.cat([hidden.bool(), torch.zeros(response_mask.shape, dtype=torch.bool)], 1)
        mask = hidden_mask(model, attn.bool(), hid.to(device))
        return {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
    return {"input_ids": ids, "attention_mask": attn.long(), "position_ids": pos}


def hidden_mask(model, real: Tensor, hidden: Tensor, seen: Tensor | None = None) -> Tensor:
    """[n, 1, S, W + S] mask of ``S`` new columns (``real`` [n, S]) whose ``hidden`` ones are keys
    to no other column (they still read earlier visible ones, staying finite), after ``W`` cached
    keys each row reads per ``seen`` [n, W] (W = 0 when None). Every column sees itself."""
    s = real.shape[1]
    allowed = torch.ones((s, s), dtype=torch.bool, device=real.device).tril()
    return _attention_mask(model, allowed, real & ~hidden, real.device, seen)


# Architectures whose logits are exactly ``lm_head(decoder(...).last_hidden_state)``: no
# logit soft-capping or scaling after the head (Gemma 2/3, Cohere, Granite have one).
PLAIN_HEAD_MODEL_TYPES = frozenset(
    {"qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "llama", "mistral", "mixtral", "phi3"}
)


def split_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """``(decoder, lm_head)`` when logits are the head on the decoder's last hidden state and the
    two may be called apart, else ``None`` (callers use full logits). Not under FSDP: the head
    sits in the root unit, whose weights only a root forward gathers."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    if is_sharded(model):  # only a call to the root gathers the root unit's weights
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
    hidden: Tensor | None = None,  # [n, P] context tokens hidden from attention
) -> Tensor:
    """Final hidden states that predict each response token: [n, T, H] (model dtype)."""
    inputs = _joined(decoder, prompt_ids, prompt_mask, response_ids, response_mask, hidden)
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
    suffix_hidden: Tensor | None = None,  # [n, S] suffix tokens hidden from attention
) -> Tensor:
    """``response_hidden`` for contexts ``prefix[row_prefix[i]][:prefix_keep[i]] + suffix[i]``:
    each prefix runs once and its rows reuse the first ``prefix_keep[i]`` cached positions.
    Positions count visible tokens only, so mid-row padding changes nothing."""
    device = next(decoder.parameters()).device
    p_mask, rows = prefix_mask.to(device), row_prefix.to(device)
    cache = _prefix_cache(decoder, prefix_ids.to(device), p_mask, rows)
    width = p_mask.shape[1]
    start = width - p_mask[rows].sum(-1)  # first real column of each row's prefix
    cols = torch.arange(width, device=device)[None, :]
    seen = p_mask[rows] & (cols < (start + prefix_keep.to(device))[:, None])
    seg_ids = torch.cat([suffix_ids, response_ids], dim=1)
    seg_mask = torch.cat([suffix_mask, response_mask], dim=1)
    seg_hidden = None
    if suffix_hidden is not None:
        seg_hidden = torch.cat([suffix_hidden.bool(), torch.zeros_like(response_mask.bool())], 1)
    h = _continue_cache(decoder, cache, seen, seg_ids, seg_mask, seg_hidden).last_hidden_state
    s, t = suffix_ids.shape[1], response_ids.shape[1]
    return h[:, s - 1 : s - 1 + t]


def response_logprobs(
    model,
    prompt_ids,
    prompt_mask,
    response_ids,
    response_mask,
    temperature: float = 1.0,
    shared_prompt: str = "off",
) -> Tensor:
    """log pi_tau(y_t | context, y_<t) in float32: [n, T] (0 on pads), ``pi_tau = softmax(logits
    / temperature)`` being the sampling distribution (``RolloutBatch.temperature``)."""
    logits = response_logits(
        model, prompt_ids, prompt_mask, response_ids, response_mask, shared_prompt=shared_prompt
    )
    lp = token_logprobs(logits, response_ids.to(logits.device), temperature=temperature)
    return lp * response_mask.to(lp.device)


# ---- each prompt once: the shared-prompt forward ------------------------------------------
#: ``shared_prompt`` values: ``auto`` shares where it saves enough (``worth_sharing``), ``off``
#: never, ``always`` wherever it can (tests, benchmarks).
SHARED_PROMPT_MODES = ("auto", "off", "always")
#: ``auto`` shares only when that skips at least this share of the tokens a plain forward
#: computes, and at least ``MIN_SAVED_TOKENS``: the second decoder call has a fixed cost
#: (measurements: docs/scaling.md).
MIN_SAVED_SHARE = 0.1
MIN_SAVED_TOKENS = 256

_said: set[str] = set()


@dataclass
class PromptGroups:
    """Which rows of a batch repeat which prompt (identical ids and mask)."""

    first: Tensor  # [R] long: one row holding each distinct prompt
    row_prefix: Tensor  # [n] long: each row's distinct prompt (index into ``first``)
    width: int  # columns of the shared prefixes (the longest one, less its last token)
    saved: int  # tokens a plain forward computes that the shared one does not
    packed: bool = False  # one packed sequence per group (``_packed_prompt_logits``)


def shared_prompt_blocker(model: torch.nn.Module, in_step: bool = False) -> str | None:
    """Why ``model`` cannot run the shared-prompt forward now (None: it can), from the model and
    its mode only. ``in_step``: the caller agrees with the other ranks first (HF engine), so FSDP
    does not block it."""
    reason = _architecture_blocker(model, "key/value cache")
    if reason is not None:
        return reason
    if is_sharded(model) and not in_step:
        return "trainer=fsdp (each extra forward is a collective; kept to one per micro-batch)"
    if model.training and any(
        getattr(m, "gradient_checkpointing", False) is True for m in model.modules()
    ):
        return (
            "gradient checkpointing while training (HF drops the key/value cache in "
            "checkpointed layers); the no-grad passes in eval mode still share"
        )
    return None


#: Attention implementations that apply a 4D mask as given (the packed forward passes one).
MASKED_ATTENTION = ("sdpa", "eager")


def packed_prompt_blocker(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run the packed shared-prompt forward (None: it can): it needs a
    4D mask applied as given (SDPA or eager attention) and no sliding window."""
    reason = _architecture_blocker(model, "packed forward")
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if reason is None and impl not in MASKED_ATTENTION:
        reason = f"attention implementation {impl!r} (the packed forward needs one of {MASKED_ATTENTION})"
    return reason


def _architecture_blocker(model, form: str) -> str | None:
    """Why ``model``'s architecture rules out a shared-prompt ``form`` (None: it does not);
    a windowed cache does not hold the whole prompt, and HF adds no window to a given mask."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in PLAIN_HEAD_MODEL_TYPES:
        return f"model type {kind!r} is not one whose {form} is checked here"
    if windowed(model):
        return f"sliding-window attention (not carried by the {form})"
    return None


def windowed(model) -> bool:
    """True when some attention layer is windowed (a cache would not hold a whole prefix)."""
    cfg = getattr(model, "config", None)
    types = getattr(cfg, "layer_types", None)
    if types:
        return any(t != "full_attention" for t in types)
    return bool(getattr(cfg, "sliding_window", None)) and getattr(cfg, "use_sliding_window", True)


def _say_once(reason: str, used: bool = False) -> None:
    """Log once per reason why the cache form of the shared-prompt forward is not used
    (``used``: a form of it is, ``reason`` says which)."""
    if reason not in _said:
        _said.add(reason)
        log.info("%s%s", "" if used else "shared-prompt forward not used: ", reason)


def prompt_groups(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    t: int,
    mode: str = "auto",
    packable: bool = False,
    in_step: bool = False,
) -> PromptGroups | None:
    """The batch's distinct prompts when the shared-prompt forward is to run, else None; where
    the cache form is blocked (``shared_prompt_blocker``) and ``packable``, ``packed`` ones."""
    if mode not in SHARED_PROMPT_MODES:
        raise ValueError(f"shared_prompt={mode!r}; use one of {list(SHARED_PROMPT_MODES)}")
    n, width = prompt_ids.shape
    if mode == "off" or n < 2 or width < 2 or not bool(prompt_mask[:, -1].all()):
        return None  # nothing to share, or a row without prompt tokens
    blocker = shared_prompt_blocker(model, in_step)
    if blocker is not None:
        unpackable = packed_prompt_blocker(model) if packable else blocker
        if unpackable is not None:
            _say_once(blocker if unpackable == blocker else f"{blocker}; not packed: {unpackable}")
            return None
    keyed = torch.where(prompt_mask.bool(), prompt_ids, -1)
    uniq, row_prefix = torch.unique(keyed, dim=0, return_inverse=True)
    lengths = (uniq[:, :-1] >= 0).sum(-1)  # each prefix's real tokens
    r, w = uniq.shape[0], int(lengths.max())
    if r == n or w == 0:
        if mode == "auto":
            _say_once("some forwards have no two rows sharing a prompt")
        return None
    first = torch.zeros(r, dtype=torch.long).scatter_(0, row_prefix, torch.arange(n))
    if blocker is not None:
        return _packed_groups(model, first, row_prefix, w + 1, n, t, mode, blocker)
    plain = n * (width + t)
    saved = plain - r * w - n * (1 + t)  # the rows pass reads the prefix, computes 1 + t
    groups = PromptGroups(first=first, row_prefix=row_prefix, width=w, saved=saved)
    if mode == "always" or worth_sharing(groups.saved, plain):
        return groups
    _say_once(
        f"some forwards' shared prompts are too short to pay for a second decoder call "
        f"(it must save >= {MIN_SAVED_TOKENS} tokens and >= {MIN_SAVED_SHARE:.0%} of them)"
    )
    return None


def _packed_groups(model, first, row_prefix, width, n, t, mode, why) -> PromptGroups | None:
    """``prompt_groups`` for the packed form: ``R`` sequences of ``width + M t`` columns (M: the
    largest group); ``auto`` also needs ``tokens x c + pairs`` (``_token_cost``) to be no more."""
    r = first.numel()
    m = int(torch.bincount(row_prefix, minlength=r).max())
    packed_len, plain_len = width + m * t, width + t
    plain = n * plain_len
    groups = PromptGroups(
        first=first, row_prefix=row_prefix, width=width, saved=plain - r * packed_len, packed=True
    )
    c = _token_cost(model)
    cheaper = r * (c * packed_len + packed_len**2) <= n * (c * plain_len + plain_len**2)
    if mode == "always" or (worth_sharing(groups.saved, plain) and cheaper):
        _say_once(f"shared-prompt forward packs each group into one sequence: {why}", used=True)
        return groups
    _say_once(
        "some packed forwards would not pay (they must save >= "
        f"{MIN_SAVED_TOKENS} tokens and >= {MIN_SAVED_SHARE:.0%} of them, at no more cost "
        "counting the attention over each packed sequence)"
    )
    return None


def _token_cost(model) -> float:
    """One token's linear layers in units of one attention (query, key) pair per layer:
    ``2 (4 h^2 + 3 h i)`` against ``4 h`` FLOPs. About 320 tiny, 35,600 for a 7B Qwen2.5."""
    cfg = model.config
    h = int(cfg.hidden_size)
    i = int(getattr(cfg, "intermediate_size", None) or 4 * h)
    return (4 * h + 3 * i) / 2


def _common_prefix(seqs: list[list[int]]) -> int:
    """How many leading tokens every sequence in ``seqs`` shares."""
    for i, column in enumerate(zip(*seqs)):
        if len(set(column)) > 1:
            return i
    return min(len(s) for s in seqs)


def prefix_layout(
    contexts: list[list[int]],
    groups: list,
    t: int,
    layouts: tuple[str, ...] = ("common",),
    bases: dict | None = None,
    is_base: list[bool] | None = None,
):
    """The cheapest of ``layouts`` for ``response_hidden_shared_prefix`` (None: nothing
    shared): (prefixes, row prefix index, tokens each row sees, suffixes, padded cost).
    A group's rows share ``common``: what all its contexts share; or ``branch``: its base
    context (``bases[group]``) but the last token, each row reading it up to where it departs
    (the base row, ``is_base``, all of it). Every row keeps one context token of its own."""
    members: dict = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    index = {g: n for n, g in enumerate(members)}
    row_prefix = torch.tensor([index[g] for g in groups])
    best = None
    for layout in layouts:
        prefixes: list[list[int]] = []
        keep = [0] * len(contexts)
        for g, rows in members.items():
            if layout == "common":
                seqs = [contexts[i] for i in rows]
                cut = max(min(_common_prefix(seqs), min(len(x) for x in seqs) - 1), 0)
                prefixes.append(seqs[0][:cut])
                for i in rows:
                    keep[i] = cut
            else:
                b = bases[g]
                prefixes.append(b[:-1])
                for i in rows:
                    ids = contexts[i]
                    k = len(b) - 1 if is_base[i] else _common_prefix([b, ids])
                    keep[i] = max(min(k, len(ids) - 1, len(b) - 1), 0)
        if max(keep, default=0) <= 0:
            continue
        suffixes = [c[keep[i] :] for i, c in enumerate(contexts)]
        cost = len(prefixes) * max(len(p) for p in prefixes) + len(contexts) * (
            max(len(x) for x in suffixes) + t
        )
        if best is None or cost < best[-1]:
            best = (prefixes, row_prefix, torch.tensor(keep), suffixes, cost)
    return best


def shared_context_layout(model, contexts: list[list[int]], t: int, pad_id: int, mode="auto"):
    """``response_hidden_shared_prefix``'s context arguments for token-list contexts (identical
    ones share all but their last token), or None for the plain ``response_hidden`` (rules as
    ``prompt_groups``). For no-grad callers (the teacher)."""
    if mode not in SHARED_PROMPT_MODES:
        raise ValueError(f"shared_prompt={mode!r}; use one of {list(SHARED_PROMPT_MODES)}")
    n = len(contexts)
    if mode == "off" or n < 2 or any(len(c) < 2 for c in contexts):
        return None
    blocker = shared_prompt_blocker(model)
    if blocker is not None:
        _say_once(blocker)
        return None
    keys = [tuple(c) for c in contexts]
    if len(set(keys)) == n:
        return None
    prefixes, row_prefix, keep, suffixes, cost = prefix_layout(contexts, keys, t)
    plain = n * (max(len(c) for c in contexts) + t)
    if mode == "auto" and not worth_sharing(plain - cost, plain):
        return None
    p_ids, p_mask = pad_left(prefixes, pad_id)
    s_ids, s_mask = pad_left(suffixes, pad_id)
    return p_ids, p_mask, row_prefix, keep.to(torch.long), s_ids, s_mask


def worth_sharing(saved: int, plain: int) -> bool:
    """Whether skipping ``saved`` of ``plain`` tokens pays for a second decoder call."""
    return saved >= MIN_SAVED_SHARE * plain and saved >= MIN_SAVED_TOKENS


def _shared_prompt_logits(
    model, groups: PromptGroups, prompt_ids, prompt_mask, response_ids, response_mask
):
    """``response_logits`` with each row's last prompt token and response continuing its
    prompt's prefix cache (``prompt_prefix_cache``)."""
    cache, seen = prompt_prefix_cache(model, groups, prompt_ids, prompt_mask)
    seg_ids = torch.cat([prompt_ids[:, -1:], response_ids], dim=1)
    seg_mask = torch.cat([prompt_mask[:, -1:], response_mask], dim=1)
    out = _continue_cache(model, cache, seen, seg_ids, seg_mask, logits_to_keep=seg_ids.shape[1])
    return out.logits[:, :-1]


def _attention_mask(model, allowed: Tensor, key: Tensor, device, seen: Tensor | None = None):
    """[R, 1, S, S] mask: ``allowed`` column pairs among each row's ``key`` columns, plus itself;
    with ``seen`` [R, W], ``W`` cached keys first ([R, 1, S, W + S]). Eager attention adds its
    mask: 0 where allowed, the most negative float elsewhere."""
    s = allowed.shape[0]
    eye = torch.eye(s, dtype=torch.bool, device=allowed.device)
    mask = (allowed[None] & key[:, None, :].to(allowed.device)) | eye[None]
    if seen is not None:
        seen = seen.to(allowed.device)
        cached = seen[:, None, :] & key[:, :, None].to(allowed.device)
        mask = torch.cat([cached.expand(-1, s, -1), mask], dim=2)
    mask = mask[:, None].to(device)
    if getattr(model.config, "_attn_implementation", None) == "eager":
        mask = torch.zeros(mask.shape, device=device).masked_fill_(
            ~mask, torch.finfo(torch.float32).min
        )
    return mask


def _packed_prompt_logits(
    model, groups: PromptGroups, prompt_ids, prompt_mask, response_ids, response_mask
):
    """``response_logits`` with each group as one sequence: its prompt (``groups.width``
    columns), then a ``T``-column segment per row that sees the prompt and itself, positions
    restarting after the prompt. The prompt's last column predicts every row's first token
    (the gather sums their gradients there)."""
    device = next(model.parameters()).device
    n, p = prompt_ids.shape
    t, w = response_ids.shape[1], groups.width
    # the layout is built on the CPU (index tensors, small) and moved once
    prompt_ids, prompt_mask, response_ids = prompt_ids.cpu(), prompt_mask.cpu(), response_ids.cpu()
    rows, first = groups.row_prefix.cpu(), groups.first.cpu()
    r = first.numel()
    order = torch.argsort(rows, stable=True)
    counts = torch.bincount(rows, minlength=r)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty(n, dtype=torch.long)
    slot[order] = torch.arange(n) - starts[rows[order]]
    m = int(counts.max())
    s = w + m * t
    cols = torch.arange(t)
    seg_cols = w + slot[:, None] * t + cols[None, :]  # [n, T] each row's segment columns

    ids = torch.zeros((r, s), dtype=torch.long)
    ids[:, :w] = prompt_ids[first, p - w :]
    ids[rows[:, None], seg_cols] = response_ids
    prompt_real = prompt_mask[first, p - w :].bool()  # [R, W]
    length = prompt_real.sum(-1)  # [R] each prompt's real tokens
    pos = torch.zeros((r, s), dtype=torch.long)
    pos[:, :w] = positions(prompt_real)
    pos[rows[:, None], seg_cols] = length[rows][:, None] + cols[None, :]
    key = torch.zeros((r, s), dtype=torch.bool)  # columns a later column may attend to
    key[:, :w] = prompt_real
    key[rows[:, None], seg_cols] = True
    seg = torch.cat([torch.full((w,), -1), torch.arange(m).repeat_interleave(t)])
    allowed = torch.ones((s, s), dtype=torch.bool).tril() & (
        (seg[None, :] < 0) | (seg[None, :] == seg[:, None])
    )
    mask = _attention_mask(model, allowed, key, device)
    keep = torch.cat(
        [torch.tensor([w - 1]), (w + torch.arange(m)[:, None] * t + cols[None, :-1]).flatten()]
    )
    out = model(
        input_ids=ids.to(device),
        attention_mask=mask,
        position_ids=pos.to(device),
        use_cache=False,
        logits_to_keep=keep.to(device),
    )
    # kept column 0 predicts every row's first token; row i's t-th token (t >= 1) is
    # predicted by kept column 1 + slot_i (T - 1) + t - 1
    pick = torch.cat(
        [torch.zeros((n, 1), dtype=torch.long), 1 + slot[:, None] * (t - 1) + cols[None, :-1]], 1
    )
    return out.logits[rows[:, None].to(device), pick.to(device)]


def prompt_prefix_cache(model, groups: PromptGroups, prompt_ids: Tensor, prompt_mask: Tensor):
    """Each distinct prompt's prefix (all but its last token) run once, its cache reordered
    to the rows (``index_select``: differentiable). Returns it and ``seen`` [n, W], the cached
    keys each row reads."""
    device = next(model.parameters()).device
    w = groups.width
    p_ids = prompt_ids[groups.first, -1 - w : -1].to(device)
    p_mask = prompt_mask[groups.first, -1 - w : -1].to(device)
    rows = groups.row_prefix.to(device)
    split = split_head(model)
    if split is not None:  # the decoder alone: no LM head on the prefix
        return _prefix_cache(split[0], p_ids, p_mask, rows), p_mask[rows]
    return _prefix_cache(model, p_ids, p_mask, rows, logits_to_keep=1), p_mask[rows]


def _prefix_cache(model, ids: Tensor, mask: Tensor, rows: Tensor, **kwargs):
    """The key/value cache of prefixes ``ids`` [R, W] (on the model's device), reordered to
    the rows (``rows`` [n]: each row's prefix)."""
    out = model(
        input_ids=ids,
        attention_mask=mask.long(),
        position_ids=positions(mask),
        use_cache=True,
        **kwargs,
    )
    out.past_key_values.reorder_cache(rows)
    return out.past_key_values


def _continue_cache(
    model, cache, seen: Tensor, seg_ids: Tensor, seg_mask: Tensor, hidden=None, **kwargs
):
    """Run the rows' segments on a prefix cache reordered to the rows (``seen`` [n, W]: cached
    keys each row reads); positions count visible tokens; ``hidden`` [n, S] are keys to none."""
    device = seen.device
    seg_mask = seg_mask.to(device)
    full = torch.cat([seen, seg_mask], dim=1)
    pos = positions(full)[:, seen.shape[1] :]
    mask = full.long()
    if hidden is not None:
        mask = hidden_mask(model, seg_mask.bool(), hidden.to(device), seen.bool())
    return model(
        input_ids=seg_ids.to(device),
        attention_mask=mask,
        position_ids=pos,
        past_key_values=cache,
        use_cache=True,
        **kwargs,
    )
