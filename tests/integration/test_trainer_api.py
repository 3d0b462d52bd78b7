"""``from mrtpo import Trainer, Config`` (issue 50, item 1): a TRL GRPO quickstart script with
only its import and class names changed trains the tiny model for GDPO and MRTPO through the
same job as ``src/train.py`` (run folder, records), with per-reward metrics, the trained
policy left in memory, TRL's conversational form, a list-of-dicts dataset, a model object
passed in (its folder left untouched), and one-line refusals that leave no run folder."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

# A GRPO quickstart as TRL's documentation writes it; only the import line and the class
# names (GRPOConfig -> Config, GRPOTrainer -> Trainer) differ. The test fills in the __NAMES__.
QUICKSTART = """
from datasets import Dataset
from mrtpo import Config, Trainer

dataset = Dataset.from_list(
    [{"prompt": f"Write a short line about the number {i}.", "target": 20 + i} for i in range(6)]
)


# Reward completions whose length is close to the row's target
def reward_len(completions, target, **kwargs):
    return [-abs(t - len(completion)) / t for completion, t in zip(completions, target)]


def reward_vowels(prompts, completions, completion_ids, **kwargs):
    assert len(completion_ids) == len(completions)
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]


training_args = Config(
    output_dir=__OUT__,
    method=__METHOD__,
    logging_steps=1,
    max_steps=2,
    num_generations=2,
    per_device_train_batch_size=4,
    max_completion_length=8,
)
trainer = Trainer(
    model=__MODEL__,
    reward_funcs=[reward_len, reward_vowels],
    args=training_args,
    train_dataset=dataset,
    __BLOCKS__
)
result = trainer.train()
"""

BLOCKS = 'reward_blocks={"reward_len": lambda prompt, response, target, **row: f"Aim: {target}"},'


@pytest.fixture
def tiny_path(tiny, cache_dir, monkeypatch):
    """The tiny model's folder (built by ``tiny``); runs find the cache through the env."""
    monkeypatch.setenv("MRTPO_CACHE_DIR", str(cache_dir))
    return cache_dir / "models" / "tiny-qwen2"


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _changed(before: dict[str, torch.Tensor], model) -> bool:
    return any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def _folder_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("method", ["gdpo", "mrtpo"])
def test_trl_quickstart_script_trains(method, tiny_path, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    fill = {"__OUT__": repr(str(out)), "__METHOD__": repr(method),
            "__MODEL__": repr(str(tiny_path)), "__BLOCKS__": BLOCKS if method == "mrtpo" else ""}  # fmt: skip
    script = QUICKSTART
    for name, value in fill.items():
        script = script.replace(name, value)
    start = AutoModelForCausalLM.from_pretrained(tiny_path)
    scope: dict = {}
    exec(compile(script, "trl_quickstart.py", "exec"), scope)  # as `python trl_quickstart.py`
    result, trainer = scope["result"], scope["trainer"]

    # the job src/train.py runs: its run folder, records and a completed job.json
    assert result.run_dir.parent == out / "train" / "runs"
    assert result.run_dir.name.endswith(f"custom-{method}")
    assert (result.run_dir / ".hydra" / "config.yaml").is_file()
    assert json.loads((result.run_dir / "job.json").read_text())["status"] == "completed"
    log = (result.run_dir / "train.log").read_text()
    assert "evaluate: python src/eval.py" in log and "mrtpo-live:" not in log  # no dead tokens
    recorded = (result.run_dir / ".hydra" / "config.yaml").read_text()
    assert "mrtpo.live.reward_" in recorded and "mrtpo-live:train_dataset_" in recorded
    # per-reward metrics, logged every step
    for name in ("reward_len", "reward_vowels"):
        assert f"train/reward/{name}/mean" in result.metrics, sorted(result.metrics)
    rows = [r for r in result.history() if "train/reward/reward_len/mean" in r]
    assert len(rows) == 2
    # the trained policy, in memory: moved from the start, equal to the run's exported policy
    assert isinstance(trainer.model, torch.nn.Module) and trainer.tokenizer is not None
    assert _changed(_weights(start), trainer.model)
    exported = AutoModelForCausalLM.from_pretrained(result.policy)
    assert not _changed(_weights(exported), trainer.model)
    assert result.metrics["train/scoring_errors_total"] == 0  # every reward scored every batch
    if method == "mrtpo":  # reward_len's block gave replay its leave-one-out contexts
        assert result.metrics["train/replay/forwards"] > 0
        assert "train/replay/top80_token_share/reward_len" in result.metrics


def test_loaded_model_conversational_list_of_dicts(tiny_path, tmp_path):
    import lightning as L
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mrtpo import Config, Trainer

    before_folder = _folder_digest(tiny_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    tok = AutoTokenizer.from_pretrained(tiny_path)
    start = _weights(model)
    seen: dict[str, object] = {}

    def short(prompts, completions, **kwargs):  # TRL's conversational form
        seen["prompt"], seen["completion"] = prompts[0], completions[0]
        return [1.0 / (1 + len(c[0]["content"])) for c in completions]

    class Steps(L.Callback):
        n = 0

        def on_train_batch_end(self, *args, **kwargs):
            Steps.n += 1

    rows = [
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}]}
        for q in ("Hi?", "Why?", "Who?", "When?")
    ]
    args = Config(output_dir=str(tmp_path / "out"), method="gdpo", max_steps=2,
                  num_generations=2, per_device_train_batch_size=4, max_completion_length=6,
                  eval_steps=2)  # fmt: skip
    trainer = Trainer(model=model, reward_funcs=short, args=args, train_dataset=rows,
                      eval_dataset=rows[:2], processing_class=tok, callbacks=[Steps()])  # fmt: skip
    result = trainer.train()

    assert trainer.model is model and trainer.tokenizer is tok  # trained in place, in memory
    assert _changed(start, model)
    assert seen["prompt"] == rows[0]["prompt"] or seen["prompt"] in [r["prompt"] for r in rows]
    assert isinstance(seen["completion"], list) and seen["completion"][0]["role"] == "assistant"
    assert "train/reward/short/mean" in result.metrics
    assert Steps.n >= 2
    assert any(k.startswith("val/") for k in result.metrics), sorted(result.metrics)
    assert _folder_digest(tiny_path) == before_folder  # the model's own folder: never written


def test_bad_inputs_are_one_line_and_leave_no_run_folder(tiny_path, tmp_path):
    from datasets import Dataset

    from mrtpo import Config, Trainer

    out = tmp_path / "out"
    args = Config(output_dir=str(out), max_steps=1)
    ds = Dataset.from_list([{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}])

    def one_value(completions, **kwargs):
        return [1.0]

    with pytest.raises(ValueError, match=r"reward_funcs\[0\] \(one_value\) returned 1 value") as e:
        Trainer(reward_funcs=[one_value], train_dataset=ds, args=args).train()
    assert "\n" not in str(e.value)

    with pytest.raises(ValueError, match=r"train_dataset has no 'prompt' column") as e:
        Trainer(reward_funcs=[one_value], train_dataset=[{"question": "a"}], args=args)
    assert "\n" not in str(e.value) and "question" in str(e.value)

    def fine(completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match="multiple of num_generations"):
        Trainer(reward_funcs=fine, train_dataset=ds,
                args=Config(output_dir=str(out), per_device_train_batch_size=3)).train()  # fmt: skip
    with pytest.raises(ValueError, match=r"^Config\(num_generations=1\): rl\.group_size=1 "):
        Trainer(reward_funcs=fine, train_dataset=ds,
                args=Config(output_dir=str(out), num_generations=1)).train()  # fmt: skip
    with pytest.raises(ValueError, match=r"^Config\(credit_beta=0\.5\): method\.beta is not a "
                       "setting of method=gdpo$"):  # fmt: skip
        Trainer(reward_funcs=fine, train_dataset=ds,
                args=Config(output_dir=str(out), method="gdpo", credit_beta=0.5)).train()  # fmt: skip
    with pytest.raises(
        ValueError, match=r"^trainer\.devices=2 .*: mrtpo\.Trainer trains in this one"
    ):
        Trainer(reward_funcs=fine, train_dataset=ds,
                args=Config(output_dir=str(out), overrides=["trainer=ddp"])).train()  # fmt: skip
    with pytest.raises(ValueError, match=r"task\.blocks has key\(s\) \['nope'\] that are not "):
        Trainer(reward_funcs=fine, train_dataset=ds, reward_blocks={"nope": lambda p, r: None},
                args=Config(output_dir=str(out))).train()  # fmt: skip
    with pytest.raises(
        ValueError, match=r"train_dataset_\w+ row 1: column 'prompt' must hold text"
    ):
        Trainer(reward_funcs=fine, train_dataset=[{"prompt": "a"}, {"prompt": 7}],
                args=Config(output_dir=str(out))).train()  # fmt: skip
    with pytest.raises(TypeError, match="reward models are not supported"):
        Trainer(reward_funcs=["some/reward-model"], train_dataset=ds)
    with pytest.raises(TypeError, match=r"reward_funcs\[1\] is a Linear; .* not supported"):
        Trainer(reward_funcs=[fine, torch.nn.Linear(2, 1)], train_dataset=ds)
    assert not out.exists()


def test_every_config_field_sets_a_key_of_the_config_and_is_documented():
    from omegaconf import OmegaConf
    from tests.conftest import ROOT, compose_config

    from mrtpo import Config

    cfg = compose_config("train.yaml", ["task=custom", "method=mrtpo"])
    table = (ROOT / "docs" / "extending.md").read_text(encoding="utf-8")
    missing = object()
    for name, key in Config.mapping().items():
        assert OmegaConf.select(cfg, key, default=missing) is not missing, (name, key)
        assert f"`{name}`" in table and f"`{key}`" in table, (name, key)


def test_iterable_dataset_takes_the_rows_the_run_needs(tiny_path, tmp_path):
    from datasets import Dataset

    from mrtpo import Config, Trainer

    def fine(completions, **kwargs):
        return [0.5] * len(completions)

    stream = Dataset.from_list([{"prompt": f"p{i}"} for i in range(50)]).to_iterable_dataset()
    args = Config(output_dir=str(tmp_path), max_steps=3, num_generations=2,
                  per_device_train_batch_size=4)  # fmt: skip
    assert len(Trainer(reward_funcs=fine, train_dataset=stream, args=args).train_rows) == 6
    with pytest.raises(ValueError, match=r"set Config\(max_steps=N\)"):
        Trainer(reward_funcs=fine, train_dataset=stream, args=Config(output_dir=str(tmp_path)))


def test_a_token_of_an_ended_run_is_one_line_naming_what_to_give():
    from mrtpo.tasks.custom.callables import resolve
    from mrtpo.tasks.custom.task import CustomTask

    with pytest.raises(ImportError, match=r"^mrtpo\.live\.reward_0badc0de was a function given"):
        resolve("mrtpo.live.reward_0badc0de", "task.rewards[0]")
    with pytest.raises(ValueError, match=r"mrtpo-live:train_dataset_0badc0de was a dataset given"):
        CustomTask(data={"path": "mrtpo-live:train_dataset_0badc0de"}, rewards=[len])


# ---- issue 50 review ----------------------------------------------------------------------


def test_completions_per_step_divide_by_the_composed_group_size(tiny_path, tmp_path):
    """per_device_train_batch_size counts completions: prompts per step and the rows read from
    a stream use the group size the config composes to (rl.group_size=8 given as an
    override), not num_generations' default."""
    from datasets import Dataset

    from mrtpo import Config, Trainer

    def fine(completions, **kwargs):
        return [0.5] * len(completions)

    stream = Dataset.from_list([{"prompt": f"p{i}"} for i in range(50)]).to_iterable_dataset()
    args = Config(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=16,
                  overrides=["rl.group_size=8"])  # fmt: skip
    assert "rl.prompts_per_step=2" in args.to_overrides(["fine"])
    assert len(Trainer(reward_funcs=fine, train_dataset=stream, args=args).train_rows) == 6
    # with no batch size given, a stream is read for the composed prompts per step
    args = Config(output_dir=str(tmp_path), max_steps=3, overrides=["rl.prompts_per_step=5"])
    assert len(Trainer(reward_funcs=fine, train_dataset=stream, args=args).train_rows) == 15
    with pytest.raises(ValueError, match=r"multiple of num_generations=8") as e:
        Config(per_device_train_batch_size=12, overrides=["rl.group_size=8"]).to_overrides([])
    assert "\n" not in str(e.value)


def test_a_second_concurrent_session_is_refused_in_one_line(tiny_path, tmp_path):
    """Two trainings in one process at once would swap each other's model and tokenizer
    (mrtpo.live keeps one session): the second is refused, before it makes a run folder."""
    import threading

    from mrtpo import Config, Trainer, live

    entered, release, seen = threading.Event(), threading.Event(), []
    first = live.Session()

    def hold():
        with live.session(first):
            entered.set()
            release.wait(timeout=300)
            seen.append(live.current())

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert entered.wait(timeout=300)
        with (
            pytest.raises(RuntimeError, match=r"another mrtpo\.Trainer") as e,
            live.session(live.Session()),
        ):
            pass
        assert "\n" not in str(e.value)
        out = tmp_path / "out"

        def fine(completions, **kwargs):
            return [0.5] * len(completions)

        with pytest.raises(RuntimeError, match=r"another mrtpo\.Trainer"):
            Trainer(reward_funcs=fine, train_dataset=[{"prompt": "a"}, {"prompt": "b"}],
                    args=Config(output_dir=str(out), max_steps=1)).train()  # fmt: skip
        assert not out.exists()
    finally:
        release.set()
        t.join(timeout=300)
    assert seen == [first]  # the first run kept its own session throughout
    with live.session(live.Session()):  # free again once the first has ended
        pass


@pytest.mark.parametrize("key", ["a,b", "a}", "${oc.env:HOME}", "x y", ""])
def test_a_reward_block_key_that_is_not_a_name_is_refused(key):
    from mrtpo import Trainer

    def fine(completions, **kwargs):
        return [0.5] * len(completions)

    with pytest.raises(ValueError, match=r"^reward_blocks has a key .* not a name") as e:
        Trainer(reward_funcs=fine, train_dataset=[{"prompt": "a"}],
                reward_blocks={key: lambda prompt, response, **row: ""})  # fmt: skip
    assert "\n" not in str(e.value)


def test_train_composes_its_config_once(tiny_path, tmp_path, monkeypatch):
    """Trainer.train() composes the job's config once: the pre-check (no run folder on a bad
    setting) and the run take the same composed config, and the completions per step divide
    by a group size the settings give (num_generations) without a probe composition. Each
    composition is counted where Hydra makes it (the real one runs)."""
    from datasets import Dataset
    from hydra._internal.hydra import Hydra

    from mrtpo import Config, Trainer

    real, made = Hydra.compose_config, []

    def counted(self, *args, **kwargs):
        made.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Hydra, "compose_config", counted)

    def fine(completions, **kwargs):
        return [0.5] * len(completions)

    args = Config(output_dir=str(tmp_path / "out"), max_steps=1, num_generations=2,
                  per_device_train_batch_size=4, max_completion_length=8)  # fmt: skip
    ds = Dataset.from_list([{"prompt": f"p{i}"} for i in range(4)])
    result = Trainer(model=str(tiny_path), reward_funcs=fine, train_dataset=ds, args=args).train()
    assert json.loads((result.run_dir / "job.json").read_text())["status"] == "completed"
    assert "rl.prompts_per_step=2" in result.overrides
    assert len(made) == 1
