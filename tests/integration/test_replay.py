"""Self-replay: contexts differ only in Z_k, batching does not change q, old parameters."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch

from mrtpo.core.batch import ScoredBatch, rewards_tensor
from mrtpo.core.chat import chat_ids
from mrtpo.core.credit import js_distance
from mrtpo.core.forward import response_logits, response_logprobs
from mrtpo.core.replay import ALL, Replayer, mass_share
from mrtpo.rollout.base import SamplingConfig
from mrtpo.rollout.build import build_rollout
from mrtpo.rollout.hf import HFEngine
from mrtpo.tasks.base import Example, Score, Task
from mrtpo.tasks.synthetic.task import SyntheticTask

BLOCKS = {
    "format": "Answer inside <answer> tags.",
    "error": "When this query was executed on this database, SQLite raised: no such table.",
    "reference": "The reference query for this question is: SELECT 1.",
}


class BlockTask(Task):
    """Three rewards, each with a block; rewards depend on response length (they vary)."""

    name = "blocks"
    reward_names = ("format", "error", "reference")

    def __init__(self, blocks=None):
        self.blocks = blocks or BLOCKS

    def examples(self, split):
        return [
            Example(id=f"{split}{i}", messages=[{"role": "user", "content": f"Q{i}: say hi"}])
            for i in range(4)
        ]

    def score(self, example, response):
        n = len(response)
        rewards = {"format": float(n % 2), "error": float(n % 3 == 0), "reference": float(n > 10)}
        return Score(rewards=rewards, blocks=dict(self.blocks))


def _scored(task, tiny, n=3, seed=0, max_new_tokens=12) -> ScoredBatch:
    model, tok = tiny
    engine = HFEngine()
    eos = [tok.eos_token_id]
    engine.bind(model, tok, eos)
    roll = build_rollout(
        engine,
        tok,
        task.examples("train")[:2],
        n,
        SamplingConfig(max_new_tokens=max_new_tokens),
        seed,
        eos,
    )
    scores = task.score_many(roll.examples, roll.texts)
    return ScoredBatch(
        rollout=roll,
        scores=scores,
        reward_names=task.reward_names,
        rewards=rewards_tensor(scores, task.reward_names),
    )


def test_contexts_differ_exactly_by_the_left_out_block(tiny):
    _, tok = tiny
    task = BlockTask()
    ex = task.examples("train")[0]
    ctx = task.contexts(ex, task.score(ex, "whatever"))
    full = tok.decode(chat_ids(tok, ctx.all))
    assert ctx.all[-1]["content"].endswith("\n\n".join(BLOCKS.values()))
    for k, block in BLOCKS.items():
        without = tok.decode(chat_ids(tok, ctx.without[k]))
        # removing the block (and its blank-line separator) from P_all gives P_\k exactly
        assert full.replace("\n\n" + block, "", 1) == without
        assert block not in without
        for other, text in BLOCKS.items():
            if other != k:
                assert text in without
    assert tok.decode(chat_ids(tok, ctx.none)) == tok.decode(chat_ids(tok, ex.messages))


def _naive_q(model, tok, prompt_msgs, other_msgs, response_ids):
    """One unpadded forward per context, the slow obvious way."""

    def logp(msgs):
        ids = torch.tensor([chat_ids(tok, msgs) + response_ids])
        with torch.no_grad():
            out = model(input_ids=ids).logits[0].float()
        p = len(ids[0]) - len(response_ids)
        return torch.log_softmax(out[p - 1 : p - 1 + len(response_ids)], -1)

    return js_distance(logp(prompt_msgs), logp(other_msgs))


@pytest.mark.parametrize("budget", [64, 100_000])
def test_batched_replay_matches_unbatched_forwards(tiny, budget):
    model, tok = tiny
    model.eval()
    task = BlockTask()
    scored = _scored(task, tiny)
    pairs = torch.ones(scored.rewards.shape, dtype=torch.bool)
    res = Replayer(tok, token_budget=budget, jsd_chunk=3).run(
        model, task, scored, pairs, "per_reward"
    )
    roll = scored.rollout
    assert res.replayed.all()
    assert res.forwards == roll.n * 4  # P_all once per response + 3 leave-one-out contexts
    for j in range(roll.n):
        t = int(roll.response_mask[j].sum())
        ctx = task.contexts(roll.examples[j], scored.scores[j])
        for k, name in enumerate(task.reward_names):
            ref = _naive_q(
                model, tok, ctx.all, ctx.without[name], roll.response_ids[j, :t].tolist()
            )
            torch.testing.assert_close(res.q[j, k, :t], ref, atol=2e-5, rtol=1e-4)
        assert (res.q[j, :, t:] == 0).all()


def test_identical_contexts_give_zero_relevance(tiny):
    model, tok = tiny
    task = BlockTask({"format": "", "error": "", "reference": ""})
    scored = _scored(task, tiny)
    # empty blocks are no information: replay has nothing to compare
    pairs = torch.ones(scored.rewards.shape, dtype=torch.bool)
    res = Replayer(tok).run(model, task, scored, pairs, "per_reward")
    assert not res.replayed.any() and (res.q == 0).all()

    # the same block text in both contexts: replay runs, and q is 0 everywhere
    class Same(BlockTask):
        def contexts(self, example, score):
            ctx = super().contexts(example, score)
            ctx.without = {k: ctx.all for k in ctx.without}
            return ctx

    same = Same()
    scored = _scored(same, tiny)
    res = Replayer(tok).run(model, same, scored, pairs, "per_reward")
    assert res.replayed.all()
    assert float(res.q.abs().max()) < 1e-3  # float32 noise of two identical forwards


def test_different_blocks_give_bounded_nonzero_relevance(tiny):
    model, tok = tiny
    task = BlockTask()
    scored = _scored(task, tiny)
    pairs = torch.ones(scored.rewards.shape, dtype=torch.bool)
    res = Replayer(tok).run(model, task, scored, pairs, "per_reward")
    valid = res.q[scored.rollout.response_mask[:, None, :].expand_as(res.q)]
    assert (valid >= 0).all() and (valid <= 1).all()
    assert float(valid.max()) > 1e-3
    shares = mass_share(res.q, scored.rollout.response_mask, res.replayed, 0.8)
    assert all(0 < s <= 1 for s in shares)


def test_joint_replays_all_versus_none(tiny):
    model, tok = tiny
    task = BlockTask()
    scored = _scored(task, tiny)
    pairs = torch.ones((scored.rollout.n, 1), dtype=torch.bool)
    res = Replayer(tok).run(model, task, scored, pairs, "joint")
    assert res.q.shape[1] == 1 and res.replayed.all()
    assert res.forwards == 2 * scored.rollout.n


def test_replay_inside_a_step_uses_the_sampling_parameters(train_cfg):
    from mrtpo.lightning.pipeline import build

    class Snapshot(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, idx):
            self.before = copy.deepcopy(module.policy)

    cfg = train_cfg(
        "method=mrtpo",
        "method.beta_warmup_steps=0",  # step 0 replays
        "trainer.max_steps=1",
        "optim.lr=0.05",
        "rl.group_size=4",
        "rollout.sampling.max_new_tokens=12",
    )
    trainer, module, dm = build(cfg)
    snap = Snapshot()
    trainer.callbacks.append(snap)
    trainer.fit(module, datamodule=dm)
    scored = module.last
    assert scored.replayed.any(), "no pair replayed: the test would prove nothing"
    pairs = scored.replayed
    again = module.replayer.run(snap.before, module.task, scored, pairs, "per_reward")
    torch.testing.assert_close(again.q, scored.q, atol=1e-6, rtol=0)
    # the update changed the parameters, and replay with them would give other numbers
    after = module.replayer.run(module.policy, module.task, scored, pairs, "per_reward")
    assert not torch.allclose(after.q, scored.q, atol=1e-6)


def test_forward_alignment_with_mixed_padding(tiny):
    """Left-padded contexts + right-padded responses score like unpadded sequences."""
    model, tok = tiny
    model.eval()
    a = chat_ids(tok, [{"role": "user", "content": "a much longer prompt here"}])
    b = chat_ids(tok, [{"role": "user", "content": "hi"}])
    ra, rb = [5, 6, 7, 8], [9, 10]
    from mrtpo.core.forward import pad_left, pad_right

    p_ids, p_mask = pad_left([a, b], tok.pad_token_id)
    r_ids, r_mask = pad_right([ra, rb], tok.pad_token_id)
    with torch.no_grad():
        got = response_logits(model, p_ids, p_mask, r_ids, r_mask).float()
        for i, (p, r) in enumerate([(a, ra), (b, rb)]):
            ref = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) - 1 + len(r)]
            torch.testing.assert_close(got[i, : len(r)], ref.float(), atol=2e-5, rtol=1e-4)
    assert ALL == "__all__"


def test_shared_prefix_replay_matches_the_plain_path(tiny):
    model, tok = tiny
    model.eval()
    for task in (BlockTask(), SyntheticTask(num_constraints=4)):
        scored = _scored(task, tiny)
        pairs = torch.ones(scored.rewards.shape, dtype=torch.bool)
        shared = Replayer(tok, token_budget=64, jsd_chunk=5, shared_prompt="always")
        res = shared.run(model, task, scored, pairs, "per_reward")
        plain = Replayer(tok, token_budget=64, jsd_chunk=5, shared_prompt="off").run(
            model, task, scored, pairs, "per_reward"
        )
        assert res.stats["shared_prefix_batches"] > 0 and not plain.stats["shared_prefix_batches"]
        assert torch.equal(res.replayed, plain.replayed)
        torch.testing.assert_close(res.q, plain.q, atol=2e-5, rtol=1e-4)


def test_replay_logp_is_the_old_policy_logp_when_p_all_is_p0(tiny):
    model, tok = tiny
    model.eval()
    task = SyntheticTask(num_constraints=3)
    scored = _scored(task, tiny)
    roll = scored.rollout
    pairs = torch.zeros(scored.rewards.shape, dtype=torch.bool)
    pairs[::2, 0] = True  # every other response replayed
    res = Replayer(tok).run(model, task, scored, pairs, "per_reward")
    assert torch.equal(res.logp_rows, pairs.any(-1))
    with torch.no_grad():
        ref = response_logprobs(
            model, roll.prompt_ids, roll.prompt_mask, roll.response_ids, roll.response_mask
        )
    rows = res.logp_rows
    torch.testing.assert_close(res.logp[rows], ref[rows], atol=1e-5, rtol=1e-5)
    # verifier blocks appended to the prompt: P_all is not P0, nothing to reuse
    blocks = BlockTask()
    scored = _scored(blocks, tiny)
    res = Replayer(tok).run(
        model, blocks, scored, torch.ones(scored.rewards.shape, dtype=torch.bool), "per_reward"
    )
    assert not res.logp_rows.any()


def _sharpened(model):
    """The tiny model with its norms scaled x6: confident predictions, where 16-bit rounding
    shows in the log-probs (the random tiny model is too flat for it to)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.mul_(6.0)
    return model.eval()


#: bf16's unit roundoff: 8 significant bits, a rounding moves x by at most 2^-8 |x|
BF16_U = 2.0**-8


@pytest.mark.recorded
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["plain", "common", "branch"])
def test_fused_old_logprobs_match_the_plain_pass(tiny, dtype, layout):
    """pi_old taken from replay's P_all rows equals the plain pass: to 1e-5 in fp32. The
    shared-prefix layouts split the attention sums, which moves bf16 log-probs by ~1e-2, so in
    bf16 their rows are not reused but scored plainly.

    bf16 promises no bits beyond its rounding, and how a kernel rounds varies (AMX, AVX-512,
    AVX2 differ by 0.015 nats here), so in bf16 pi_old is held to the fp32 log-probs of the
    same weights within what bf16 rounding allows, on any kernel: a log-prob z_i - lse(z)
    moves by at most 2 max|dz|, and the logits z carry their own rounding and that of the
    hidden state before them, a few of 2^-8 max|z| each; 4 such roundings give
    8 * 2^-8 * max|z| per token (about 0.1 nats here; seen: 2.4 * 2^-8 * max|z|). A row
    taken from the wrong tokens is off by nats."""
    from mrtpo.core.credit.methods import MRTPO
    from mrtpo.lightning.module import PolicyModule

    tok = tiny[1]
    task = SyntheticTask(num_constraints=4)
    scored = _scored(task, tiny, n=4, max_new_tokens=24)
    roll = scored.rollout
    model = _sharpened(tiny[0]).to(dtype)
    # "always": share whenever a layout shares
    mode = "off" if layout == "plain" else "always"
    replayer = Replayer(tok, token_budget=4096, jsd_chunk=5, shared_prompt=mode)
    replayer.layouts = (layout,)
    pairs = torch.ones(scored.rewards.shape, dtype=torch.bool)
    res = replayer.run(model, task, scored, pairs, "per_reward")
    assert bool(res.stats["shared_prefix_batches"]) == (layout != "plain")
    fused = dtype == torch.float32 or layout == "plain"
    assert bool(res.logp_rows.all()) == fused and bool(res.logp_rows.any()) == fused
    module = PolicyModule(model, tok, task, MRTPO(), rl={"micro_batch_size": 8})
    old = module.step.passes.old(roll, res, 8)
    exact = copy.deepcopy(model).float()  # the same (rounded) weights, computed in fp32
    args = (roll.prompt_ids, roll.prompt_mask, roll.response_ids, roll.response_mask)
    with torch.no_grad():
        plain = response_logprobs(model if dtype == torch.float32 else exact, *args)
        bound = torch.full_like(plain, 1e-5)
        if dtype == torch.bfloat16:
            bound = 8 * BF16_U * response_logits(exact, *args).abs().amax(-1)
    mask = roll.response_mask
    gap = (old.float() - plain).abs()
    worst = float((gap / bound)[mask].max())
    assert worst <= 1, f"pi_old differs by {worst:.3g} x its bound ({dtype}, {layout})"
