"""The paper presets (configs/experiment/ but the toy ones, which have their own tests in
test_replication.py and test_sft.py).

Each composes the GPU trainer its model needs (the memory arithmetic of docs/scaling.md), and
its batch is global: divided over the ranks, so one node of 8 GPUs is ``trainer.devices=8``.
Trainers that cannot work are refused before anything loads. And each runs one RL step end to
end: the preset as written, with only the model swapped to ``tiny``, the engine to ``hf``, the
trainer explicitly back to one CPU process and the sizes shrunk (2 prompts, 2 samples, 4 new
tokens). Nothing here needs ../shared: text-to-SQL and tool calling train on
tests/task_fixtures.py's data, instruction following on two HIR-16K rows written here (a
paper preset never trains on other data: issue 40 item 1)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pandas as pd
import pytest
from tests.conftest import CONFIG_DIR, compose_config
from tests.task_fixtures import make_public_data, rlla_rows

from mrtpo.lightning.pipeline import build, metrics_csv, prepare
from mrtpo.run.placement import check_placement, model_parameters
from mrtpo.run.settings import ConfigError, resolve_batch, section

TOY = ("demo", "toy_")
PRESETS = sorted(
    p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml") if not p.stem.startswith(TOY)
)
SMALL = [
    "model=tiny",
    "rollout=hf",
    "trainer=cpu",  # the presets compose GPU trainers: back to one CPU process, explicitly
    "trainer.devices=1",
    "trainer.max_steps=1",
    "rl.global_prompts_per_step=2",
    "rl.group_size=2",
    "rollout.sampling.max_new_tokens=4",
    "callbacks.progress=null",
    "data.val_prompts=0",
]


#: Two prompts in IFEval's format (the instruction presets validate on IFEval), checked by
#: the real IFEval checkers.
IFEVAL_ROWS = [
    {
        "key": 1,
        "prompt": "Describe a cat. Do not use any commas.",
        "instruction_id_list": ["punctuation:no_comma"],
        "kwargs": [{}],
    },
    {
        "key": 2,
        "prompt": "Describe a dog in lowercase letters only.",
        "instruction_id_list": ["change_case:english_lowercase"],
        "kwargs": [{}],
    },
]
#: Two HIR-16K rows as released (HIR_trainv1.jsonl), of the subsets the presets train on.
HIR_ROWS = [
    {
        "id": 1,
        "source": "type1",
        "prompt": "Write a note to a friend.",
        "criteria": ["Do not use any commas."],
        "ground_truth": {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]},
    },
    {
        "id": 2,
        "source": "type1",
        "prompt": "Describe a harbour.",
        "criteria": ["Write in lowercase letters only."],
        "ground_truth": {
            "instruction_id_list": ["change_case:english_lowercase"],
            "kwargs": [{}],
        },
    },
]
#: Validation on, shrunk: two held-out prompts after the one step.
VALIDATE = ["data.val_prompts=2", "data.val_batch_size=2", "trainer.val_check_interval=1"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """The task fixtures laid out as ``paths.data_dir``, plus ToolRL's RL training file under
    the name the tool-calling presets read (``toolrl_rlla/rlla_4k/train.parquet``), HIR-16K
    where the instruction presets read it (``HIR-16K/HIR_trainv1.jsonl``) and an
    IFEval-format file for their validation."""
    root = make_public_data(tmp_path_factory.mktemp("preset_data"))
    folder = root / "toolrl_rlla" / "rlla_4k"
    folder.mkdir(parents=True)
    pd.DataFrame(rlla_rows()).to_parquet(folder / "train.parquet")
    (root / "ifeval").mkdir()
    (root / "ifeval" / "input_data.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in IFEVAL_ROWS)
    )
    (root / "HIR-16K").mkdir()
    (root / "HIR-16K" / "HIR_trainv1.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in HIR_ROWS)
    )
    return root


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_runs_one_step(preset, train_cfg, data_dir, tmp_path):
    task = preset.split("_", 1)[0]
    # every preset trains on its paper data's stand-ins: the fixtures, two HIR-16K rows
    base = f"paths.data_dir={data_dir}"
    cfg = train_cfg(f"experiment={preset}", *SMALL, *VALIDATE, base)
    # the swaps took, and the rest is the preset's own (its optimizer, mini-batch, task)
    assert cfg.model.name_or_path.endswith("tiny-qwen2") and cfg.rollout.engine._target_.endswith(
        "HFEngine"
    )
    assert cfg.optim.lr == 1.0e-6 and cfg.rl.global_mini_batch_size in (256, 512)
    assert cfg.hydra.runtime.choices.task == task
    trainer, module, dm = build(cfg)
    try:
        trainer.fit(module, datamodule=dm)
    finally:
        close = getattr(module.task, "close", None)
        if callable(close):
            close()
    assert trainer.global_step == 1 and module.iteration == 1
    if task == "ifeval":  # HIR-16K's rows, not the generated set
        assert module.task.hir_counts and len(dm.train_examples) == len(HIR_ROWS)
    with open(metrics_csv(trainer)) as f:
        rows = list(csv.DictReader(f))
    train = [r for r in rows if r.get("train/iteration")]
    assert len(train) == 1
    names = module.task.reward_names
    values = [train[0].get(f"train/reward/{k}/mean") for k in names]
    assert any(v not in (None, "") and not math.isnan(float(v)) for v in values), train[0]
    # the held-out curve: the preset's validation split was scored after the step
    held_out = {k: v for r in rows for k, v in r.items() if k.startswith("val/") and v != ""}
    assert held_out, sorted(rows[-1])
    assert (tmp_path / "policy" / "config.json").is_file()  # the end-of-run export


#: GPU memory the arithmetic of docs/scaling.md budgets per 80 GB GPU besides training state:
#: vLLM's share (0.3 x 80 GB) and ~10 GB for activations, CUDA context and fragmentation.
GPU_GB, OTHER_GB = 80, 0.3 * 80 + 10


def _paper(preset: str, *overrides: str):
    return compose_config("train.yaml", [f"experiment={preset}", *overrides])


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_composes_a_gpu_trainer_its_model_fits(preset):
    cfg = _paper(preset)
    t = cfg.trainer
    fsdp = str(t.get("strategy", {}).get("_target_", "")).endswith("FSDP2Strategy")
    assert t.accelerator == "gpu" and cfg.rollout.engine._target_.endswith("VLLMEngine")
    # bf16 compute over fp32 master weights: Lightning's bf16-mixed, or FSDP's own policy
    if fsdp:
        assert t.precision == "32-true" and t.strategy.master_dtype == "fp32"
    else:
        assert t.precision == "bf16-mixed"
    # training state (16 B per parameter, sharded under FSDP) + the rest fits one GPU
    params = model_parameters(cfg.model)
    per_gpu = 16 * params / 1e9 / (t.devices if fsdp else 1)
    assert per_gpu + OTHER_GB <= GPU_GB, (preset, per_gpu)
    # and without FSDP it would not fit whenever the preset chose FSDP
    assert fsdp == (16 * params / 1e9 + OTHER_GB > GPU_GB), preset


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_batch_is_global_over_one_node_of_eight(preset):
    cfg = _paper(preset, "trainer.devices=8")
    ranks = check_placement(cfg, gpus=8)
    mine = resolve_batch(cfg, ranks)
    assert ranks == 8
    assert mine.prompts_per_step * 8 == cfg.rl.global_prompts_per_step
    assert mine.mini_batch_size * 8 == cfg.rl.global_mini_batch_size
    # what the run reads (section) is the same share; the config keeps what was given,
    # which is what its checkpoints record and a resume compares
    assert section(cfg, "rl") == mine and cfg.rl.prompts_per_step is None


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_validates_on_held_out_prompts(preset):
    """Each paper preset logs a held-out curve (val/<task>/*) several times per run, on a
    split it does not train on (issue 29 item 9: they held out none)."""
    cfg = _paper(preset)
    data, every, steps = section(cfg, "data"), cfg.trainer.val_check_interval, cfg.trainer.max_steps
    assert data.val_prompts > 0 and data.val_batch_size <= data.val_prompts
    assert isinstance(every, int) and every >= 1 and steps // every >= 4, (every, steps)
    task = cfg.task
    if "val_split" in task:  # text-to-SQL (Spider dev) and instructions (IFEval)
        assert task.val_split not in ("train", "val", "generated", "hir")
    else:  # tool calling: its own held-out file
        assert task.data_files.val and task.data_files.val != task.data_files.train


def test_preset_on_a_machine_without_the_gpus_is_refused_before_anything_loads():
    cfg = _paper("text2sql_coder7b")
    with pytest.raises(ConfigError, match=r"experiment=text2sql_coder7b trains on 4 GPU.*no CUDA"):
        check_placement(cfg, gpus=0)
    with pytest.raises(ConfigError, match=r"lower trainer\.devices to 2"):
        check_placement(cfg, gpus=2)
    assert check_placement(cfg, gpus=4) == 4


def test_large_model_on_the_cpu_trainer_needs_an_explicit_override():
    cfg = _paper("text2sql_coder7b", "trainer=cpu", "trainer.devices=1")
    with pytest.raises(ConfigError, match=r"about 7\.0B parameters.*\+allow_cpu=true"):
        check_placement(cfg, gpus=0)
    cfg = _paper("text2sql_coder7b", "trainer=cpu", "trainer.devices=1", "+allow_cpu=true")
    assert check_placement(cfg, gpus=0) == 1
    # the swap the one-step test makes: the tiny model is no reason to refuse
    assert check_placement(_paper("text2sql_coder7b", *SMALL), gpus=0) == 1


def test_global_batch_that_does_not_divide_is_refused_naming_the_keys():
    cfg = _paper("text2sql_coder7b", "trainer.devices=3")
    with pytest.raises(ConfigError, match=r"rl.global_prompts_per_step=64 does not divide over 3"):
        resolve_batch(cfg, check_placement(cfg, gpus=3))
    # an old command line's per-rank batch that agrees with the global one is accepted
    cfg = _paper("text2sql_coder7b", "trainer.devices=8", "rl.prompts_per_step=8")
    assert resolve_batch(cfg, check_placement(cfg, gpus=8)).prompts_per_step == 8
    cfg = _paper("text2sql_coder7b", "trainer.devices=8", "rl.prompts_per_step=4")
    with pytest.raises(ConfigError, match=r"rl.prompts_per_step=4 \(per rank\) disagrees"):
        resolve_batch(cfg, check_placement(cfg, gpus=8))


@pytest.mark.parametrize(
    ("preset", "extra", "refusal"),
    [
        # LoRA's adapter merges would meet sharded tensors
        ("text2sql_coder7b", ["model.lora.r=16"], r"model.lora.r > 0 with trainer=fsdp"),
        # OPSD's frozen teacher is not sharded in lockstep (its preset says what runs today)
        ("text2sql_opsd_coder7b", [], r"method=opsd needs a frozen teacher"),
    ],
)
def test_preset_combinations_fsdp_cannot_run_are_refused_before_the_model_loads(
    preset, extra, refusal, data_dir, tmp_path
):
    # the preset's FSDP trainer on 2 CPU processes (gloo): the same refusal, no GPU needed
    cfg = _paper(
        preset,
        *extra,
        "model=tiny",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        f"paths.data_dir={data_dir}",
        f"paths.output_dir={tmp_path}",
        "model.name_or_path=/nonexistent/model",  # proves nothing was loaded
        "model.tiny=null",
    )
    with pytest.raises(ValueError, match=refusal):
        prepare(cfg)


# ---- issue 40 item 1: a paper preset trains on the paper's data or is refused ---------------


def test_every_paper_preset_declares_its_data():
    for preset in PRESETS:
        declared = _paper(preset).get("paper_data")
        assert declared, f"{preset} declares no paper_data"
        train = {"ifeval": "task.data.path", "text2sql": "task.splits.train.file",
                 "toolcall": "task.data_files.train"}[preset.split("_", 1)[0]]  # fmt: skip
        assert train in declared, (preset, list(declared))


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_without_its_data_is_refused_before_anything_loads(preset, tmp_path):
    """``paths.data_dir`` without the paper's files: refused naming the key and the path,
    with the model set to one that does not exist (nothing was loaded)."""
    cfg = _paper(preset, *SMALL, f"paths.data_dir={tmp_path / 'empty'}",
                 f"paths.output_dir={tmp_path}", "model.name_or_path=/nonexistent/model",
                 "model.tiny=null")  # fmt: skip
    with pytest.raises(ConfigError) as info:
        prepare(cfg)
    text = str(info.value)
    assert f"experiment={preset} trains on the paper's data" in text
    assert f"{tmp_path / 'empty'}" in text and "no such file" in text and "\n" not in text


def test_instruction_preset_never_falls_back_to_the_generated_set(data_dir, tmp_path):
    cfg = _paper("ifeval_qwen3_4b", *SMALL, f"paths.data_dir={data_dir}", "task.data.path=null")
    with pytest.raises(ConfigError, match=r"task\.data\.path is not set: it must name HIR-16K"):
        prepare(cfg)


def test_preset_data_in_another_layout_is_refused(data_dir):
    """rlla_sft.json (ToolRL's SFT layout, task=toolcall's default) is not the RL set the
    paper trains on; a Spider dev file is not HIR-16K."""
    sft = data_dir / "toolrl_rlla" / "rlla_sft.json"
    cfg = _paper("toolcall_qwen25_3b", *SMALL, f"paths.data_dir={data_dir}",
                 f"task.data_files.train={sft}")  # fmt: skip
    with pytest.raises(ConfigError, match=r"not in the paper's layout: its first row has "
                       r"\['input', 'instruction', 'output'\], not \{prompt, reward_model\}"):  # fmt: skip
        prepare(cfg)
    dev = data_dir / "spider" / "dev.json"
    cfg = _paper("ifeval_qwen25_7b", *SMALL, f"paths.data_dir={data_dir}", f"task.data.path={dev}")
    with pytest.raises(ConfigError, match=r"task\.data\.path=.*dev\.json is not in the paper"):
        prepare(cfg)


def test_spider_questions_from_the_hub_need_no_local_question_file(tmp_path):
    """``task.splits.train.hub`` (opt-in, with network) supplies Spider's questions: the
    train file is then not required, the databases still are."""
    from mrtpo.run.checks import paper_data_problems as problems

    cfg = _paper("text2sql_coder3b", f"paths.data_dir={tmp_path}",
                 "+task.splits.train.hub=xlangai/spider")  # fmt: skip
    found = problems(cfg)
    assert not any("splits.train.file" in p for p in found)
    assert any("splits.train.db_dir" in p and "no such folder" in p for p in found)
