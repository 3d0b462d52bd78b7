"""Faults during training and bad data: contained where possible, clear errors otherwise.

The tiny model and the synthetic task run for real; each fault is injected by a small
subclass of the real task, method or replayer (a reward function that raises, a reward that is
NaN or infinite, a replay that runs out of memory), and the test checks the counter or the
message the user would see.
"""

from __future__ import annotations

import csv
import json
import logging
import math

import pytest
import torch

from mrtpo.core.credit.methods import GDPO, CreditOutput, RewardSet
from mrtpo.core.evaluation import read_jsonl, score_responses
from mrtpo.core.replay import Replayer
from mrtpo.lightning.data import PromptDataModule
from mrtpo.lightning.pipeline import build, metrics_csv
from mrtpo.tasks.base import Score
from mrtpo.tasks.synthetic import SyntheticTask

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- injected faults ----------------------------------------------------------------------


class FlakyTask(SyntheticTask):
    """Every third ``score`` call raises (a verifier bug that hits some samples)."""

    calls = 0

    def score(self, example, response):
        FlakyTask.calls += 1
        if FlakyTask.calls % 3 == 0:
            raise KeyError("verifier crashed")
        return super().score(example, response)


class BrokenTask(SyntheticTask):
    def score(self, example, response):
        raise RuntimeError("database is gone")


class BrokenBatchTask(SyntheticTask):
    """A ``score_many`` override (a process pool, say) that dies; ``score`` itself is fine."""

    def score_many(self, examples, responses):
        raise BrokenPipeError("worker pool died")


class ShortBatchTask(SyntheticTask):
    def score_many(self, examples, responses):
        return super().score_many(examples, responses)[:-1]


class ValueTask(SyntheticTask):
    """Sets reward ``first`` to ``value`` (on the first ``steps`` steps' worth of calls)."""

    def __init__(self, value, calls: int | None = None, **kw):
        super().__init__(**kw)
        self.value, self.calls_left = value, calls

    def score(self, example, response):
        s = super().score(example, response)
        if self.calls_left is None or self.calls_left > 0:
            s.rewards["first"] = self.value
            if self.calls_left is not None:
                self.calls_left -= 1
        return s


class HugeAdvantages(GDPO):
    """Finite advantages whose loss overflows float32."""

    def __call__(self, inputs):
        out = super().__call__(inputs)
        return CreditOutput(torch.where(inputs.mask, 1e38, 0.0), out.stats)


class NaNAdvantages(GDPO):
    def __call__(self, inputs):
        out = super().__call__(inputs)
        return CreditOutput(out.advantages * float("nan"), out.stats)


class OOMReplayer(Replayer):
    """Raises ``torch.OutOfMemoryError`` on the first ``fail`` calls, as CUDA would."""

    def __init__(self, *a, fail: int = 1, **kw):
        super().__init__(*a, **kw)
        self.fail, self.budgets = fail, []

    def run(self, *a, **kw):
        self.budgets.append(self.token_budget)
        if self.fail > 0:
            self.fail -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return super().run(*a, **kw)


# ---- helpers ------------------------------------------------------------------------------


def synthetic_kwargs(cfg) -> dict:
    return {k: v for k, v in cfg.task.items() if k != "_target_"}


def fit_with(cfg, task=None, method=None, replayer=None):
    trainer, module, dm = build(cfg)
    if task is not None:
        module.task = dm.task = task
    if method is not None:
        method.setup(module.task)
        module.method = method
    if replayer is not None:
        module.replayer = replayer
    trainer.fit(module, datamodule=dm)
    return trainer, module


def rows(trainer) -> list[dict[str, str]]:
    with open(metrics_csv(trainer)) as f:
        return list(csv.DictReader(f))


def col(rs, key) -> list[float]:
    return [float(r[key]) if r.get(key) not in (None, "") else math.nan for r in rs]


# ---- reward functions that raise ----------------------------------------------------------


def test_a_raising_reward_costs_only_that_sample(train_cfg, caplog):
    cfg = train_cfg("method=gdpo", "trainer.max_steps=3")
    FlakyTask.calls = 0
    task = FlakyTask(**synthetic_kwargs(cfg))
    with caplog.at_level(logging.WARNING):
        trainer, module = fit_with(cfg, task=task)
    assert module.iteration == 3 and trainer.global_step == 3
    rs = rows(trainer)
    per_step = col(rs, "train/scoring_errors")
    # 4 responses per step, every third score call raises: 12 calls, 4 failures
    assert sum(per_step) == 4 and all(x >= 1 for x in per_step)
    assert col(rs, "train/scoring_errors_total")[-1] == 4
    assert col(rs, "train/nonfinite_skips")[-1] == 0
    failed = [r for r in caplog.records if "reward function failed on example" in r.getMessage()]
    assert failed and "KeyError" in failed[0].getMessage()
    assert "example train-" in failed[0].getMessage()  # the sample id is in the log


def test_every_sample_failing_stops_after_the_configured_streak(train_cfg):
    cfg = train_cfg("method=gdpo", "trainer.max_steps=5", "rl.max_consecutive_score_failures=2")
    with pytest.raises(RuntimeError) as err:
        fit_with(cfg, task=BrokenTask(**synthetic_kwargs(cfg)))
    msg = str(err.value)
    assert "for 2 steps in a row" in msg
    assert "RuntimeError: database is gone" in msg
    assert "rl.max_consecutive_score_failures" in msg


def test_a_score_many_override_that_raises_falls_back_to_safe_scoring(train_cfg, caplog):
    cfg = train_cfg("method=gdpo")
    with caplog.at_level(logging.WARNING):
        trainer, _ = fit_with(cfg, task=BrokenBatchTask(**synthetic_kwargs(cfg)))
    rs = rows(trainer)
    assert col(rs, "train/score_many_fallbacks") == [1.0, 2.0]
    assert col(rs, "train/scoring_errors") == [0.0, 0.0]  # each sample still scored
    assert not math.isnan(col(rs, "train/reward/first/mean")[0])
    assert any("BrokenPipeError: worker pool died" in r.getMessage() for r in caplog.records)


def test_a_score_many_returning_too_few_scores_is_caught(train_cfg):
    cfg = train_cfg("method=gdpo", "trainer.max_steps=1")
    trainer, _ = fit_with(cfg, task=ShortBatchTask(**synthetic_kwargs(cfg)))
    assert col(rows(trainer), "train/score_many_fallbacks") == [1.0]


def test_a_reward_that_is_not_a_number_is_a_scoring_error(train_cfg):
    cfg = train_cfg("method=gdpo", "trainer.max_steps=1")
    trainer, module = fit_with(cfg, task=ValueTask("yes", **synthetic_kwargs(cfg)))
    assert col(rows(trainer), "train/scoring_errors") == [4.0]
    assert "not a number" in module.last.scores[0].error
    assert module.last.scores[0].rewards["first"] is None


# ---- non-finite values --------------------------------------------------------------------


def test_nan_reward_means_does_not_apply(train_cfg):
    cfg = train_cfg("method=mrtpo", "trainer.max_steps=2")
    trainer, module = fit_with(cfg, task=ValueTask(float("nan"), **synthetic_kwargs(cfg)))
    rs = rows(trainer)
    assert module.iteration == 2
    assert col(rs, "train/nonfinite_skips") == [0.0, 0.0]
    assert "train/reward/first/mean" not in rs[0]  # never present
    assert all(not math.isnan(x) for x in col(rs, "train/reward/last/mean"))
    k = module.last.reward_names.index("first")
    assert module.last.rewards[:, k].isnan().all()
    assert module.last.scores[0].rewards["first"] is None


def test_inf_reward_skips_the_step_and_the_run_goes_on(train_cfg, caplog):
    cfg = train_cfg("method=mrtpo", "trainer.max_steps=3", "optim.lr=1e-3")
    # the first step's 4 responses get an infinite reward; later steps are clean
    task = ValueTask(float("inf"), calls=4, **synthetic_kwargs(cfg))
    trainer, module = fit_with(cfg, task=task)
    rs = rows(trainer)
    assert [r["step"] for r in rs] == ["0", "1", "2"]  # the skipped step keeps its row
    assert col(rs, "train/skipped")[0] == 1.0
    assert col(rs, "train/nonfinite_skips") == [1.0, 1.0, 1.0]
    assert module.iteration == 3 and trainer.global_step == 3
    # the learning-rate warm-up counts the skipped step too, as β's warm-up does
    assert module.lr_schedulers().last_epoch == 3
    assert any("non-finite rewards at step 0" in r.getMessage() for r in caplog.records)


def test_repeated_non_finite_rewards_stop_the_run(train_cfg):
    cfg = train_cfg("method=gdpo", "trainer.max_steps=5", "rl.max_nonfinite_steps=2")
    with pytest.raises(RuntimeError) as err:
        fit_with(cfg, task=ValueTask(float("-inf"), **synthetic_kwargs(cfg)))
    msg = str(err.value)
    assert "2 steps had non-finite values (last: rewards)" in msg
    assert "rl.max_nonfinite_steps" in msg


def test_non_finite_advantages_skip_without_touching_the_weights(train_cfg):
    cfg = train_cfg("method=gdpo", "trainer.max_steps=2", "optim.lr=1e-2")
    trainer, module, dm = build(cfg)
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    method = NaNAdvantages()
    method.setup(RewardSet(tuple(module.task.reward_names), False))
    module.method = method
    trainer.fit(module, datamodule=dm)
    for k, v in module.policy.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert module.nonfinite_steps == 2 and trainer.global_step == 2


def test_non_finite_loss_stops_after_the_limit(train_cfg, caplog):
    cfg = train_cfg("method=gdpo", "trainer.max_steps=3", "rl.max_nonfinite_steps=2")
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError) as err:
        fit_with(cfg, method=HugeAdvantages())
    assert "(last: loss)" in str(err.value)
    assert "rl.max_nonfinite_steps" in str(err.value)
    assert any("non-finite loss at step 0" in r.getMessage() for r in caplog.records)


def test_a_diverged_policy_stops_the_run_naming_the_learning_rate(train_cfg):
    """``optim.lr=1e10``: the weights stay finite (the post-update check passes) but the logits
    overflow; the next rollout used to die inside ``torch.multinomial``."""
    cfg = train_cfg("method=gdpo", "trainer.max_steps=4", "optim.lr=1e10")
    with pytest.raises(Exception) as err:
        fit_with(cfg)
    msg = str(err.value)
    assert isinstance(err.value, FloatingPointError), f"{type(err.value).__name__}: {msg}"
    assert "logits are not finite" in msg and "optim.lr" in msg


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.0, "greedy": True}])
@pytest.mark.parametrize("fault", ["nan weights", "finite weights, overflowing logits"])
def test_the_hf_engine_refuses_to_sample_from_non_finite_logits(tiny, fault, sampling):
    import copy

    from mrtpo.rollout.base import SamplingConfig
    from mrtpo.rollout.hf import HFEngine

    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        if fault == "nan weights":
            head.fill_(float("nan"))
        else:  # every weight finite; the logits pass float32's range
            model.model.norm.weight.mul_(1e38)
            head.mul_(100)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert finite == (fault != "nan weights")
    engine = HFEngine(batch_size=4)
    engine.bind(model, tok, [tok.eos_token_id])
    cfg = SamplingConfig(max_new_tokens=4, **sampling)
    with pytest.raises(Exception) as err:
        engine.generate([[1, 2, 3], [4, 5]], 2, cfg, seed=0)
    assert isinstance(err.value, FloatingPointError), f"{type(err.value).__name__}: {err.value}"
    assert "optim.lr" in str(err.value)
    # the same engine still samples from a healthy model
    engine.bind(tiny[0], tok, [tok.eos_token_id])
    out = engine.generate([[1, 2, 3]], 2, cfg, seed=0)
    assert len(out) == 2 and all(g.token_ids for g in out)


# ---- out of memory in replay --------------------------------------------------------------


def test_replay_out_of_memory_retries_with_half_the_budget(train_cfg, tiny, caplog):
    # no beta warm-up: both steps replay
    cfg = train_cfg("method=mrtpo", "method.beta_warmup_steps=0", "trainer.max_steps=2")
    oom = OOMReplayer(tiny[1], token_budget=4096, fail=2)
    with caplog.at_level(logging.WARNING):
        trainer, module = fit_with(cfg, replayer=oom)
    # step 0: 4096 fails, 2048 fails, 1024 works; step 1 starts at the lowered 1024
    assert oom.budgets == [4096, 2048, 1024, 1024]
    rs = rows(trainer)
    assert col(rs, "train/replay_oom_retries") == [2.0, 2.0]
    assert col(rs, "train/nonfinite_skips") == [0.0, 0.0]
    assert "train/replay/share" in rs[0]
    assert module.last.q is not None
    assert any("retrying with replay.token_budget=2048" in r.getMessage() for r in caplog.records)


def test_replay_out_of_memory_gives_up_with_the_knobs_named(train_cfg, tiny):
    cfg = train_cfg(
        "method=mrtpo",
        "method.beta_warmup_steps=0",  # replay runs from step 0
        "trainer.max_steps=1",
        "rl.replay_oom_retries=2",
    )
    oom = OOMReplayer(tiny[1], token_budget=64, fail=100)
    with pytest.raises(RuntimeError) as err:
        fit_with(cfg, replayer=oom)
    assert oom.budgets == [64, 32, 16]
    msg = str(err.value)
    assert "replay ran out of memory 3 time(s), down to replay.token_budget=16" in msg
    assert "rl.replay_oom_retries" in msg and "OutOfMemoryError" in msg


# ---- bad data -----------------------------------------------------------------------------


def test_malformed_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "responses.jsonl"
    path.write_text('{"id": "a", "response": "x"}\n\n{"id": "b", "response": \n')
    with pytest.raises(ValueError) as err:
        read_jsonl(path)
    assert f"{path}:3: malformed JSON line" in str(err.value)


def test_missing_field_names_field_and_file(tmp_path):
    task = SyntheticTask(num_train=4, num_val=4)
    examples = task.examples("val")
    path = tmp_path / "responses.jsonl"
    lines = [{"id": examples[0].id, "response": "apple"}, {"id": examples[1].id, "text": "x"}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(ValueError) as err:
        score_responses(task, examples, path, tmp_path / "out")
    assert f"{path}:2: missing field 'response'" in str(err.value)


def test_empty_train_split_after_the_length_filter_fails_before_training(tiny):
    _, tok = tiny
    dm = PromptDataModule(SyntheticTask(num_train=5), tokenizer=tok, max_prompt_tokens=3)
    with pytest.raises(ValueError) as err:
        dm.setup("fit")
    msg = str(err.value)
    assert "loaded 5 examples and the prompt-length filter removed all 5" in msg
    assert "data.max_prompt_tokens=3" in msg


def test_task_that_loads_nothing_fails_before_training():
    dm = PromptDataModule(SyntheticTask(num_train=0))
    with pytest.raises(ValueError, match="the task loaded no examples"):
        dm.setup("fit")


def test_empty_val_split_names_the_knob(tiny):
    _, tok = tiny

    class NoVal(SyntheticTask):
        def examples(self, split):
            return [] if split == "val" else super().examples(split)

    dm = PromptDataModule(NoVal(num_train=5), tokenizer=tok, val_prompts=4)
    with pytest.raises(ValueError, match=r"val split is empty.*data.val_prompts=0"):
        dm.setup("fit")


def test_faulty_task_fixture_is_real():
    """The injected task really is the synthetic task apart from the fault."""
    task = ValueTask(float("nan"), num_train=3)
    ex = task.examples("train")[0]
    s = task.score(ex, ex.reference)
    plain = SyntheticTask(num_train=3).score(ex, ex.reference)
    assert isinstance(s, Score) and math.isnan(s.rewards["first"])
    assert {k: v for k, v in s.rewards.items() if k != "first"} == {
        k: v for k, v in plain.rewards.items() if k != "first"
    }
