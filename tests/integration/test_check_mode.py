"""``python src/train.py ... --check`` (``dry_run=true``, issue 40 item 5): every check of a run
at once, whatever the machine, then what the run would do. On a CPU the GPU refusal came
first and hid every other problem of a preset (data paths, offline model ids, vLLM, the OPSD
teacher's refusal)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from tests.conftest import ROOT, compose_config
from tests.integration.test_presets import HIR_ROWS, IFEVAL_ROWS

from mrtpo.run.dryrun import check_all, dry_run, plan_lines
from mrtpo.run.placement import visible_gpus
from mrtpo.run.settings import ConfigError

TRAIN = str(ROOT / "src" / "train.py")
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def _train(args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, TRAIN, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip


@pytest.fixture
def hir_data(tmp_path):
    """``paths.data_dir`` holding what the instruction presets read: two HIR-16K rows and
    two IFEval prompts."""
    root = tmp_path / "data"
    (root / "HIR-16K").mkdir(parents=True)
    (root / "HIR-16K" / "HIR_trainv1.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in HIR_ROWS)
    )
    (root / "ifeval").mkdir()
    (root / "ifeval" / "input_data.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in IFEVAL_ROWS)
    )
    return root


@pytest.fixture
def qwen3_4b_folder(tmp_path):
    """A folder holding what a model folder holds (Qwen3-4B's config.json, a weights file and
    a tokenizer): the check reads names and sizes, never the weights."""
    folder = tmp_path / "Qwen3-4B-Instruct-2507"
    folder.mkdir()
    sizes = {"model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728,
             "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
             "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(sizes))
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "tokenizer.json").write_text("{}")
    return folder


def test_check_lists_every_problem_the_gpu_refusal_hid(tmp_path):
    """The OPSD preset on 3 GPUs, without its data and with an uncached model, checked on this
    machine: one command lists the batch that does not divide, each missing file, the
    teacher FSDP cannot run and the model; the missing GPUs are a note; nothing is written."""
    logs = tmp_path / "logs"
    res = _train(["experiment=text2sql_opsd_coder7b", "trainer.devices=3", "--check",
                  f"paths.data_dir={tmp_path / 'empty'}", f"paths.log_dir={logs}",
                  "model.name_or_path=nobody/Qwen2.5-Coder-7B-Instruct"], tmp_path)  # fmt: skip
    out = res.stdout
    assert res.returncode == 2, out + res.stderr
    assert "the check found" in res.stderr and "Traceback" not in res.stderr
    for expected in (
        "rl.global_prompts_per_step=64 does not divide over 3 ranks",
        "task.reference_solutions=",
        "task.splits.train.file=",
        "task.splits.train.db_dir=",
        "method=opsd needs a frozen teacher",
        "model.name_or_path=nobody/Qwen2.5-Coder-7B-Instruct is not in this machine's",
    ):
        assert expected in out, (expected, out)
    assert out.count("does not divide over 3") == 1  # said once, not per check
    if visible_gpus() < 3:  # this machine's lack of GPUs: a note, not a problem
        assert "notes:" in out and "the run asks for 3 per node" in out
    assert not logs.exists()  # the run folder Hydra made is gone


def test_check_of_a_preset_says_what_it_would_do(hir_data, qwen3_4b_folder, capsys):
    """experiment=ifeval_qwen3_4b on one node of 8 GPUs, with its data and model files: the
    batch per step and per rank, optimizer steps, tokens per step, the data read by the
    task's loader, and memory per GPU by docs/scaling.md's arithmetic (4.02B x 16 B = 64 GB
    of training state over 8 FSDP ranks, vLLM's 24 GB, ~10 + 10 GB of activations)."""
    cfg = compose_config("train.yaml", ["experiment=ifeval_qwen3_4b", "trainer.devices=8",
                                        f"paths.data_dir={hir_data}",
                                        f"model.name_or_path={qwen3_4b_folder}"])  # fmt: skip
    found = check_all(cfg)
    expected = [] if HAVE_VLLM else ["engine: rollout=vllm needs vLLM"]
    assert [p[: len(e)] for p, e in zip(found.problems, expected, strict=False)] == expected
    assert len(found.problems) == len(expected), found.problems
    assert found.ranks == 8 and found.train_prompts == len(HIR_ROWS)
    plan = "\n".join(plan_lines(cfg, found))
    for line in (
        "experiment=ifeval_qwen3_4b task=ifeval method=mrtpo",
        "gpu x 8 rank(s), FSDP2Strategy",
        "steps: 300 (trainer.max_steps)",
        "per step: 64 prompts x 8 samples = 512 responses (8 prompts, 64 responses per rank); "
        "2 optimizer step(s) (mini-batches of 256 responses, 32 per rank",
        "tokens per step: at most 512 x (2048 prompt + 4096 response) = 3,145,728",
        "data: 2 training prompts; 300 steps draw 19,200",
        "validation: 256 prompts every 25 steps",
        "(arithmetic of docs/scaling.md, not a measurement)",
        "training state 64.4 GB (16 B x 4.02B parameters, precision 32-true) / 8 ranks (FSDP)",
        "24.0 GB: vLLM engine 0.3 x 80 GB",
        "layer inputs 9.1 GB + logits 10.0 GB",
    ):
        assert line in plan, (line, plan)
    if not expected:
        dry_run(cfg)
        assert "no problem found" in capsys.readouterr().out


def test_memory_arithmetic_matches_docs_scaling_without_the_model_files(tmp_path):
    """Without config.json here, a paper model's sizes come from its published config: the
    7B preset on its 4 GPUs keeps 122 GB / 4 of training state, as docs/scaling.md says; LoRA
    r=16 keeps 15.2 GB + 40.4 M x 16 B. (No data given: the plan does not need it.)"""
    nodata = f"paths.data_dir={tmp_path}"
    cfg = compose_config("train.yaml", ["experiment=text2sql_coder7b", nodata])
    found = check_all(cfg)
    text = "\n".join(plan_lines(cfg, found))
    assert "training state 121.8 GB (16 B x 7.62B parameters" in text and "/ 4 ranks" in text
    lora = compose_config("train.yaml", ["experiment=text2sql_coder7b", "model.lora.r=16",
                                         "trainer=gpu", nodata])  # fmt: skip
    text = "\n".join(plan_lines(lora, check_all(lora)))
    assert "2 B x 7.62B frozen + 16 B x 40.4M adapters (LoRA r=16)" in text


def test_a_clean_check_exits_0_and_writes_nothing(tmp_path):
    logs, cache = tmp_path / "logs", tmp_path / "cache"
    res = _train(["--check", f"paths.log_dir={logs}", f"paths.cache_dir={cache}"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no problem found: the command without --check starts this run" in res.stdout
    assert "per step: 4 prompts x 4 samples = 16 responses" in res.stdout
    assert "memory per process (CPU trainer)" in res.stdout
    assert not logs.exists() and not cache.exists()  # no folder, no model built


def test_dry_run_is_a_key_and_refuses_like_the_check(tmp_path):
    cfg = compose_config("train.yaml", ["dry_run=true", "+metod=gdpo"])
    with pytest.raises(ConfigError, match="found 1 problem"):
        dry_run(cfg)


def test_values_left_open_are_listed_with_the_rest():
    cfg = compose_config("train.yaml", ["task=custom", "trainer.max_steps=0"])
    found = check_all(cfg)
    text = "\n".join(found.problems)
    assert "task.data.path, task.rewards must be given a value" in text
    assert "trainer.max_steps=0 is not allowed" in text
