"""Export: every RL run leaves ``<run>/policy/``, and ``src/export.py`` converts a checkpoint; the
folder reloads offline with ``AutoModelForCausalLM.from_pretrained`` and gives the trained
policy's logits, LoRA merged; ``src/eval.py model.name_or_path=<dir>`` evaluates it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.conftest import ROOT, compose_config

from mrtpo.lightning.pipeline import build

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
TRAINED = ["optim.lr=0.02", "optim.weight_decay=0.0", "rl.group_size=4"]


def _logits(model, tok) -> torch.Tensor:
    ids = tok(["Write a short reply. End with the word river."], return_tensors="pt")
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            return model(**ids).logits
    finally:
        model.train(was)


def _tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _reload(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(folder, local_files_only=True)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_every_rl_run_exports_a_policy_with_the_trained_logits(train_cfg, tmp_path, lora, tiny):
    cfg = train_cfg(*TRAINED, *(["model.lora.r=4"] if lora else []))
    trainer, module, dm = build(cfg)
    trainer.fit(module, datamodule=dm)
    folder = tmp_path / "policy"
    assert (folder / "config.json").is_file()
    model, tok = _reload(folder)
    want = _logits(module.policy, module.tokenizer)
    got = _logits(model, tok)
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    # trained: the export is not the starting model
    assert not torch.allclose(_logits(tiny[0], tiny[1]), want, atol=1e-4)
    assert tok.get_vocab() == module.tokenizer.get_vocab()
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["max_new_tokens"] == 8 and gen["do_sample"] is True  # rollout.sampling
    assert gen["temperature"] == 1.0 and gen["top_p"] == 1.0 and gen["top_k"] == 0
    assert gen["eos_token_id"] == module.tokenizer.eos_token_id
    record = json.loads((folder / "mrtpo_export.json").read_text())
    assert record["lora_merged"] is lora and record["step"] == 2
    names = set(json.loads((folder / "config.json").read_text()))
    assert "architectures" in names
    if lora:  # merged: a plain transformers model, no adapter files
        assert not (folder / "adapter_config.json").exists()


def _export_cmd(*args: str, log_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "src/export.py", *args, f"paths.log_dir={log_dir}"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory, cache_dir):
    """A 2-step LoRA run through src/train.py (its .hydra/config.yaml is what export reads)."""
    logs = tmp_path_factory.mktemp("export_src")
    cmd = [
        sys.executable,
        "src/train.py",
        "model.lora.r=4",
        "trainer.max_steps=2",
        "rl.prompts_per_step=2",
        "rollout.sampling.max_new_tokens=6",
        "rollout.sampling.temperature=0.7",
        f"paths.log_dir={logs}",
        f"paths.cache_dir={cache_dir}",
        *TRAINED,
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = list((logs / "train" / "runs").iterdir())
    return run


def test_export_cli_converts_a_checkpoint_and_eval_reads_it(lora_checkpoint, tmp_path, cache_dir):
    run = lora_checkpoint
    ckpt = run / "checkpoints" / "last.ckpt"
    before = _tree_digest(run / "checkpoints")
    model_dir = cache_dir / "models" / "tiny-qwen2"
    model_before = _tree_digest(model_dir)
    out = tmp_path / "exported"
    res = _export_cmd(f"ckpt_path={ckpt}", f"out={out}", log_dir=tmp_path / "logs")
    assert res.returncode == 0, res.stderr[-3000:]
    assert _tree_digest(run / "checkpoints") == before  # nothing written beside the checkpoint
    assert _tree_digest(model_dir) == model_before  # nor into the model folder
    # the checkpoint's export equals the run's own end-of-training export
    a, tok = _reload(out)
    b, _ = _reload(run / "policy")
    assert torch.allclose(_logits(a, tok), _logits(b, tok), atol=1e-6, rtol=0)
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["temperature"] == 0.7 and gen["max_new_tokens"] == 6  # the run's sampling
    assert json.loads((out / "mrtpo_export.json").read_text())["step"] == 2
    # a second export into the same folder replaces the previous export
    res = _export_cmd(f"ckpt_path={ckpt}", f"out={out}", log_dir=tmp_path / "logs")
    assert res.returncode == 0, res.stderr[-3000:]
    # and src/eval.py evaluates it
    ev = tmp_path / "eval"
    res = subprocess.run(
        [
            sys.executable,
            "src/eval.py",
            f"model.name_or_path={out}",
            "eval.limit=2",
            "eval.max_new_tokens=4",
            f"eval.output={ev}",
            f"paths.cache_dir={cache_dir}",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = json.loads((ev / "metrics.json").read_text())
    assert "success" in json.dumps(metrics)
    assert not (out / "mrtpo_tiny.json").exists()  # eval loaded it as a model, built nothing


def test_export_refuses_unsafe_destinations_and_other_models(lora_checkpoint, tmp_path, cache_dir):
    from mrtpo.evaluate.export import run

    ckpt = lora_checkpoint / "checkpoints" / "last.ckpt"
    model_dir = cache_dir / "models" / "tiny-qwen2"

    def export(*overrides: str):
        cfg = compose_config(
            "export.yaml",
            [f"ckpt_path={ckpt}", f"paths.log_dir={tmp_path}/logs", *overrides],
        )
        return run(cfg)

    with pytest.raises(ValueError, match=r"out=.*checkpoint folder"):
        export(f"out={ckpt.parent}/hf")
    with pytest.raises(ValueError, match=r"out=.*model folder"):
        export(f"out={model_dir}")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"out=.*not empty"):
        export(f"out={busy}")
    assert (busy / "notes.txt").read_text() == "mine"
    # the run trained LoRA adapters: a model without them does not match, naming model=
    with pytest.raises(ValueError, match=r"holds a different model.*model.lora.r.*model="):
        export(f"out={tmp_path}/x", "model.lora.r=0")
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match=r"ckpt_path"):
        run(compose_config("export.yaml", [f"out={tmp_path}/y"]))


def test_the_end_of_run_export_never_overwrites_the_starting_model(
    train_cfg, tmp_path, cache_dir, caplog, tiny
):
    """A run started from ``<out>/policy`` (an SFT warm start, a user's folder) in the same
    output folder: the export is skipped with a warning naming the key, the folder untouched."""
    import logging
    import shutil

    start = tmp_path / "policy"
    shutil.copytree(cache_dir / "models" / "tiny-qwen2", start)
    (start / "mrtpo_tiny.json").unlink()  # a model of the user's, not one the project built
    before = _tree_digest(start)
    cfg = train_cfg(f"model.name_or_path={start}", "model.tiny=null", "trainer.max_steps=1")
    trainer, module, dm = build(cfg)
    with caplog.at_level(logging.WARNING, logger="mrtpo.lightning.callbacks.export"):
        trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 1
    assert _tree_digest(start) == before
    assert "callbacks.export.dirpath" in caplog.text and "started from" in caplog.text


def test_the_exported_generation_config_drops_the_checkpoints_own_defaults(tiny):
    """A Qwen-style checkpoint ships a repetition penalty and top-k; the exported policy must
    sample as training did, so none of them may come back."""
    import copy

    from mrtpo.evaluate.export import generation_config

    model, tok = tiny
    model = copy.deepcopy(model)
    model.generation_config.repetition_penalty = 1.3
    model.generation_config.no_repeat_ngram_size = 2
    gen = generation_config(model, tok, {"temperature": 0.7, "max_new_tokens": 12})
    assert gen.repetition_penalty == 1.0 and gen.no_repeat_ngram_size == 0
    assert gen.do_sample and gen.temperature == 0.7 and gen.max_new_tokens == 12
    assert gen.top_k in (0, None) and gen.top_p == 1.0


def test_a_loose_generation_config_of_the_starting_model_does_not_fail_the_export(
    train_cfg, tmp_path, cache_dir
):
    """A checkpoint whose generation_config sets ``top_k`` and ``temperature`` without
    ``do_sample`` (transformers warns on load, refuses on save) used to train, then crash
    exporting ``policy/``. The export writes the training sampling settings only."""
    import shutil

    start = tmp_path / "loose"
    shutil.copytree(cache_dir / "models" / "tiny-qwen2", start)
    (start / "mrtpo_tiny.json").unlink()  # a model of the user's, not one the project built
    gen_file = start / "generation_config.json"
    loose = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    loose.update(do_sample=False, top_k=5, temperature=0.3)
    gen_file.write_text(json.dumps(loose))
    before = _tree_digest(start)
    out = tmp_path / "run"
    cfg = train_cfg(
        f"model.name_or_path={start}",
        "model.tiny=null",
        "trainer.max_steps=1",
        f"paths.output_dir={out}",
    )
    trainer, module, dm = build(cfg)
    assert module.policy.generation_config.top_k == 5  # the loose config was loaded
    trainer.fit(module, datamodule=dm)
    gen = json.loads((out / "policy" / "generation_config.json").read_text())
    assert gen["do_sample"] is True and gen["top_k"] == 0 and gen["temperature"] == 1.0
    assert (out / "policy" / "config.json").is_file()
    assert module.policy.generation_config.top_k == 5  # the model's own is put back
    assert _tree_digest(start) == before  # the user's folder is only read


# ---- the printed evaluation command (issue 29 item 5) ------------------------------------------


def _eval_words(command: str) -> list[str]:
    import shlex

    words = shlex.split(command)
    assert words[:2] == ["python", "src/eval.py"], command
    return words[2:]


def test_the_printed_eval_command_scores_the_runs_task(lora_checkpoint):
    """The end-of-run line used to say `src/eval.py model.name_or_path=<run>/policy` only:
    copied, it evaluated on the synthetic task with eval's own token limit."""
    run = lora_checkpoint
    (line,) = [s for s in (run / "train.log").read_text().splitlines() if "(evaluate: " in s]
    command = line.split("(evaluate: ", 1)[1].removesuffix(")")
    ev = compose_config("eval.yaml", _eval_words(command))
    assert ev.model.name_or_path == str(run / "policy")
    assert ev.hydra.runtime.choices.task == "synthetic"
    assert ev.eval.max_new_tokens == 6  # the run's rollout.sampling.max_new_tokens


@pytest.mark.parametrize(
    "overrides",
    [
        # keys an experiment sets (toy_long: free_tokens, num_train, ...) and the command line
        ["experiment=toy_long", "task.num_constraints=3"],
        # another task, a smoke limit (left out: evaluation scores the whole split), another
        # data folder, a list and a quoted string
        ["task=text2sql", "task.max_examples=16", "paths.data_dir=/data dir",
         "task.splits.train.db_dir=[a,'b c']", "task.system_prompt=\"It's a \\\"test\\\", ok\""],
    ],
    ids=["experiment", "text2sql"],
)  # fmt: skip
def test_the_eval_command_composes_to_the_runs_task(overrides):
    import shlex

    from omegaconf import OmegaConf

    from mrtpo.lightning.callbacks.export import eval_overrides

    run = compose_config("train.yaml", overrides)
    saved = OmegaConf.create(OmegaConf.to_container(run, resolve=False))  # .hydra/config.yaml
    del saved["hydra"]
    words = eval_overrides(saved, run.hydra.runtime.choices.task)
    command = "python src/eval.py " + " ".join(shlex.quote(w) for w in words)
    ev = compose_config("eval.yaml", _eval_words(command))
    want = OmegaConf.to_container(run.task, resolve=True)
    if "max_examples" in want:
        want["max_examples"] = None
    assert OmegaConf.to_container(ev.task, resolve=True) == want
    assert ev.eval.max_new_tokens in (None, run.rollout.sampling.max_new_tokens)
    assert ev.rollout.sampling.max_new_tokens == run.rollout.sampling.max_new_tokens or (
        ev.eval.max_new_tokens == run.rollout.sampling.max_new_tokens
    )
