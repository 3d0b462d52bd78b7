"""Where each reward's relevance lands: how much of a reward's Jensen–Shannon relevance falls
on the tokens its checker reads (the synthetic task's ``decisive_words``)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

from mrtpo.run.config import compose


def token_word_index(tokenizer, token_ids: Sequence[int]) -> tuple[list[int | None], int]:
    """For each response token: the index of the word it belongs to, ``n_words`` for an
    end-of-sequence/special token (it decides where the response ends), None for spaces."""
    special = set(tokenizer.all_special_ids)
    pieces, spans, text = [], [], ""
    for i in token_ids:
        piece = "" if i in special else tokenizer.decode([i])
        spans.append((len(text), len(text) + len(piece)))
        pieces.append(piece)
        text += piece
    words = [(m.start(), m.end()) for m in re.finditer(r"[a-z]+", text.lower())]
    out: list[int | None] = []
    for tid, (a, b) in zip(token_ids, spans, strict=True):
        if tid in special:
            out.append(len(words))
            continue
        idx = next((w for w, (s, e) in enumerate(words) if s < b and a < e), None)
        out.append(idx)
    return out, len(words)


def checker_tokens(rec: dict, example, task, tokenizer) -> dict[str, list[int]]:
    """For each reward of a ``relevance.jsonl`` record: the positions of the response tokens
    its checker reads (``task.decisive_words``; for ``mark`` also the last visible token)."""
    special = set(tokenizer.all_special_ids)
    ids = rec["token_ids"]
    text = tokenizer.decode([i for i in ids if i not in special])
    decisive = task.decisive_words(example, text)
    word_of, _ = token_word_index(tokenizer, ids)
    out: dict[str, list[int]] = {}
    for name in rec["q"]:
        if not decisive.get(name):
            continue
        wanted = set(decisive[name])
        toks = [t for t, w in enumerate(word_of) if w is not None and w in wanted]
        if name == "mark":  # the checker reads the last visible token, then the end
            last = [t for t, i in enumerate(ids)
                    if i not in special and tokenizer.decode([i]).strip()]  # fmt: skip
            toks = sorted(set(toks) | set(last[-1:]))
        out[name] = toks
    return out


def relevance_stats(records: list[dict], task, tokenizer) -> dict[str, dict[str, float]]:
    """Per constraint type: the share of its relevance on the tokens its checker reads, and
    those tokens' share of the response (means over response–reward pairs); ``enrichment`` is
    their ratio and ``argmax_hit`` how often the most relevant token is one of them."""
    by_id = {}
    for split in ("train", "val"):
        by_id.update({e.id: e for e in task.examples(split)})
    acc: dict[str, dict[str, list[float]]] = {}
    for rec in records:
        ex = by_id.get(rec["id"])
        if ex is None:
            continue
        checked = checker_tokens(rec, ex, task, tokenizer)
        for name, q in rec["q"].items():
            toks = checked.get(name, [])
            total = sum(q)
            if not toks or total <= 0:
                continue
            kind = re.sub(r"_\d+$", "", name)
            a = acc.setdefault(kind, {"q_share": [], "tok_share": [], "argmax": []})
            a["q_share"].append(sum(q[t] for t in toks) / total)
            a["tok_share"].append(len(toks) / len(q))
            a["argmax"].append(float(max(range(len(q)), key=q.__getitem__) in toks))
    out = {}
    for kind, a in acc.items():
        n = len(a["q_share"])
        qs, ts = sum(a["q_share"]) / n, sum(a["tok_share"]) / n
        out[kind] = {
            "pairs": n,
            "q_share": qs,
            "tok_share": ts,
            "enrichment": qs / ts if ts > 0 else math.nan,
            "argmax_hit": sum(a["argmax"]) / n,
        }
    return out


def replay_records(
    policy_dir: Path, k: int, prompts: int, group: int, seed: int, beta: float
) -> list[dict]:
    """Sample ``group`` responses to each of ``prompts`` held-out prompts from a policy, replay
    every (response, reward) pair, and return them as ``relevance.jsonl`` records (step 0)."""
    from hydra.utils import instantiate

    from mrtpo.core.batch import ScoredBatch, rewards_tensor
    from mrtpo.core.credit import relevance_weights
    from mrtpo.core.models import eos_token_ids, load_policy
    from mrtpo.core.replay import Replayer
    from mrtpo.lightning.callbacks.samples import relevance_record
    from mrtpo.rollout.base import SamplingConfig
    from mrtpo.rollout.build import build_rollout
    from mrtpo.rollout.hf import HFEngine

    cfg = compose("train.yaml", ["experiment=toy_replication", f"task.num_constraints={k}"])
    task = instantiate(cfg.task)
    model, tok = load_policy(str(policy_dir))
    model.eval()
    engine = HFEngine()
    eos = eos_token_ids(tok, model)
    engine.bind(model, tok, eos)
    examples = list(task.examples("val"))[:prompts]
    sampling = SamplingConfig(
        temperature=float(cfg.rollout.sampling.temperature),
        max_new_tokens=int(cfg.rollout.sampling.max_new_tokens),
    )
    roll = build_rollout(engine, tok, examples, group, sampling, seed, eos)
    scores = task.score_many(roll.examples, roll.texts)
    names = tuple(task.reward_names)
    scored = ScoredBatch(
        rollout=roll, scores=scores, reward_names=names, rewards=rewards_tensor(scores, names)
    )
    pairs = ~scored.rewards.isnan()
    res = Replayer(tok).run(model, task, scored, pairs, "per_reward")
    w = relevance_weights(res.q, roll.response_mask, res.replayed, beta)
    return [
        relevance_record(scored, j, res.q, w, res.replayed, names, tok, step=0, beta=beta)
        for j in range(roll.n)
    ]


def pick_record(records: list[dict]) -> dict | None:
    """The most telling response to draw: most rewards replayed, with met and unmet ones."""

    def score(r):
        vals = [v for v in r["rewards"].values() if v is not None]
        mixed = 0 < sum(vals) < len(vals)
        return (len(r["q"]), mixed, len(r["tokens"]) >= 5, -r.get("step", 0))

    good = [r for r in records if r["q"]]
    return max(good, key=score) if good else None
