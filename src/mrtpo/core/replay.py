"""Self-replay: score each sampled token by how much a verifier's information moves it.

Each requested response–reward pair is fed after ``P_all`` and ``P_\\k`` (contexts that differ
only in that reward's information, built by the task) and the next-token distributions are
compared by Jensen–Shannon distance (method.md §§1–3); ``P_all`` runs once per response.

Cost and memory (docs/benchmarks.md, "Already in replay.py"): forwards packed by a token
budget, a response's contexts sharing a cached prefix where that pays, hidden states whose
head, log-softmax and JSD run in float32 on chunks of ``jsd_chunk`` (row, position) pairs.
Distributions are tempered as sampled (``RolloutBatch.temperature``).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mrtpo.core.batch import RolloutBatch, ScoredBatch
from mrtpo.core.chat import chat_ids
from mrtpo.core.credit import js_distance, js_distance_chunked
from mrtpo.core.credit.methods import RelevanceRequest
from mrtpo.core.forward import (
    packed_prompt_blocker,
    pad_left,
    prefix_layout,
    response_hidden,
    response_hidden_shared_prefix,
    response_logits,
    shared_prompt_mode,
    split_head,
    windowed,
    worth_sharing,
)
from mrtpo.distributed import Ranks, dummy_batch, is_sharded
from mrtpo.tasks.base import Contexts, Task

log = logging.getLogger(__name__)

ALL = "__all__"
NONE = "__none__"


@dataclass
class _Job:
    response: int  # row in the batch
    key: str  # ALL, NONE or a reward name
    ids: list[int]  # context token ids
    hidden: tuple[int, ...] = ()  # context tokens hidden from attention (method.context=mask)


#: Stands in for a message's content to find where the chat template writes it.
_PROBE = "\ue000mrtpo-content\ue001"


class _Masker:
    """``method.context=mask``: which of ``P_all``'s tokens hold a task's spans of text
    (``Contexts.spans``). The chat text is rendered once per distinct ``P_all``; a token is
    hidden when its characters overlap a span (one straddling a span's edge is hidden too)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[str, tuple[str, list[tuple[int, int]]]] = {}

    def _render(self, messages) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )

    def _offsets(self, key: str, messages, ids: list[int]):
        if key not in self.cache:
            text = self._render(messages)
            try:
                enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            except NotImplementedError:
                raise ValueError(
                    "method.context=mask needs a fast tokenizer (character offsets of tokens); "
                    "use method.context=delete"
                ) from None
            if list(enc["input_ids"]) != list(ids):
                raise ValueError(
                    "method.context=mask: the tokenizer splits the rendered chat text otherwise "
                    "than apply_chat_template does, so the information's tokens cannot be "
                    "found; use method.context=delete"
                )
            self.cache[key] = (text, [tuple(o) for o in enc["offset_mapping"]])
        return self.cache[key]

    def _start(self, messages, m: int, text: str) -> int:
        """Where message ``m``'s content starts in the rendered ``text``."""
        probe = [dict(x) for x in messages]
        probe[m]["content"] = _PROBE
        at = self._render(probe).find(_PROBE)
        content = messages[m]["content"]
        if at < 0 or text[at : at + len(content)] != content:
            raise ValueError(
                f"method.context=mask: the chat template does not write message {m}'s text as "
                "it is, so the information's tokens cannot be found; use method.context=delete"
            )
        return at

    def hidden(self, key: str, messages, ids: list[int], spans) -> tuple[int, ...]:
        text, offsets = self._offsets(key, messages, ids)
        starts = {m: self._start(messages, m, text) for m in {sp[0] for sp in spans}}
        cut = [(starts[m] + a, starts[m] + b) for m, a, b in spans if b > a]
        out = tuple(i for i, (a, b) in enumerate(offsets) if any(a < e and b > s for s, e in cut))
        if out and out[-1] == len(ids) - 1:
            raise ValueError(
                "method.context=mask: the information reaches the context's last token, which "
                "predicts the first response token; use method.context=delete"
            )
        return out


class NoiseFloor:
    """``replay.noise_floor`` (docs/method.md): the JSD between ``P_all`` as replay computes it and
    the same tokens through the update's forward, pure numerical noise. Up to ``rows`` responses
    a step, the first replayed (``reset`` at each step's start); off by default: a forward and
    ``[rows, T, V]`` logits per checked micro-batch."""

    def __init__(self, rows: int, pad_id: int, chunk: int = 256, shared_prompt: str = "off"):
        self.rows, self.pad_id, self.chunk, self.shared_prompt = rows, pad_id, chunk, shared_prompt
        self.reset()

    def reset(self) -> None:
        self.left, self.total, self.count, self.max = self.rows, 0.0, 0, 0.0

    def add(self, model, chunk, states, head, roll, all_key: str) -> int:
        """Score the micro-batch's ``P_all`` rows (``all_key`` jobs, ``states`` their replay
        states) the update's way, within the step's budget; returns the forwards run (0 or 1)."""
        picks = [i for i, job in enumerate(chunk) if job.key == all_key][: self.left]
        if not picks:
            return 0
        rows = torch.tensor([chunk[i].response for i in picks])
        mask = roll.response_mask[rows]
        t = max(1, int(mask.sum(-1).max()))
        ctx_ids, ctx_mask = pad_left([chunk[i].ids for i in picks], self.pad_id)
        plain = response_logits(
            model, ctx_ids, ctx_mask, roll.response_ids[rows, :t], mask[:, :t],
            shared_prompt=self.shared_prompt,
        )  # fmt: skip
        for n, i in enumerate(picks):
            x = states[i, :t]
            if head is not None:
                x = head(x)
            d = js_distance_chunked(x, plain[n].to(x.device), self.chunk, roll.temperature)
            d = d[mask[n, :t].to(d.device)]
            self.total += float(d.sum())
            self.count += int(d.numel())
            self.max = max(self.max, float(d.max())) if d.numel() else self.max
        self.left -= len(picks)
        return 1

    def metrics(self) -> dict[str, float]:
        if not self.count:
            return {}
        return {"noise_floor": self.total / self.count, "noise_floor/max": self.max}


@dataclass
class ReplayResult:
    q: Tensor  # [N, K, T] (per_reward) or [N, 1, T] (joint), 0 where not replayed
    replayed: Tensor  # [N, K] / [N, 1] bool
    forwards: int = 0  # context forwards run
    tokens: int = 0  # tokens through those forwards
    stats: dict[str, float] = field(default_factory=dict)
    # log pi(y_t | P_all, y_<t) [N, T], valid on ``logp_rows`` [N]: rows whose P_all is their
    # sampling prompt, so it can stand in for pi_old's forward (in 16-bit only rows without a
    # shared prefix: a cached prefix moves bf16 log-probs by ~1e-2 nats, fp32 by 1e-6)
    logp: Tensor | None = None
    logp_rows: Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # logged as train/replay/<key>


@dataclass
class _Sink:
    """Where ``Replayer._score`` writes ``roll``'s relevance ``q`` and P_all's log-probs."""

    roll: RolloutBatch
    names: tuple[str, ...]
    request: RelevanceRequest
    q: Tensor
    logp: Tensor

    def column(self, job: _Job) -> int:  # its reward's column of q (0 for joint)
        return 0 if self.request.joint else self.names.index(job.key)


class Replayer:
    """Runs the replays of one batch under pi_old, the trainer's weights at the step's start
    (under one_step_off/async older weights may have sampled it)."""

    def __init__(
        self,
        tokenizer,
        token_budget: int = 16384,
        jsd_chunk: int = 256,
        shared_prompt: str = "auto",
        noise_floor: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.token_budget = token_budget  # max (rows x padded length) per forward
        self.jsd_chunk = jsd_chunk  # (row, position) pairs per float32 head / log-softmax / JSD
        # rl.shared_prompt_forward: a response's common context prefix runs once (auto, always)
        self.shared_prompt = shared_prompt_mode(shared_prompt)
        if self.shared_prompt is None:
            raise ValueError(f"shared_prompt={shared_prompt!r}: use auto, off or always")
        #: the shared-prefix layouts ``_shared_layout`` may choose from (tests pin one)
        self.layouts: tuple[str, ...] = ("common", "branch")
        #: replay.noise_floor: P_all of this many responses a step scored again the update's
        #: way (``NoiseFloor``); None: off
        self.noise = None
        if noise_floor > 0:
            pad = tokenizer.pad_token_id
            self.noise = NoiseFloor(noise_floor, pad, jsd_chunk, self.shared_prompt)

    # -- planning -------------------------------------------------------------------------
    def plan(
        self, task: Task, batch: ScoredBatch, pairs: Tensor, mode: str, form: str = "delete"
    ) -> dict[int, list[_Job]]:
        """Context forwards per response: ``P_all`` first, then one per replayed reward
        (``form="mask"``: ``P_all``'s tokens again, the reward's information hidden)."""
        roll = batch.rollout
        names = batch.reward_names
        cache: dict[str, list[int]] = {}

        def ids(messages) -> list[int]:
            key = json.dumps(messages, sort_keys=True, ensure_ascii=False, default=str)
            if key not in cache:
                cache[key] = chat_ids(self.tokenizer, messages)
            return cache[key]

        jobs_by_resp: dict[int, list[_Job]] = {}
        masker = _Masker(self.tokenizer) if form == "mask" else None
        for j in pairs.any(-1).nonzero().flatten().tolist():
            ctx: Contexts = task.contexts(roll.examples[j], batch.scores[j])
            if mode == "joint":
                wanted = [(NONE, ctx.none)]
            else:
                wanted = [
                    (names[k], ctx.without[names[k]])
                    for k in pairs[j].nonzero().flatten().tolist()
                    if names[k] in ctx.without
                ]
            if not wanted:
                continue
            jobs = [_Job(j, ALL, ids(ctx.all))]
            if masker is None:
                jobs += [_Job(j, key, ids(m)) for key, m in wanted]
            else:
                key_all = json.dumps(ctx.all, sort_keys=True, ensure_ascii=False, default=str)
                for key, _ in wanted:
                    spans = _spans(task, ctx, key)
                    hid = masker.hidden(key_all, ctx.all, jobs[0].ids, spans)
                    jobs.append(_Job(j, key, jobs[0].ids, hid))
            jobs_by_resp[j] = jobs
        return jobs_by_resp

    @torch.no_grad()
    def run(self, model, task: Task, batch: ScoredBatch, pairs: Tensor, request) -> ReplayResult:
        """``pairs``: bool [N, K] (per_reward) or [N, 1] (joint), the pairs to replay; ``request``:
        the method's ``RelevanceRequest`` (plain ``"per_reward"``/``"joint"`` mean JSD)."""
        if not isinstance(request, RelevanceRequest):
            request = RelevanceRequest(contexts=str(request))
        roll = batch.rollout
        n, t = roll.response_ids.shape
        device = next(model.parameters()).device
        reason = packed_prompt_blocker(model) if request.form == "mask" else None
        if reason is not None:  # a 4D attention mask is not applied as given
            raise ValueError(
                f"method.context=mask cannot run with this model ({reason}); use method.context=delete"
            )
        jobs_by_resp = self.plan(task, batch, pairs, request.contexts, request.form)
        out = ReplayResult(
            q=torch.zeros((n, pairs.shape[1], t), dtype=torch.float32, device=device),
            replayed=torch.zeros_like(pairs, dtype=torch.bool),
            logp=torch.zeros((n, t), dtype=torch.float32, device=device),
            logp_rows=torch.zeros(n, dtype=torch.bool),
        )
        for j, jobs in jobs_by_resp.items():
            p0 = roll.prompt_ids[j][roll.prompt_mask[j]].tolist()
            out.logp_rows[j] = jobs[0].ids == p0
        was_training = model.training
        model.eval()
        try:
            self._run_chunks(model, batch, jobs_by_resp, request, out)
        finally:
            model.train(was_training)
        out.q, out.logp = out.q.cpu(), out.logp.cpu()
        out.metrics = self._metrics(batch, out, request)
        if self.noise is not None:
            out.metrics.update(self.noise.metrics())
        return out

    def _run_chunks(self, model, batch: ScoredBatch, jobs_by_resp, request, out: ReplayResult):
        """The forwards and scores of every micro-batch, into ``out``. Sharded: one root forward per
        micro-batch (logits, no prefix sharing; decoder and head cannot be called apart), padded to
        the busiest rank's count agreed first. DDP agrees the same count after (an out-of-memory
        retry stays local). A rank that replays nothing still runs them."""
        roll = batch.rollout
        sink = _Sink(roll, batch.reward_names, request, out.q, out.logp)
        device = next(model.parameters()).device
        ranks, sharded = Ranks(lambda: device), is_sharded(model)
        split = split_head(model)  # None when sharded: the root's forward gathers
        # forwards in a 16-bit float type (the weights' own, or autocast's)
        half = next(model.parameters()).dtype in (torch.bfloat16, torch.float16)
        low_precision = half or torch.is_autocast_enabled(device.type)
        chunks = self._pack(jobs_by_resp, roll.response_mask)
        idle = ranks.max(len(chunks)) - len(chunks) if sharded else 0
        calls = computed = shared = 0  # decoder calls: two for a micro-batch sharing its prefix
        if self.noise is not None:
            self.noise.reset()
        for chunk in chunks:
            states, head, cost, was_shared = self._forward(
                model, split, chunk, roll.response_ids, roll.response_mask
            )
            if (was_shared or any(job.hidden for job in chunk)) and low_precision:
                # the cached prefix (or a 4D mask) splits the attention sums differently from
                # the plain pass: in bf16 the log-probs move by up to ~1e-2 nats, too far to
                # stand in for pi_old, so these rows get their own plain forward
                out.logp_rows[[job.response for job in chunk]] = False
            shared, calls, computed = shared + was_shared, calls + 1 + was_shared, computed + cost
            out.forwards += len(chunk)
            out.tokens += sum(
                len(job.ids) + int(roll.response_mask[job.response].sum()) for job in chunk
            )
            self._score(chunk, states, head, sink)
            if self.noise is not None and not sharded:  # sharded: a forward is a collective
                calls += self.noise.add(model, chunk, states, head, roll, ALL)
            for job in chunk:
                if job.key != ALL:
                    out.replayed[job.response, sink.column(job)] = True
        if ranks.world_size > 1 and not sharded:
            idle = ranks.max(calls) - calls
        for _ in range(idle):  # discarded: only keeps this rank in step
            response_logits(model, *dummy_batch(self.tokenizer.pad_token_id))
        out.stats = {"tokens_computed": float(computed), "shared_prefix_batches": float(shared)}

    @staticmethod
    def _metrics(batch: ScoredBatch, out: ReplayResult, request) -> dict[str, float]:
        """train/replay/: share of candidate pairs replayed (responses for joint), the work
        done, and how concentrated each reward's relevance is."""
        per_reward = request.contexts == "per_reward"
        present = int((~batch.rewards.isnan()).sum()) if per_reward else out.q.shape[0]
        metrics = {
            "share": float(out.replayed.sum()) / max(present, 1),
            "forwards": float(out.forwards),
            "tokens": float(out.tokens),
        }
        if per_reward and request.score == "jsd":
            shares = mass_share(out.q, batch.rollout.response_mask, out.replayed, 0.8)
            for k, name in enumerate(batch.reward_names):
                if not math.isnan(shares[k]):
                    metrics[f"top80_token_share/{name}"] = shares[k]
        return metrics

    # -- packing ------------------------------------------------------------------------
    def _pack(self, jobs_by_resp: dict[int, list[_Job]], mask: Tensor) -> list[list[_Job]]:
        """Micro-batches of whole responses (P_all with its P_\\k) within the token budget (a
        target: a response over it gets a micro-batch of its own)."""
        chunks: list[list[_Job]] = [[]]
        width = 0  # the last chunk's padded length
        for j in sorted(jobs_by_resp, key=lambda j: max(len(x.ids) for x in jobs_by_resp[j])):
            jobs = jobs_by_resp[j]
            own = max(len(x.ids) for x in jobs) + int(mask[j].sum())
            if chunks[-1] and (len(chunks[-1]) + len(jobs)) * max(width, own) > self.token_budget:
                chunks.append([])
                width = 0
            chunks[-1].extend(jobs)
            width = max(width, own)
        return [c for c in chunks if c]

    def _forward(self, model, split, chunk: list[_Job], response_ids: Tensor, response_mask):
        """(states [rows, t, H or V], LM head or None, tokens computed, prefix shared?)."""
        rows = torch.tensor([job.response for job in chunk])
        resp_mask = response_mask[rows]
        t = max(1, int(resp_mask.sum(-1).max()))
        r_ids, r_mask = response_ids[rows, :t], resp_mask[:, :t]
        pad = self.tokenizer.pad_token_id
        masked = any(job.hidden for job in chunk)
        ctx_ids, ctx_mask = pad_left([job.ids for job in chunk], pad)
        hidden = _hidden_flags(chunk, [0] * len(chunk)) if masked else None
        if split is None:
            logits = response_logits(model, ctx_ids, ctx_mask, r_ids, r_mask, hidden=hidden)
            return logits, None, ctx_ids.numel() + r_ids.numel(), False
        decoder, head = split
        plain_cost = len(chunk) * (max(len(job.ids) for job in chunk) + t)
        if self.shared_prompt != "off" and not windowed(model):
            shared = self._shared_layout(chunk, t)
            # two decoder calls instead of one: worth_sharing decides unless "always"
            if shared is not None and (
                self.shared_prompt == "always" or worth_sharing(plain_cost - shared[-1], plain_cost)
            ):
                prefixes, row_prefix, keep, suffixes, cost = shared
                p_ids, p_mask = pad_left(prefixes, pad)
                suffixes = [job.ids[int(k) :] for job, k in zip(chunk, keep)]
                s_ids, s_mask = pad_left(suffixes, pad)
                s_hidden = _hidden_flags(chunk, keep.tolist()) if masked else None
                h = response_hidden_shared_prefix(
                    decoder, p_ids, p_mask, row_prefix, keep, s_ids, s_mask, r_ids, r_mask,
                    s_hidden,
                )  # fmt: skip
                return h, head, cost, True
        h = response_hidden(decoder, ctx_ids, ctx_mask, r_ids, r_mask, hidden)
        return h, head, plain_cost, False

    def _shared_layout(self, chunk: list[_Job], t: int):
        """The micro-batch's ``forward.prefix_layout`` (P_all the ``branch`` base). A hidden token
        (``method.context=mask``) reads as an id of its own row, so no row shares a prefix past it
        (later cached keys attended to it)."""
        ctxs = []
        for i, job in enumerate(chunk):
            hid = set(job.hidden)
            ctxs.append([-1 - i if c in hid else x for c, x in enumerate(job.ids)])
        base = {job.response: ctxs[i] for i, job in enumerate(chunk) if job.key == ALL}
        is_base = [job.key == ALL for job in chunk]
        return prefix_layout(ctxs, [job.response for job in chunk], t, self.layouts, base, is_base)

    # -- scoring ------------------------------------------------------------------------
    def _score(self, chunk, states, head, sink: _Sink) -> None:
        """JSD of every P_\\k row against its P_all row, in groups of at most ``jsd_chunk`` (row,
        position) pairs (float32 working set ``jsd_chunk x V``); P_all's sampled-token log-probs go
        to ``sink.logp`` on the way."""
        all_row = {job.response: i for i, job in enumerate(chunk) if job.key == ALL}
        # responses stay whole within a group where they fit: their P_all row is shared
        others = sorted(
            (i for i, job in enumerate(chunk) if job.key != ALL), key=lambda i: chunk[i].response
        )
        per = max(1, self.jsd_chunk // 2)
        for g in range(0, len(others), per):
            self._score_rows(chunk, others[g : g + per], all_row, states, head, sink)

    def _score_rows(self, chunk, others, all_row, states, head, sink: _Sink) -> None:
        roll, tau = sink.roll, sink.roll.temperature
        mask = roll.response_mask
        # P_\k rows first (a slice, no copy), then the P_all rows they are compared with
        alls = sorted({all_row[chunk[i].response] for i in others})
        order = others + alls
        pos_of = {r: p for p, r in enumerate(order)}
        dev = states.device
        sel = torch.tensor(order, device=dev)
        base = torch.tensor([pos_of[all_row[chunk[i].response]] for i in others], device=dev)
        o_resp = [chunk[i].response for i in others]
        jj = torch.tensor(o_resp, device=dev)
        kk = torch.tensor([sink.column(chunk[i]) for i in others], device=dev)
        lengths = mask[o_resp].sum(-1).to(dev)  # [n_other]
        n_other = len(others)
        o_ids = roll.response_ids[o_resp].to(dev)  # [n_other, T]
        a_resp = [chunk[r].response for r in alls]
        a_ids = roll.response_ids[a_resp].to(dev)  # [n_all, T]
        a_len = mask[a_resp].sum(-1).to(dev)
        a_j = torch.tensor(a_resp, device=dev)
        t = int(lengths.max())
        step = max(1, self.jsd_chunk // len(order))
        for s in range(0, t, step):
            e = min(t, s + step)
            x = states[sel, s:e]
            if head is not None:
                x = head(x)
            x = x.float()
            if tau != 1.0:  # the sampling distribution softmax(z / tau)
                x = x / tau
            lp = torch.log_softmax(x, dim=-1)  # [rows, c, V]
            if sink.request.score == "jsd":
                d = js_distance(lp[base], lp[:n_other])  # [n_other, c]
            else:  # logp_diff: the sampled token's log-likelihood, P_all minus the other context
                y = o_ids[:, s:e, None]
                d = (lp[base].gather(-1, y) - lp[:n_other].gather(-1, y)).squeeze(-1)
            cols = torch.arange(s, e, device=dev)[None, :]
            sink.q[jj, kk, s:e] = torch.where(cols < lengths[:, None], d, 0.0)
            lp_all = lp[n_other:].gather(-1, a_ids[:, s:e, None]).squeeze(-1)
            sink.logp[a_j, s:e] = torch.where(cols < a_len[:, None], lp_all, 0.0)


def _hidden_flags(chunk: list[_Job], start: list[int]) -> Tensor:
    """[rows, width] bool: each context's hidden tokens from ``start`` on, left-padded."""
    flags = []
    for job, s in zip(chunk, start):
        hid = set(job.hidden)
        flags.append([int(c in hid) for c in range(int(s), len(job.ids))])
    return pad_left(flags, 0)[0].bool()


def _spans(task: Task, ctx: Contexts, key: str):
    """The spans of ``P_all`` that ``key``'s context leaves out (every item's for NONE)."""
    spans = ctx.none_spans if key == NONE else ctx.spans.get(key)
    if spans is None or (key == NONE and not spans and ctx.without):
        what = "every item" if key == NONE else f"reward {key!r}"
        raise ValueError(
            f"method.context=mask: task {task.name!r} does not say where {what}'s information "
            "sits in the prompt (Contexts.spans); use method.context=delete"
        )
    return spans


def mass_share(q: Tensor, mask: Tensor, replayed: Tensor, frac: float = 0.8) -> list[float]:
    """Per reward: mean share of a response's tokens holding ``frac`` of its distance (q [N, K, T],
    mask [N, T], replayed [N, K] -> K floats, NaN where none replayed); small: concentrated."""
    out = []
    for r in range(q.shape[1]):
        vals = []
        for j in replayed[:, r].nonzero().flatten().tolist():
            qj = q[j, r][mask[j]]
            total = float(qj.sum())
            if qj.numel() == 0 or total <= 0:
                continue
            c = qj.sort(descending=True).values.cumsum(0)
            need = int((c < frac * total).sum()) + 1
            vals.append(need / qj.numel())
        out.append(sum(vals) / len(vals) if vals else float("nan"))
    return out
