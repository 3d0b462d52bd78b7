"""``rollout=vllm_server`` against real ``vllm serve`` processes (the CPU build) on 127.0.0.1.

One server, started by the engine on the last core of this machine, is shared by the tests
of this module (a start takes about a minute here); the test that kills it runs last. The
three tests at the end run ``src/train.py`` or a script in a process of their own, each with
its own server: a 5-step run of the command docs/rollout.md shows, a server killed mid-run,
and a trainer killed with SIGKILL (its server must not outlive it)."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import lightning as L
import pytest
import torch
from tests.conftest import ROOT
from tests.vllm.conftest import TINY_SHAPE, hf_logprobs, perturbed_copy
from tests.vllm.test_train_vllm import GAP, NOISE, fit_with_engine, gaps

from mrtpo.core.models import TinyModelConfig, build_tiny_model, eos_token_ids, load_policy
from mrtpo.lightning.pipeline import metrics_csv
from mrtpo.rollout.base import SamplingConfig
from mrtpo.rollout.server_process import PROOF_PATH, group_members, proof
from mrtpo.rollout.snapshots import write_snapshot
from mrtpo.rollout.vllm_serve import guard_every_route
from mrtpo.rollout.vllm_server import VLLMServerEngine, VLLMServerError

SERVER_CPU = max(os.sched_getaffinity(0))  # the server's core; the trainer has the others
RUN_LIMIT_S = 1800  # hang guards for a slow, busy machine, not speed claims


@pytest.fixture(scope="module")
def server(tiny32, tmp_path_factory):
    """One started server for the module, bound to the tiny model (head_dim 32)."""
    path, model, tok = tiny32
    log = tmp_path_factory.mktemp("server") / "server.log"
    eng = VLLMServerEngine(str(path), cpus=[SERVER_CPU], log_file=str(log), seed=0)
    eng.bind(model, tok, eos_token_ids(tok, model))
    yield eng
    eng.close()


def _prompt(tok) -> list[int]:
    msgs = [{"role": "user", "content": "Write four words."}]
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False))


def test_the_started_server_is_a_pinned_process_group_on_loopback(server):
    pid = server.process.pid
    assert server.url.startswith("http://127.0.0.1:")
    assert os.getpgid(pid) == pid  # a group of its own, which stop() ends as a whole
    members = group_members(pid)
    assert len(members) >= 2  # the API server and vLLM's engine core at least
    assert all(os.sched_getaffinity(m) == {SERVER_CPU} for m in members)


def test_the_started_server_asks_its_fresh_key_on_every_route(server):
    """Issue 47, item 2: a started server gets a key of its own (no VLLM_API_KEY is set
    here), every route asks for it, /health included, and it proves that it holds it. The key
    is in no command line (world-readable) and not in the server's log."""
    key, url = server._key, server.url
    assert key and os.environ.get("VLLM_API_KEY") in (None, key)
    for path in ("/health", "/collective_rpc", "/update_weights", "/server_info", "/v1/models"):
        assert _status(url, path) == 401, path
    assert _status(url, "/health", "not-the-key") == 401
    assert _status(url, "/health", key) == 200
    nonce = "n0nce-of-the-test-" * 2
    with urllib.request.urlopen(f"{url}{PROOF_PATH}?nonce={nonce}", timeout=60) as r:
        # bound to the address the request reached (the URL's numeric host and port)
        assert json.loads(r.read())["proofs"] == [proof(key, nonce, url.split("//", 1)[1])]
    for pid in group_members(server.process.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert key.encode() not in f.read()
    assert key not in server.process.log_path.read_text(errors="replace")


def test_the_launcher_guards_every_route_for_a_key_in_any_spelling(monkeypatch):
    """Issue 47, item 4: ``--api-key=KEY`` (one word) and ``--api_key KEY`` guard the RL and
    development routes too. vLLM's own parser and middleware set-up, no server."""
    import vllm.entrypoints.serve.middleware.authenticate as auth
    from fastapi import FastAPI
    from starlette.testclient import TestClient
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setattr(auth, "GUARDED_PREFIX", auth.GUARDED_PREFIX)  # restored afterwards
    monkeypatch.setattr(auth, "AuthenticationMiddleware", auth.AuthenticationMiddleware)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    for spelling in (["--api-key=k1"], ["--api_key", "k1"]):
        argv = ["--model", "m", *spelling]
        monkeypatch.setattr(sys, "argv", ["vllm_serve", *argv])
        guard_every_route()
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        app = FastAPI()
        app.post("/collective_rpc")(lambda: {"called": True})
        init_entrypoints_middleware(args, app, ())
        client = TestClient(app)
        assert client.post("/collective_rpc").status_code == 401, spelling
        assert client.get("/health").status_code == 401, spelling
        ok = client.post("/collective_rpc", headers={"Authorization": "Bearer k1"})
        assert ok.status_code == 200, spelling
        nonce = "x" * 32
        want = {"proofs": [proof("k1", nonce, "testserver:80")]}  # TestClient's address
        assert client.get(f"{PROOF_PATH}?nonce={nonce}").json() == want


def test_a_push_reaches_the_server_and_each_sample_carries_its_version(server, tiny32):
    _, model, tok = tiny32
    new = perturbed_copy(model, seed=3)
    before = server.weight_version
    server.sync_weights(new)
    assert server.weight_version == before + 1
    assert server.last_sync.num_tensors == len(new.state_dict())  # lm_head.weight included
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=10)
    prompt = _prompt(tok)
    gens = server.generate([prompt, prompt[1:]], 3, sampling, seed=5)
    assert len(gens) == 6 and all(g.weight_version == before + 1 for g in gens)
    for i, g in enumerate(gens):
        lp = hf_logprobs(new, prompt if i < 3 else prompt[1:], g.token_ids, 0.7)
        assert (lp - torch.tensor(g.logprobs)).abs().max().item() <= NOISE
    again = server.generate([prompt, prompt[1:]], 3, sampling, seed=5)
    assert [g.token_ids for g in again] == [g.token_ids for g in gens]  # seeded


def test_a_push_without_the_tied_head_fails_naming_it(server, tiny32):
    _, model, _ = tiny32
    folder = server._pushes / "headless"
    folder.mkdir()
    weights = [(k, v) for k, v in model.state_dict().items() if k != "lm_head.weight"]
    name = write_snapshot(folder, 0, weights)
    before = server.weight_version
    rel = str((folder / name).relative_to(server._root))
    with pytest.raises(VLLMServerError, match=r"no weights for \['lm_head'\]"):
        server._post_push(server.client, [rel], before + 1)
    server.sync_weights(model)  # the server takes the next push
    assert server.weight_version == before + 1


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(["method=mrtpo", "method.beta_warmup_steps=0", "optim.lr=1e-3"], id="mrtpo"),
        pytest.param(["model.lora.r=4", "optim.lr=1e-2", "method=gdpo"], id="lora"),
    ],
)
def test_three_training_steps_keep_the_gap_at_fp32_noise(train_cfg, server, extra):
    cfg = train_cfg(
        "rollout=vllm_server",
        "model=tiny_wide",
        "trainer.max_steps=3",
        "rollout.sampling.temperature=0.7",
        *extra,
    )
    before = server.weight_version
    trainer, module, _ = fit_with_engine(cfg, server)
    g = gaps(trainer)
    assert module.iteration == 3 and len(g) == 3
    assert max(g) <= NOISE, g
    assert server.weight_version == before + 4  # bind's push, then one per step


STALENESS = "train/rollout/staleness/max"
STALE_GAP = "train/rollout/stale/logp_gap/max"


def _rows(trainer) -> list[dict[str, str]]:
    with open(metrics_csv(trainer)) as f:
        return [r for r in csv.DictReader(f) if r.get("train/iteration")]


ONE_STEP_OFF = (
    "rollout=vllm_server",
    "model=tiny_wide",
    "task=synthetic",
    "method=mrtpo",
    "method.beta_warmup_steps=0",
    "optim.lr=1e-3",
    "rollout.sampling.temperature=0.7",
    "rollout.schedule=one_step_off",
    "logger=csv",
)


def test_one_step_off_samples_one_version_behind_the_trainer(train_cfg, server):
    cfg = train_cfg(*ONE_STEP_OFF, "trainer.max_steps=4")
    trainer, module, _ = fit_with_engine(cfg, server)
    rows = _rows(trainer)
    assert module.iteration == 4
    assert [float(r[STALENESS]) for r in rows] == [0.0, 1.0, 1.0, 1.0]
    # step 0 was sampled by the pushed weights of step 0: numerics only
    assert float(rows[0][GAP]) <= NOISE
    # later batches were sampled one update behind: logged apart, and larger than noise
    stale = [float(r[STALE_GAP]) for r in rows[1:]]
    assert len(stale) == 3 and all(g > NOISE for g in stale), stale
    assert all(float(r["train/rollout/dropped"]) == 0.0 for r in rows)


def test_a_resumed_one_step_off_run_equals_an_uninterrupted_one(train_cfg, server, tmp_path):
    every = "callbacks.model_checkpoint.every_n_train_steps=1"
    full, _, _ = fit_with_engine(
        train_cfg(*ONE_STEP_OFF, every, "trainer.max_steps=4", f"paths.output_dir={tmp_path}/a"),
        server,
    )
    fit_with_engine(
        train_cfg(*ONE_STEP_OFF, every, "trainer.max_steps=2", f"paths.output_dir={tmp_path}/b"),
        server,
    )
    ckpt = tmp_path / "b" / "checkpoints" / "step000002.ckpt"
    resumed, _, cb = fit_with_engine(
        train_cfg(*ONE_STEP_OFF, every, "trainer.max_steps=4", f"paths.output_dir={tmp_path}/c"),
        server,
        ckpt_path=str(ckpt),
    )
    assert cb.resyncs == 1
    want, got = _rows(full)[2:], _rows(resumed)
    assert [r["train/iteration"] for r in got] == ["3.0", "4.0"]
    keys = ("train/reward/total/mean", "train/loss", STALENESS, STALE_GAP, "train/adv/abs_mean")
    for w, g in zip(want, got, strict=True):
        for k in keys:
            assert float(g[k]) == pytest.approx(float(w[k]), rel=1e-6, abs=1e-6), k


def test_sync_on_the_server_gives_the_in_process_engines_numbers(
    train_cfg, server, engine, tmp_path
):
    """Same seeds, same pushed weights, same sampling: the two engines draw the same tokens,
    so a sync run logs the same step metrics with either (1e-6)."""
    common = (*ONE_STEP_OFF[:-2], "logger=csv", "trainer.max_steps=3")  # sync
    ran = {}
    for name, eng in (("server", server), ("in_process", engine)):
        cfg = train_cfg(*common, f"paths.output_dir={tmp_path}/{name}")
        trainer, _, _ = fit_with_engine(cfg, eng)
        ran[name] = _rows(trainer)
    keys = (
        "train/reward/total/mean",
        "train/loss",
        "train/adv/abs_mean",
        "train/response_len/mean",
    )
    assert len(ran["server"]) == len(ran["in_process"]) == 3
    for a, b in zip(ran["server"], ran["in_process"], strict=True):
        for k in keys:
            assert float(a[k]) == pytest.approx(float(b[k]), rel=1e-6, abs=1e-6), k


def _by_url(server, model: str, monkeypatch) -> VLLMServerEngine:
    """An engine that reaches the module's server by its URL and its key."""
    monkeypatch.setenv("MRTPO_TEST_KEY", server._key)
    return VLLMServerEngine(
        model, url=server.url, weight_dir=str(server._root), api_key_env="MRTPO_TEST_KEY"
    )


def test_a_server_of_another_model_is_refused_naming_both(server, cache_dir, monkeypatch):
    other = TinyModelConfig(**TINY_SHAPE, num_hidden_layers=3)
    path = build_tiny_model(cache_dir / "models" / "tiny-3-layers", other)
    model, tok = load_policy(str(path), tiny=None)
    eng = _by_url(server, str(path), monkeypatch)
    with pytest.raises(VLLMServerError) as err:
        eng.bind(model, tok, eos_token_ids(tok, model))
    text = str(err.value)
    assert server.model in text and str(path) in text and "num_hidden_layers" in text
    assert eng.weight_version == 0  # nothing was pushed


def test_a_server_with_another_tokenizer_is_refused(server, tiny32, cache_dir, monkeypatch):
    _, model, _ = tiny32
    corpus = ["Write three words about rivers, then stop. " * 50]
    other = TinyModelConfig(**TINY_SHAPE, extra_corpus=corpus)
    _, tok = load_policy(str(build_tiny_model(cache_dir / "models" / "tiny-tok", other)), tiny=None)
    eng = _by_url(server, server.model, monkeypatch)
    with pytest.raises(VLLMServerError, match="tokenizer does not match the policy's"):
        eng.bind(model, tok, eos_token_ids(tok, model))


class _KillServer(L.Callback):
    """SIGKILLs the server's process group at the end of step ``step``, before the rollout
    callback pushes that step's weights."""

    def __init__(self, engine: VLLMServerEngine, step: int) -> None:
        self.engine, self.step = engine, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.killpg(self.engine.process.pid, signal.SIGKILL)


def test_a_server_gone_during_a_push_stops_the_run_and_keeps_the_checkpoint(
    train_cfg, server, tmp_path
):
    """Runs last: it kills the module's server."""
    from mrtpo.lightning.callbacks.rollout import RolloutCallback
    from mrtpo.lightning.pipeline import build
    from mrtpo.run.resume import read_checkpoint

    cfg = train_cfg(
        "rollout=vllm_server",
        "model=tiny_wide",
        "trainer.max_steps=4",
        "method=gdpo",
        "callbacks.model_checkpoint.every_n_train_steps=1",
    )
    trainer, module, dm = build(cfg)
    [cb] = [c for c in trainer.callbacks if isinstance(c, RolloutCallback)]
    cb.engine = server
    trainer.callbacks.insert(0, _KillServer(server, step=2))
    pid = server.process.pid
    with pytest.raises(VLLMServerError) as err:
        trainer.fit(module, datamodule=dm)
    text = str(err.value)
    assert "was killed by SIGKILL during the weight push" in text and "\n" not in text
    assert group_members(pid) == [] and not server.process.alive()
    ckpt = read_checkpoint(tmp_path / "checkpoints" / "last.ckpt")  # checksum verified
    assert ckpt["global_step"] == 1  # the last step whose push went through


# ---- each in a process of its own, with its own server ------------------------------------


def _train_cmd(tmp_path, cache_dir, *more: str) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "src" / "train.py"),
        "rollout=vllm_server",
        "model=tiny_wide",
        "task=synthetic",
        "method=mrtpo",
        *more,
        f"rollout.engine.cpus=[{SERVER_CPU}]",
        f"paths.cache_dir={cache_dir}",
        f"hydra.run.dir={tmp_path}/run",
    ]


def _server_pid(log_path) -> int | None:
    try:
        m = re.search(r"\(APIServer pid=(\d+)\)", log_path.read_text(errors="replace"))
    except OSError:
        return None
    return int(m.group(1)) if m else None


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def test_the_documented_command_trains_five_steps_and_leaves_no_server(tmp_path, cache_dir):
    more = ("rollout.schedule=one_step_off", "trainer.max_steps=5")
    cmd = _train_cmd(tmp_path, cache_dir, *more)
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=RUN_LIMIT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "run"
    with open(run / "csv" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/iteration")]
    assert [float(r[STALENESS]) for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert float(rows[0][GAP]) <= NOISE
    pid = _server_pid(run / "vllm_server.log")
    assert pid is not None and group_members(pid) == []


def _wait_for(predicate, proc, what: str, limit_s: float = RUN_LIMIT_S):
    deadline = time.monotonic() + limit_s
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"the process ended before {what} (status {proc.returncode})")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {what} within {limit_s} s")
        time.sleep(1.0)


@pytest.mark.parametrize("schedule", ["sync", "one_step_off"])
def test_a_server_killed_mid_run_ends_the_run_with_one_line(tmp_path, cache_dir, schedule):
    cmd = _train_cmd(
        tmp_path, cache_dir, "trainer.max_steps=100000", f"rollout.schedule={schedule}"
    )
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=o, stderr=e)
    log = tmp_path / "run" / "vllm_server.log"
    try:

        def training() -> bool:  # bind's push and at least one step's
            return log.is_file() and log.read_text(errors="replace").count("/update_weights") >= 2

        _wait_for(training, proc, "two weight pushes")
        pid = _server_pid(log)
        os.killpg(pid, signal.SIGKILL)
        proc.wait(timeout=600)  # never a hang
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.read_text()
    assert proc.returncode != 0
    assert "Traceback" not in text, text[-3000:]
    [line] = [s for s in text.splitlines() if "vLLM server" in s]
    assert f"(pid {pid}," in line and "was killed by SIGKILL during" in line, text[-3000:]
    assert group_members(pid) == []


KEEP_A_SERVER = """
import sys, time
from mrtpo.core.models import eos_token_ids, load_policy
from mrtpo.rollout.vllm_server import VLLMServerEngine
model, tok = load_policy(sys.argv[1], tiny=None)
eng = VLLMServerEngine(sys.argv[1], cpus=[int(sys.argv[2])], log_file=sys.argv[3],
                       sync_on_bind=False)
eng.bind(model, tok, eos_token_ids(tok, model))
print(eng.url, eng.process.pid, flush=True)
time.sleep(3600)
"""


def _status(url: str, path: str, key: str | None = None) -> int:
    req = urllib.request.Request(url + path, data=b"{}" if path != "/health" else None)
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_trainer_killed_with_sigkill_takes_its_server_along(tiny32, tmp_path):
    """The server also asks for its API key on every route (vLLM alone guards only /v1...)."""
    path, _, _ = tiny32
    env = {**_env(), "VLLM_API_KEY": "test-key"}
    cmd = [sys.executable, "-c", KEEP_A_SERVER, str(path), str(SERVER_CPU), str(tmp_path / "log")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        url, pid = proc.stdout.readline().split()
        pid = int(pid)
        assert _status(url, "/health") == 401 and _status(url, "/collective_rpc") == 401
        assert _status(url, "/health", "test-key") == 200
        proc.kill()  # SIGKILL: no atexit, no finally in the trainer
        proc.wait(timeout=60)
        deadline = time.monotonic() + 120
        while group_members(pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert group_members(pid) == []
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("schedule", ["sync", "one_step_off"])
def test_two_fsdp_ranks_share_one_server(tmp_path, cache_dir, schedule):
    """Rank 0 starts the server and pushes the gathered weights; rank 1 waits for each push
    (both gather the shards bucket by bucket) and samples its own prompts from it, under
    one_step_off from each rank's worker thread while the ranks train."""
    cmd = _train_cmd(tmp_path, cache_dir, "trainer=fsdp", "trainer.devices=2",
                     "trainer.accelerator=cpu", "trainer.max_steps=2", "rl.prompts_per_step=2",
                     "rl.group_size=2", "rollout.sampling.max_new_tokens=8",
                     "rollout.sampling.temperature=0.7", "method=gdpo", "optim.lr=1e-3",
                     "callbacks.progress=null", f"rollout.schedule={schedule}")  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=RUN_LIMIT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "run"
    with open(run / "csv" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/iteration")]
    g = [float(r[GAP]) for r in rows if r.get(GAP) not in (None, "", "nan")]
    fresh = 2 if schedule == "sync" else 1  # one_step_off: the first step only
    assert len(g) == fresh and max(g) <= NOISE, g
    if schedule == "one_step_off":
        assert [float(r[STALENESS]) for r in rows] == [0.0, 1.0]
    text = (run / "vllm_server.log").read_text(errors="replace")
    assert text.count("POST /update_weights") == 3  # bind's push and one per step, once
    pid = _server_pid(run / "vllm_server.log")
    assert pid is not None and group_members(pid) == []
