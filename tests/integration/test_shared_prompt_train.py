"""rl.shared_prompt_forward in training: the update, old-policy and reference passes run each
prompt once and the step's numbers are those of the plain forwards (one process, two gloo DDP
ranks, gradient checkpointing, and two FSDP2 ranks where the forward packs each group)."""

from __future__ import annotations

import csv
import gc
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tests.conftest import ROOT
from tests.integration.test_ddp import _env

from mrtpo.core import forward


def _first_step(path) -> dict[str, float]:
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/iteration")]
    out = {}
    for k, v in rows[0].items():
        timed = k.startswith("train/time/") or k.endswith("_per_s")
        if k.startswith("train/") and not timed and v not in ("", "nan"):
            out[k] = float(v)
    return out


def _assert_same_numbers(a: dict[str, float], b: dict[str, float]) -> None:
    assert a.keys() == b.keys() and "train/loss" in a
    for k in a:
        assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6), (k, a[k], b[k])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_prompt_step_matches_plain_step(train_cfg, tmp_path, monkeypatch, checkpointing):
    """One step, shared against plain: the update's forwards (training mode) run the cache
    form, or the packed form under gradient checkpointing (HF drops the cache in checkpointed
    layers); the old-policy and reference passes (eval mode) the cache form; same numbers."""
    from mrtpo.lightning.pipeline import train

    calls = []
    for name in ("_shared_prompt_logits", "_packed_prompt_logits"):
        real = getattr(forward, name)

        def counted(model, groups, *args, _real=real, _name=name):
            calls.append((_name, model.training, len(groups.first), len(groups.row_prefix)))
            return _real(model, groups, *args)

        monkeypatch.setattr(forward, name, counted)
    update_form = "_packed_prompt_logits" if checkpointing else "_shared_prompt_logits"
    steps = {}
    for mode in ("always", "false"):
        out = tmp_path / mode
        # kl_coef > 0: the reference pass too; two epochs: the old-policy pass too
        cfg = train_cfg(
            "method=gdpo",
            f"model.gradient_checkpointing={str(checkpointing).lower()}",
            f"rl.shared_prompt_forward={mode}",
            "rl.kl_coef=0.05",
            "rl.ppo_epochs=2",
            "trainer.max_steps=1",
            f"paths.output_dir={out}",
        )
        train(cfg)
        steps[mode] = _first_step(out / "csv" / "metrics.csv")
        if mode == "always":
            updates = [c[0] for c in calls if c[1]]
            no_grad = [c[0] for c in calls if not c[1]]
            assert updates == [update_form] * 2, calls  # the two updates
            assert len(no_grad) >= 2 and set(no_grad) == {"_shared_prompt_logits"}, calls
            assert all(c[2] < c[3] for c in calls), calls  # fewer prompts than rows
            calls.clear()
    assert calls == []
    _assert_same_numbers(steps["always"], steps["false"])


@pytest.mark.slow
def test_shared_prompt_under_ddp_matches_plain(tmp_path, cache_dir):
    """Two gloo ranks: the shared forward keeps the ranks in step (one backward, one gradient
    all-reduce per micro-batch) and the first step's numbers are the plain run's."""
    steps = {}
    for mode in ("always", "false"):
        res = subprocess.run(
            [
                sys.executable,
                "src/train.py",
                "trainer=ddp",
                "task=synthetic",
                "method=gdpo",
                "trainer.max_steps=1",
                "rl.prompts_per_step=2",
                "rl.group_size=3",
                "rl.ppo_epochs=2",
                f"rl.shared_prompt_forward={mode}",
                "rollout.sampling.max_new_tokens=8",
                "callbacks.progress=null",
                f"paths.log_dir={tmp_path}/{mode}",
                f"paths.cache_dir={cache_dir}",
                "print_config=false",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=_env(),
            timeout=900,
        )
        assert res.returncode == 0, res.stderr[-4000:]
        (metrics,) = (tmp_path / mode).rglob("metrics.csv")
        steps[mode] = _first_step(metrics)
    _assert_same_numbers(steps["always"], steps["false"])


# ---- two ranks in-process: FSDP2 (each forward a collective) and DDP -------------------------

#: Each rank's shared-prompt mode in each pass: rank 0 shares while rank 1 runs plain (under
#: FSDP one forward call either way, so the ranks stay in step), then both share.
MODES = (("off", "off"), ("always", "off"), ("always", "always"))


def _init(rank: int, world: int, port: int) -> None:
    """A gloo group whose collectives give up after 5 min: ranks that fall out of step fail
    the test instead of hanging it (a collective here takes milliseconds)."""
    from datetime import timedelta

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )


def _small_model(world: int, sharded: bool) -> torch.nn.Module:
    """A random 2-layer Qwen2 (SDPA attention), the same on every rank; FSDP2 over ``world``
    ranks when ``sharded``."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mrtpo.lightning.sharding import shard_policy

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen2ForCausalLM(cfg).float()
    model.set_attn_implementation("sdpa")
    if sharded:
        shard_policy(model, init_device_mesh("cpu", (world,)))
    return model


class _Scored(torch.nn.Module):
    """The policy's log-probs as one module call: what DDP wraps (Lightning wraps the
    LightningModule, whose step calls the policy)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch, mode):
        from mrtpo.core.forward import response_logprobs

        return response_logprobs(self.model, *batch, temperature=0.8, shared_prompt=mode)


def _spawn_two(fn, args: tuple, limit_s: float = 900.0) -> None:
    """Two ranks of ``fn``; a rank that hangs (even in teardown, after the collectives' own
    5-minute limit) fails the test after ``limit_s`` instead of holding the suite. The pair
    takes under a minute here; the limit is sized for a loaded 2-core machine."""
    import torch.multiprocessing as mp

    ctx = mp.spawn(fn, args=args, nprocs=2, join=False)
    deadline = time.monotonic() + limit_s
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"two-rank {fn.__name__} still running after {limit_s:.0f} s")


def _two_rank_worker(rank: int, world: int, port: int, out: str, wrap: str) -> None:
    _init(rank, world, port)
    try:
        _two_rank_passes(rank, world, out, wrap)
        # The DDP wrapper and its reducer go with the helper's frame (and the collection
        # below), while the group still lives; both ranks then meet before it goes. A reducer
        # freed after destroy_process_group once hung here for good, in ~ProcessGroupGloo
        # joining gloo's worker thread (seen in a full run on the loaded machine).
        gc.collect()
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def _two_rank_passes(rank: int, world: int, out: str, wrap: str) -> None:
    from tests.unit.test_shared_prompt_forward import _batch

    from mrtpo.core.forward import prompt_groups

    model = _small_model(world, sharded=wrap == "fsdp")
    cfg = model.config
    scored = _Scored(model)
    if wrap == "ddp":
        scored = torch.nn.parallel.DistributedDataParallel(scored)
    model.train()
    batch = _batch(cfg.vocab_size, 0, seed=10 + rank)  # each rank its own rows
    groups = prompt_groups(model, *batch[:2], batch[2].shape[1], "always", packable=True)
    form = None if groups is None else "packed" if groups.packed else "cache"
    found = {"form": form, "passes": []}
    for modes in MODES:
        model.zero_grad(set_to_none=True)
        lp = scored(batch, modes[rank])
        weights = torch.linspace(-1.0, 2.0, lp.numel()).reshape(lp.shape)
        (lp * weights).sum().backward()
        grads = {
            n: p.grad.full_tensor() if wrap == "fsdp" else p.grad.clone()
            for n, p in model.named_parameters()
        }
        found["passes"].append({"logp": lp.detach(), "grads": grads})
    torch.save(found, Path(out) / f"rank{rank}.pt")


@pytest.mark.parametrize("wrap", ["fsdp", "ddp"])
def test_shared_prompt_on_two_ranks_matches_plain(tmp_path, wrap):
    """Two gloo ranks, each with its own rows: log-probs and the reduced gradients equal the
    plain forward's, also when one rank shares and the other does not. Under FSDP the cache
    form is off and each group is packed (a data-dependent choice may not change the
    collectives); under DDP forwards are local and the cache form runs."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _spawn_two(_two_rank_worker, (2, port, str(tmp_path), wrap))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert [r["form"] for r in ranks] == 2 * ["packed" if wrap == "fsdp" else "cache"]
    for r in ranks:
        plain = r["passes"][0]
        assert plain["logp"].abs().sum() > 0
        for other in r["passes"][1:]:
            torch.testing.assert_close(other["logp"], plain["logp"], rtol=1e-5, atol=1e-5)
            for name, g in plain["grads"].items():
                atol = 1e-6 * max(1.0, float(g.abs().max()))
                torch.testing.assert_close(other["grads"][name], g, rtol=1e-5, atol=atol)
    # the reduced gradients are the ranks' mean: the same on both ranks
    for name, g in ranks[0]["passes"][1]["grads"].items():
        torch.testing.assert_close(ranks[1]["passes"][1]["grads"][name], g, rtol=0, atol=0)


def _hf_worker(rank: int, world: int, port: int, out: str) -> None:
    _init(rank, world, port)
    try:
        from types import SimpleNamespace

        from mrtpo.rollout.base import SamplingConfig
        from mrtpo.rollout.hf import HFEngine

        model = _small_model(world, sharded=True)
        calls: list[int] = []
        real = forward.prompt_prefix_cache

        def counted(m, groups, *args):
            calls.append(len(groups.first))
            return real(m, groups, *args)

        forward.prompt_prefix_cache = counted
        g = torch.Generator().manual_seed(rank)
        # one generate call per prompt (batch_size = n = 3). Rank 0 has two prompts, so its
        # first call is an idle one; rank 1's second prompt is one token (nothing to share).
        lengths = (30, 22) if rank == 0 else (25, 1, 28)
        prompts = [torch.randint(5, 96, (k,), generator=g).tolist() for k in lengths]
        found = {}
        for mode in ("off", "always"):
            engine = HFEngine(batch_size=3, share_prompt=mode)
            engine.bind(model, SimpleNamespace(pad_token_id=0), [1])
            gens = engine.generate(prompts, 3, SamplingConfig(temperature=0.7, max_new_tokens=6), 5)
            found[mode] = {
                "tokens": [x.token_ids for x in gens],
                "logprobs": [x.logprobs for x in gens],
                "calls": list(calls),
            }
            calls.clear()
        torch.save(found, Path(out) / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_hf_shared_prefill_under_fsdp_is_agreed_by_the_ranks(tmp_path):
    """Under FSDP the HF engine's prefix call is a collective: a generate call shares only
    when every rank's does (an idle call never does), and samples what the plain prefill
    samples. Rank 0's calls: idle, then its two prompts; rank 1's: a prompt, a one-token
    prompt, a prompt. Only the third call of each rank shares."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _spawn_two(_hf_worker, (2, port, str(tmp_path)))
    for r in (0, 1):
        found = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        plain, shared = found["off"], found["always"]
        assert plain["calls"] == [] and shared["calls"] == [1]  # one prefix for 3 rows
        assert shared["tokens"] == plain["tokens"]
        for a, b in zip(shared["logprobs"], plain["logprobs"], strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)
