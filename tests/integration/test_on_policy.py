"""On-policy by construction (issue 17), on the tiny model.

Every log-prob of a sampled token is taken under the distribution that sampled it
(softmax(z / temperature)); nothing of a checkpoint's generation_config shapes sampling; the
trainer measures its gap to the engine and, with rl.tis_cap, corrects for it.
"""

from __future__ import annotations

import copy
import csv
import json
import logging
import math
import shutil

import numpy as np
import pytest
import torch
from scipy.spatial.distance import jensenshannon
from tests.integration.test_replay import BlockTask

import mrtpo.core.models as models_mod
import mrtpo.step.update as update_mod
from mrtpo.core.batch import ScoredBatch, rewards_tensor
from mrtpo.core.chat import chat_ids
from mrtpo.core.forward import response_logits, response_logprobs
from mrtpo.core.models import load_policy
from mrtpo.core.replay import Replayer
from mrtpo.lightning.pipeline import build, metrics_csv, prepare
from mrtpo.rollout.base import SamplingConfig
from mrtpo.rollout.build import build_rollout
from mrtpo.rollout.hf import HFEngine
from mrtpo.run.settings import ConfigError
from mrtpo.step import Relevance
from mrtpo.tasks.synthetic.task import SyntheticTask

TAU = 0.7


def _tempered_logp(model, roll, tau=TAU) -> torch.Tensor:
    """log softmax(z / tau) of the sampled tokens from one plain forward, the obvious way."""
    model.eval()
    with torch.no_grad():
        z = response_logits(
            model, roll.prompt_ids, roll.prompt_mask, roll.response_ids, roll.response_mask
        ).double()
    lp = torch.log_softmax(z / tau, -1).gather(-1, roll.response_ids[..., None])[..., 0]
    return (lp * roll.response_mask).float()


def _fit(cfg):
    trainer, module, dm = build(cfg)
    trainer.fit(module, datamodule=dm)
    with open(metrics_csv(trainer)) as f:
        return module, list(csv.DictReader(f))


# ---- the HF engine and the trainer at temperature 0.7 ---------------------------------------


def test_engine_and_old_logprobs_are_the_tempered_distributions(tiny):
    model, tok = tiny
    task = SyntheticTask()
    eos = [tok.eos_token_id]
    engine = HFEngine(batch_size=5)  # several generate calls
    engine.bind(model, tok, eos)
    sampling = SamplingConfig(temperature=TAU, max_new_tokens=16)
    roll = build_rollout(engine, tok, list(task.examples("train"))[:3], 4, sampling, 0, eos)
    assert roll.sampling == sampling and roll.temperature == TAU
    want = _tempered_logp(model, roll)
    torch.testing.assert_close(roll.engine_logp, want, atol=1e-5, rtol=0)

    from mrtpo.core.credit.methods import GDPO
    from mrtpo.lightning.module import PolicyModule

    module = PolicyModule(model, tok, task, GDPO(), rl={"micro_batch_size": 5})
    old = module.step.passes.old(roll, Relevance(), 5)
    torch.testing.assert_close(old, want, atol=1e-5, rtol=0)
    # the untempered log-probs are far from these: the test tells the two apart
    raw = _tempered_logp(model, roll, tau=1.0)
    mask = roll.response_mask
    assert float((raw - want).abs()[mask].mean()) > 0.01


def test_first_update_ratio_is_exactly_one(train_cfg, monkeypatch):
    seen = []

    def spy(**kwargs):  # the module passes every argument by keyword
        seen.append((kwargs["logp"].detach().clone(), kwargs["old_logp"].clone(), kwargs["mask"]))
        return policy_loss(**kwargs)

    policy_loss = update_mod.policy_loss
    monkeypatch.setattr(update_mod, "policy_loss", spy)
    cfg = train_cfg(
        "method=gdpo",
        f"rollout.sampling.temperature={TAU}",
        "rl.ppo_epochs=2",
        "rl.mini_batch_size=2",
        "rl.micro_batch_size=1",
        "trainer.max_steps=1",
        "optim.lr=1e-2",
    )
    _fit(cfg)
    assert len(seen) == 8  # 2 epochs x 2 mini-batches x 2 micro-batches
    for logp, old, mask in seen[:2]:  # the first update: parameters not yet changed
        ratio = torch.exp(logp - old)[mask]
        assert torch.equal(ratio, torch.ones_like(ratio))
    # later updates see moved parameters
    assert any(not torch.equal(lp[m], old[m]) for lp, old, m in seen[2:])


def test_replay_jsd_is_between_tempered_distributions(tiny):
    model, tok = tiny
    task = BlockTask()
    eos = [tok.eos_token_id]
    engine = HFEngine()
    engine.bind(model, tok, eos)
    sampling = SamplingConfig(temperature=TAU, max_new_tokens=10)
    roll = build_rollout(engine, tok, task.examples("train")[:2], 2, sampling, 1, eos)
    scores = task.score_many(roll.examples, roll.texts)
    scored = ScoredBatch(roll, scores, task.reward_names, rewards_tensor(scores, task.reward_names))
    pairs = torch.ones(scored.rewards.shape, dtype=torch.bool)
    res = Replayer(tok, jsd_chunk=4).run(model, task, scored, pairs, "per_reward")
    assert res.replayed.all()

    def dists(messages, response, tau):
        ids = torch.tensor([chat_ids(tok, messages) + response])
        with torch.no_grad():
            z = model(input_ids=ids).logits[0].double()
        p = ids.shape[1] - len(response)
        return torch.softmax(z[p - 1 : p - 1 + len(response)] / tau, -1).numpy()

    max_raw_diff = 0.0
    for j in range(roll.n):
        t = int(roll.response_mask[j].sum())
        response = roll.response_ids[j, :t].tolist()
        ctx = task.contexts(roll.examples[j], scores[j])
        p_all = dists(ctx.all, response, TAU)
        raw_all = dists(ctx.all, response, 1.0)
        for k, name in enumerate(task.reward_names):
            p_k = dists(ctx.without[name], response, TAU)
            want = np.array([jensenshannon(p_all[i], p_k[i], base=2) for i in range(t)])
            np.testing.assert_allclose(res.q[j, k, :t].numpy(), want, atol=1e-5, rtol=0)
            raw = dists(ctx.without[name], response, 1.0)
            untempered = [jensenshannon(raw_all[i], raw[i], base=2) for i in range(t)]
            max_raw_diff = max(max_raw_diff, float(np.abs(np.array(untempered) - want).max()))
    assert max_raw_diff > 1e-3  # tempering changes q: the oracle would catch its absence


def test_replay_logp_diff_compares_tempered_logprobs(tiny):
    from mrtpo.core.credit.methods import RelevanceRequest

    model, tok = tiny
    task = BlockTask()
    eos = [tok.eos_token_id]
    engine = HFEngine()
    engine.bind(model, tok, eos)
    sampling = SamplingConfig(temperature=TAU, max_new_tokens=10)
    roll = build_rollout(engine, tok, task.examples("train")[:1], 2, sampling, 2, eos)
    scores = task.score_many(roll.examples, roll.texts)
    scored = ScoredBatch(roll, scores, task.reward_names, rewards_tensor(scores, task.reward_names))
    pairs = torch.ones(scored.rewards.shape, dtype=torch.bool)
    request = RelevanceRequest(contexts="per_reward", score="logp_diff")
    res = Replayer(tok).run(model, task, scored, pairs, request)

    def logp(messages, response):
        ids = torch.tensor([chat_ids(tok, messages) + response])
        with torch.no_grad():
            z = model(input_ids=ids).logits[0].double()
        p = ids.shape[1] - len(response)
        lp = torch.log_softmax(z[p - 1 : p - 1 + len(response)] / TAU, -1)
        return lp.gather(-1, torch.tensor(response)[:, None])[:, 0]

    for j in range(roll.n):
        t = int(roll.response_mask[j].sum())
        response = roll.response_ids[j, :t].tolist()
        ctx = task.contexts(roll.examples[j], scores[j])
        for k, name in enumerate(task.reward_names):
            want = (logp(ctx.all, response) - logp(ctx.without[name], response)).float()
            torch.testing.assert_close(res.q[j, k, :t], want, atol=1e-5, rtol=0)


# ---- the checkpoint's generation_config does not apply ---------------------------------------


def _with_generation_defaults(tmp_path, tiny_dir, **settings):
    out = tmp_path / "tiny-with-gen-defaults"
    shutil.copytree(tiny_dir, out)
    path = out / "generation_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(settings)
    path.write_text(json.dumps(cfg))
    return out


LEAKY = {"repetition_penalty": 1.3, "top_k": 5, "no_repeat_ngram_size": 2}
# as Qwen2.5 Instruct ships them (transformers refuses to save top_k without do_sample)
SHIPPED = {**LEAKY, "do_sample": True}


def test_checkpoint_generation_defaults_do_not_change_samples(tiny, cache_dir, tmp_path, caplog):
    model, tok = tiny
    copy_dir = _with_generation_defaults(tmp_path, cache_dir / "models" / "tiny-qwen2", **LEAKY)
    leaky, _ = load_policy(str(copy_dir))
    assert leaky.generation_config.repetition_penalty == 1.3  # the defaults are there
    task = SyntheticTask()
    examples = list(task.examples("train"))[:8]
    eos = [tok.eos_token_id]
    sampling = SamplingConfig(temperature=TAU, max_new_tokens=16)

    def sample(m):
        engine = HFEngine()
        engine.bind(m, tok, eos)
        return engine, build_rollout(engine, tok, examples, 4, sampling, 7, eos)

    _, plain = sample(model)
    with caplog.at_level(logging.WARNING, logger="mrtpo.rollout.hf"):
        engine, got = sample(leaky)
        build_rollout(engine, tok, examples[:1], 2, sampling, 8, eos)  # warned once only
    assert torch.equal(got.response_ids, plain.response_ids)
    torch.testing.assert_close(got.engine_logp, plain.engine_logp, atol=0, rtol=0)
    warnings = [r.getMessage() for r in caplog.records if "generation_config" in r.getMessage()]
    assert len(warnings) == 1
    for key, value in LEAKY.items():
        assert f"{key}={value!r}" in warnings[0]
    assert leaky.generation_config.top_k == 5  # the model's own config is left as it was

    # control: generate() left to the checkpoint's defaults draws other tokens
    ids = torch.tensor([plain.prompt_ids[0].tolist()] * 32)
    attn = torch.tensor([plain.prompt_mask[0].tolist()] * 32).long()
    outs = []
    for m in (model, leaky):
        torch.manual_seed(0)
        with torch.no_grad():
            outs.append(
                m.generate(
                    input_ids=ids,
                    attention_mask=attn,
                    do_sample=True,
                    temperature=TAU,
                    max_new_tokens=16,
                    pad_token_id=tok.pad_token_id,
                )
            )
    assert not torch.equal(outs[0], outs[1])


# ---- the acceptance runs: the gap every step ------------------------------------------------

ACCEPTANCE = ("method=gdpo", "rl.ppo_epochs=2", f"rollout.sampling.temperature={TAU}")


def _gaps(rows):
    return [float(r["train/rollout/logp_gap/mean"]) for r in rows]


def test_acceptance_run_logs_a_small_gap_every_step(train_cfg, cache_dir, tmp_path):
    module, rows = _fit(train_cfg(*ACCEPTANCE, "trainer.max_steps=3"))
    assert len(rows) == 3
    assert all(0 <= g < 1e-3 for g in _gaps(rows)), _gaps(rows)
    for r in rows:
        assert float(r["train/rollout/logp_gap/max"]) < 1e-3
        assert abs(float(r["train/rollout/seq_ratio/mean"]) - 1) < 1e-3
    first = module.last.rollout.response_ids.clone()

    copy_dir = _with_generation_defaults(tmp_path, cache_dir / "models" / "tiny-qwen2", **SHIPPED)
    leaky, rows2 = _fit(
        train_cfg(
            *ACCEPTANCE,
            "trainer.max_steps=3",
            f"model.name_or_path={copy_dir}",
            "model.tiny=null",
            f"paths.output_dir={tmp_path}/leaky",
        )
    )
    assert all(0 <= g < 1e-3 for g in _gaps(rows2)), _gaps(rows2)
    assert torch.equal(leaky.last.rollout.response_ids, first)  # the same samples


# ---- a stand-in engine 0.1 nats off the trainer, and TIS ------------------------------------


class OffsetEngine(HFEngine):
    """The HF engine, reporting the trainer's own log-probs plus ``offset``."""

    offset = 0.1

    def generate(self, prompts, n, sampling, seed):
        from mrtpo.core.forward import pad_left, pad_right

        gens = super().generate(prompts, n, sampling, seed)
        flat = [p for p in prompts for _ in range(n)]
        p_ids, p_mask = pad_left(flat, self.tokenizer.pad_token_id)
        r_ids, r_mask = pad_right([g.token_ids for g in gens], self.tokenizer.pad_token_id)
        was = self.model.training
        self.model.eval()
        with torch.no_grad():
            lp = response_logprobs(
                self.model, p_ids, p_mask, r_ids, r_mask, temperature=sampling.temperature
            )
        self.model.train(was)
        for i, g in enumerate(gens):
            n_tok = len(g.token_ids)
            g.logprobs = (lp[i, :n_tok] + self.offsets(i, n_tok)).tolist()
        return gens

    def offsets(self, row: int, n_tokens: int) -> torch.Tensor:
        """What is added to the trainer's log-prob of each token of response ``row``."""
        return torch.full((n_tokens,), self.offset)


class SilentEngine(HFEngine):
    """The HF engine without its log-probs: what the trainer did before it had them."""

    reports_logprobs = False

    def generate(self, prompts, n, sampling, seed):
        gens = super().generate(prompts, n, sampling, seed)
        for g in gens:
            g.logprobs = None
        return gens


@pytest.mark.parametrize("cap", [2.0, 0.5])
def test_offset_engine_reads_as_the_gap_and_tis_weights_are_capped(train_cfg, cap):
    module, rows = _fit(
        train_cfg(
            "method=gdpo",
            f"rollout.sampling.temperature={TAU}",
            "rollout.engine._target_=tests.integration.test_on_policy.OffsetEngine",
            f"rl.tis_cap={cap}",
        )
    )
    for r in rows:
        assert float(r["train/rollout/logp_gap/mean"]) == pytest.approx(0.1, abs=1e-5)
        assert float(r["train/rollout/tis_weight/mean"]) == pytest.approx(
            min(math.exp(-0.1), cap), abs=1e-5
        )
    scored = module.last
    mask = scored.rollout.response_mask
    want = torch.full((int(mask.sum()),), min(math.exp(-0.1), cap))
    torch.testing.assert_close(scored.tis_weights[mask], want, atol=1e-5, rtol=0)


def test_with_tis_off_losses_are_bit_identical_to_a_run_without_engine_logprobs(
    train_cfg, tmp_path
):
    common = ("method=gdpo", "optim.lr=1e-3", "trainer.max_steps=3")
    with_gap, rows = _fit(train_cfg(*common, f"paths.output_dir={tmp_path}/a"))
    assert "train/rollout/logp_gap/mean" in rows[0]
    before, rows0 = _fit(
        train_cfg(
            *common,
            "rollout.engine._target_=tests.integration.test_on_policy.SilentEngine",
            f"paths.output_dir={tmp_path}/b",
        )
    )
    assert "train/rollout/logp_gap/mean" not in rows0[0]
    assert [r["train/loss"] for r in rows] == [r["train/loss"] for r in rows0]
    a, b = with_gap.policy.state_dict(), before.policy.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_tis_needs_an_engine_that_reports_logprobs(train_cfg, monkeypatch):
    cfg = train_cfg(
        "method=gdpo",
        "rollout.engine._target_=tests.integration.test_on_policy.SilentEngine",
        "rl.tis_cap=2.0",
        "trainer.max_steps=1",
    )

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before rl.tis_cap was checked")

    monkeypatch.setattr(models_mod, "load_policy", refuse)
    with pytest.raises(ConfigError, match=r"rl\.tis_cap=2\.0 .*SilentEngine reports none"):
        build(cfg)


# ---- bad input fails at start-up, naming the key --------------------------------------------


@pytest.mark.parametrize(
    "override, key",
    [
        ("rollout.sampling.top_p=1.5", "rollout.sampling.top_p"),
        ("rollout.sampling.top_p=0", "rollout.sampling.top_p"),
        ("rollout.sampling.top_p=0.9", "rollout.sampling.top_p"),  # truncation: refused in RL
        ("rollout.sampling.top_k=20", "rollout.sampling.top_k"),
        ("rollout.sampling.min_p=0.05", "rollout.sampling.min_p"),
        ("rollout.sampling.temperature=-0.5", "rollout.sampling.temperature"),
        ("rollout.sampling.temperature=0", "rollout.sampling.temperature"),
        ("rl.tis_cap=0", "rl.tis_cap"),
        ("rl.tis_cap=-1.0", "rl.tis_cap"),
    ],
)
def test_bad_sampling_or_tis_fails_before_the_model_loads(train_cfg, override, key):
    cfg = train_cfg(override)
    with pytest.raises((ValueError, ConfigError)) as err:
        prepare(cfg)
    assert key in str(err.value)


def test_truncated_refusal_says_why(train_cfg):
    with pytest.raises(ValueError) as err:
        prepare(train_cfg("rollout.sampling.top_p=0.95"))
    msg = str(err.value)
    assert "rollout.sampling.top_p=1.0" in msg and "off-policy" in msg


def test_eval_sampling_is_greedy_or_at_the_stated_temperature(tmp_path):
    from tests.conftest import compose_config

    from mrtpo.evaluate.job import eval_sampling

    cfg = compose_config("eval.yaml", [f"paths.output_dir={tmp_path}"])
    assert eval_sampling(cfg, 1).greedy
    cfg = compose_config(
        "eval.yaml",
        [f"paths.output_dir={tmp_path}", "eval.temperature=0.6", "rollout.sampling.top_p=0.9"],
    )
    s = eval_sampling(cfg, 4)
    assert not s.greedy and s.temperature == 0.6 and s.top_p == 0.9  # eval may truncate
    assert copy.copy(s).truncated


def test_the_gap_measurement_can_be_skipped_when_it_costs_a_forward(train_cfg, tmp_path):
    """One update per step and no TIS: rl.measure_logp_gap=false skips the extra old-policy
    pass (and so the gap); by default the gap is logged every step."""
    import csv

    from mrtpo.lightning.pipeline import train

    cols = {}
    for flag in ("true", "false"):
        out = tmp_path / flag
        train(train_cfg("method=gdpo", f"rl.measure_logp_gap={flag}", f"paths.output_dir={out}"))
        with open(out / "csv" / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
        cols[flag] = [r.get("train/rollout/logp_gap/mean", "") for r in rows]
    assert all(v not in ("", "nan") for v in cols["true"]), cols
    assert all(v in ("", "nan") for v in cols["false"]), cols
