"""LoRA on the tiny model: only adapters train, checkpoints hold only them, the KL reference is
the base model (adapters off), resume restores them, and the CLI run leaves a merged export."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from tests.conftest import ROOT

from mrtpo.core.lora import LoraSettings, apply_lora, is_lora
from mrtpo.core.models import load_policy
from mrtpo.lightning.pipeline import build
from mrtpo.run.checkpointing import load_checkpoint
from mrtpo.run.resume import validate_resume

LORA = ["model.lora.r=4", "optim.lr=0.02", "optim.weight_decay=0.0"]


def _fit(cfg, ckpt_path=None):
    trainer, module, dm = build(cfg)
    start = {k: v.detach().clone() for k, v in module.policy.state_dict().items()}
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return trainer, module, start


def _ids(tok, text="Write a short reply. Start with the word apple."):
    return tok(text, return_tensors="pt")["input_ids"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, cache_dir):
    """Two MRTPO steps with LoRA and a KL term (so the reference path runs)."""
    from tests.conftest import SHARED_DATA, compose_config

    out = tmp_path_factory.mktemp("lora_run")
    cfg = compose_config(
        "train.yaml",
        [
            f"paths.output_dir={out}",
            f"paths.log_dir={out}/logs",
            f"paths.cache_dir={cache_dir}",
            f"paths.data_dir={SHARED_DATA}",
            "trainer.max_steps=2",
            "rl.prompts_per_step=2",
            "rl.group_size=4",
            "rollout.sampling.max_new_tokens=8",
            "callbacks.progress=null",
            "rl.kl_coef=0.1",
            *LORA,
        ],
    )
    trainer, module, start = _fit(cfg)
    return cfg, out, trainer, module, start


def test_only_adapters_train_and_base_weights_stay_bit_identical(lora_run):
    _, _, trainer, module, start = lora_run
    assert trainer.global_step == 2 and is_lora(module.policy)
    assert module.ref_policy is None  # no second copy of the model for the KL term
    after = module.policy.state_dict()
    adapters = [k for k in after if ".lora_" in k]
    base = [k for k in after if ".lora_" not in k]
    assert adapters and base
    for k in base:
        assert torch.equal(after[k], start[k]), f"base weight {k} changed"
    changed = [k for k in adapters if not torch.equal(after[k], start[k])]
    # lora_B starts at zero: every adapter pair moved
    assert {k for k in adapters if ".lora_B." in k} <= set(changed)
    trainable = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert trainable == {k for k in adapters}
    # the optimizer holds state for the adapters only
    opt = trainer.optimizers[0]
    n_state = sum(1 for g in opt.param_groups for p in g["params"] if opt.state.get(p))
    assert n_state == len(trainable)


def test_checkpoint_holds_adapter_tensors_only(lora_run):
    _, out, _, module, _ = lora_run
    ckpt = load_checkpoint(out / "checkpoints" / "last.ckpt", weights_only=True)
    keys = set(ckpt["state_dict"])
    expected = {"policy." + n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert keys == expected
    for k in keys:
        assert torch.equal(ckpt["state_dict"][k], module.policy.state_dict()[k[len("policy.") :]])
    n_base = sum(p.numel() for p in module.policy.parameters() if not p.requires_grad)
    n_ckpt = sum(v.numel() for v in ckpt["state_dict"].values())
    assert n_ckpt < n_base / 10
    # optimizer moments for the adapters only
    states = ckpt["optimizer_states"][0]["state"]
    assert len(states) == len(keys)


def test_kl_reference_is_the_base_model(lora_run, cache_dir):
    """The reference's logits (adapters off) equal the untouched base model's, read from
    disk; the adapted policy's differ (the adapters moved)."""
    from transformers import AutoModelForCausalLM

    _, _, _, module, _ = lora_run
    policy, tok = module.policy, module.tokenizer
    base = AutoModelForCausalLM.from_pretrained(cache_dir / "models" / "tiny-qwen2").eval()
    ids = _ids(tok)
    policy.eval()
    try:
        with torch.no_grad():
            with policy.disable_adapter():
                ref = policy(input_ids=ids).logits
            adapted = policy(input_ids=ids).logits
            expected = base(input_ids=ids).logits
    finally:
        policy.train()
    assert torch.equal(ref, expected)
    assert not torch.allclose(adapted, expected, atol=1e-4)
    # and the module's own reference path gives the base model's log-probs of a rollout
    roll = module.last.rollout
    from mrtpo.core.forward import response_logprobs

    with torch.no_grad():
        want = response_logprobs(
            base, roll.prompt_ids, roll.prompt_mask, roll.response_ids, roll.response_mask
        )
    got = module.step.passes.reference(roll, micro=2)
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    assert module.last.ref_logp is not None


def test_resume_restores_the_adapters(lora_run):
    cfg, out, _, module, _ = lora_run
    ckpt_path = out / "checkpoints" / "last.ckpt"
    trainer, fresh, dm = build(cfg)
    ckpt = load_checkpoint(ckpt_path, weights_only=True)
    validate_resume(ckpt, fresh, ckpt_path)  # adapter-only state is what this run expects
    before = {k: v.clone() for k, v in fresh.policy.state_dict().items() if ".lora_B." in k}
    assert all(float(v.abs().max()) == 0.0 for v in before.values())  # fresh adapters
    trainer.fit(fresh, datamodule=dm, ckpt_path=str(ckpt_path))  # max_steps reached: no step
    assert fresh.iteration == module.iteration == 2
    want, got = module.policy.state_dict(), fresh.policy.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_a_full_finetune_checkpoint_is_refused_by_a_lora_run(train_cfg, tmp_path):
    _fit(train_cfg("trainer.max_steps=1"))
    ckpt_path = tmp_path / "checkpoints" / "last.ckpt"
    ckpt = load_checkpoint(ckpt_path, weights_only=True)
    _, lora_module, _ = build(train_cfg("trainer.max_steps=1", *LORA))
    from mrtpo.run.resume import ResumeRefused

    with pytest.raises(ResumeRefused, match=r"model"):
        validate_resume(ckpt, lora_module, ckpt_path)
    with pytest.raises(RuntimeError, match=r"model.lora"):
        lora_module.load_state_dict(ckpt["state_dict"])


def test_target_modules_that_match_nothing_fail_naming_the_key(tiny):
    model, _ = load_policy(tiny[0].name_or_path)
    with pytest.raises(ValueError, match=r"model.lora.target_modules") as err:
        apply_lora(model, LoraSettings(r=4, target_modules=["q_proj", "qkv_proj"]))
    msg = str(err.value)
    assert "qkv_proj" in msg and "q_proj" in msg and "down_proj" in msg
    with pytest.raises(ValueError, match=r"model.lora.r"):
        LoraSettings.from_mapping({"r": -1})
    with pytest.raises(ValueError, match=r"model.lora.dropout"):
        LoraSettings.from_mapping({"r": 4, "dropout": 1.5, "target_modules": ["q_proj"]})
    with pytest.raises(ValueError, match=r"model.lora has no key"):
        LoraSettings.from_mapping({"rank": 4})


def test_a_given_model_is_made_ready_as_a_loaded_one(tiny):
    """The Python API's given model goes through the same preparation as a loaded one
    (``prepare_policy``): a pad token, left padding, checkpointing, adapters, train mode, and
    embeddings whose output requires grad, without which reentrant checkpointing would give
    the adapters no gradient."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mrtpo.trainer import _prepare

    path, lora = tiny[0].name_or_path, {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    cfg = OmegaConf.create({"model": {"gradient_checkpointing": True, "lora": lora}})
    tok = AutoTokenizer.from_pretrained(path)
    tok.pad_token = None
    given, tok = _prepare(AutoModelForCausalLM.from_pretrained(path), tok, cfg)
    loaded, _ = load_policy(path, gradient_checkpointing=True, lora=lora)
    for model in (given, loaded):
        assert is_lora(model) and model.training and model.is_gradient_checkpointing
        assert model.get_input_embeddings()(torch.tensor([[1, 2]])).requires_grad
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    # and a given tokenizer that can never end a response is refused, as a loaded one is
    model = AutoModelForCausalLM.from_pretrained(path)
    model.generation_config.eos_token_id = None
    tok = AutoTokenizer.from_pretrained(path)
    tok.eos_token = None
    with pytest.raises(ValueError, match=f"the tokenizer of {path} has no EOS token"):
        _prepare(model, tok, OmegaConf.create({"model": {"name_or_path": path}}))


def test_the_cli_command_trains_lora_and_exports_the_checkpointed_policy(tmp_path, cache_dir):
    """The issue's command as written (plus paths): ``<run>/policy/`` holds the merged
    weights of the policy in ``<run>/checkpoints/last.ckpt``."""
    from safetensors.torch import load_file

    from mrtpo.evaluate.export import merged_state_dict
    from mrtpo.run.trained_run import load_checkpoint_weights

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "src/train.py",
        "task=synthetic",
        "method=mrtpo",
        "model.lora.r=4",
        "trainer.max_steps=2",
        f"paths.log_dir={tmp_path}/logs",
        f"paths.cache_dir={cache_dir}",
        "optim.lr=0.02",
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = list((tmp_path / "logs" / "train" / "runs").iterdir())
    policy_dir, ckpt = run / "policy", run / "checkpoints" / "last.ckpt"
    assert (policy_dir / "config.json").is_file() and ckpt.is_file()
    exported = load_file(policy_dir / "model.safetensors")
    assert not any("lora" in k or "base_layer" in k for k in exported)
    model, _ = load_policy(
        str(cache_dir / "models" / "tiny-qwen2"),
        lora={"r": 4, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                       "gate_proj", "up_proj", "down_proj"]},
    )  # fmt: skip
    assert load_checkpoint_weights(model, str(ckpt)) == 2
    want = merged_state_dict(model)
    for k, v in exported.items():
        assert torch.equal(v, want[k]), k
    assert set(want) - set(exported) <= {"lm_head.weight"}  # tied to the embedding
    base = load_file(Path(cache_dir) / "models" / "tiny-qwen2" / "model.safetensors")
    assert not torch.equal(exported["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])  # fmt: skip


@pytest.mark.slow  # two gloo processes: ~30 s on 2 CPU cores
def test_lora_under_ddp_keeps_ranks_equal_and_checkpoints_adapters_only(tmp_path, cache_dir):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for key in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"):
        env.pop(key, None)  # Lightning launches the ranks itself
    cmd = [
        sys.executable,
        "src/train.py",
        "trainer=ddp",
        "model.lora.r=4",
        "rl.kl_coef=0.1",
        "trainer.max_steps=2",
        "rl.prompts_per_step=2",
        "rl.group_size=4",
        "rollout.sampling.max_new_tokens=8",
        "callbacks.progress=null",
        f"paths.log_dir={tmp_path}/logs",
        f"paths.cache_dir={cache_dir}",
        *LORA[1:],
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    (run,) = list((tmp_path / "logs" / "train" / "runs").iterdir())
    ckpt = load_checkpoint(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 2
    assert ckpt["state_dict"] and all(".lora_" in k for k in ckpt["state_dict"])
    assert any(float(v.abs().max()) > 0 for k, v in ckpt["state_dict"].items() if "lora_B" in k)
    assert (run / "policy" / "model.safetensors").is_file()
