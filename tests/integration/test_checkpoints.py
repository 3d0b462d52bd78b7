"""Checkpoints on the tiny model with real Lightning: atomic writes, checksums, finite state,
retention. Each damage below loads silently or fails with torch's own messages without
``SafeCheckpointIO``."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import pytest
import torch

from mrtpo.lightning.pipeline import build
from mrtpo.run.checkpointing import (
    CheckpointError,
    NonFiniteStateError,
    assert_finite_state,
    atomic_save,
    checksum_path,
    load_checkpoint,
    read_checksum,
)

EVERY_STEP = (
    "callbacks.model_checkpoint.every_n_train_steps=1",
    "callbacks.sample_table=null",
    "callbacks.relevance_dump=null",
    "method=gdpo",
)


def _fit(cfg, *callbacks: L.Callback):
    trainer, module, dm = build(cfg)
    trainer.callbacks.extend(callbacks)
    trainer.fit(module, datamodule=dm, ckpt_path=cfg.get("ckpt_path"))
    return trainer, module


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


class AtStep(L.Callback):
    """Run ``fn`` when the batch of RL step ``step`` (0-based) starts, i.e. after every
    checkpoint of the earlier steps is on disk."""

    def __init__(self, step: int, fn) -> None:
        self.step, self.fn = step, fn

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            self.fn(pl_module)


# ---- writing ------------------------------------------------------------------------------


def test_checkpoints_are_checksummed_and_only_last_plus_n_are_kept(train_cfg, tmp_path):
    out = tmp_path / "run"
    cfg = train_cfg(
        *EVERY_STEP,
        f"paths.output_dir={out}",
        "trainer.max_steps=5",
        "callbacks.model_checkpoint.save_top_k=2",
    )
    _fit(cfg)
    ck = out / "checkpoints"
    assert _listing(ck) == [
        "last.ckpt",
        "last.ckpt.sha256",
        "step000004.ckpt",
        "step000004.ckpt.sha256",
        "step000005.ckpt",
        "step000005.ckpt.sha256",
    ]
    for name in ("last.ckpt", "step000004.ckpt", "step000005.ckpt"):
        digest, size = read_checksum(ck / name)
        assert digest == _sha(ck / name) and size == (ck / name).stat().st_size
    # the sidecar is in sha256sum's format
    if shutil.which("sha256sum"):
        res = subprocess.run(["sha256sum", "-c", "last.ckpt.sha256"], cwd=ck, capture_output=True)
        assert res.returncode == 0, res.stderr
    assert load_checkpoint(ck / "last.ckpt", weights_only=True)["global_step"] == 5
    assert oct((ck / "last.ckpt").stat().st_mode & 0o777) != "0o600"  # umask, not mkstemp's

    # Resuming in the same folder overwrites last.ckpt in place (no last-v1.ckpt) and keeps
    # pruning to last + 2.
    _fit(
        train_cfg(
            *EVERY_STEP,
            f"paths.output_dir={out}",
            "trainer.max_steps=7",
            "callbacks.model_checkpoint.save_top_k=2",
            f"ckpt_path={ck / 'last.ckpt'}",
        )
    )
    names = [n for n in _listing(ck) if n.endswith(".ckpt")]
    assert names == ["last.ckpt", "step000006.ckpt", "step000007.ckpt"]
    assert load_checkpoint(ck / "last.ckpt")["global_step"] == 7


@contextmanager
def read_only(folder: Path):
    """Make ``folder`` refuse new entries for real: chmod for a normal user; root ignores
    permissions, so there the immutable attribute (chattr +i) is used."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        undo = lambda: folder.chmod(0o755)  # noqa: E731
    else:
        if not shutil.which("chattr") or subprocess.run(["chattr", "+i", str(folder)]).returncode:
            pytest.skip("running as root without chattr +i: no way to make a folder read-only")
        undo = lambda: subprocess.run(["chattr", "-i", str(folder)], check=True)  # noqa: E731
    try:
        try:
            (folder / "probe").touch()
        except OSError:
            pass
        else:
            (folder / "probe").unlink()
            pytest.skip(f"{folder} is still writable after making it read-only")
        yield
    finally:
        undo()


def _failing_save(after_bytes: int):
    real = torch.save

    def save(obj, f, *args, **kwargs):
        class DiskFull:
            written = 0

            def write(self, data):
                n = len(memoryview(data))
                if self.written + n > after_bytes:
                    raise OSError(errno.ENOSPC, "No space left on device")
                self.written += n
                return f.write(data)

            def flush(self):
                f.flush()

        return real(obj, DiskFull(), *args, **kwargs)

    return save


@pytest.mark.parametrize("fault", ["disk_full", "read_only"])
def test_a_failed_save_leaves_the_previous_checkpoints_intact(train_cfg, tmp_path, fault):
    out = tmp_path / "run"
    ck = out / "checkpoints"
    state: dict = {}

    def arm(_module):
        # Everything step 2 saved is on disk now; remember it, then break the next save.
        state["before"] = {p.name: _sha(p) for p in ck.iterdir()}
        if fault == "disk_full":
            state["undo"] = pytest.MonkeyPatch()
            state["undo"].setattr(torch, "save", _failing_save(after_bytes=200_000))
        else:
            state["ro"] = read_only(ck)
            state["ro"].__enter__()

    cfg = train_cfg(*EVERY_STEP, f"paths.output_dir={out}", "trainer.max_steps=3")
    try:
        with pytest.raises(OSError) as info:
            _fit(cfg, AtStep(2, arm))
    finally:
        if "undo" in state:
            state["undo"].undo()
        if "ro" in state:
            state["ro"].__exit__(None, None, None)
    msg = str(info.value)
    assert "step000003.ckpt" in msg and "nothing was written" in msg, msg
    # no partial or temporary file, every earlier file byte for byte as it was
    assert {p.name: _sha(p) for p in ck.iterdir()} == state["before"]
    assert load_checkpoint(ck / "last.ckpt")["global_step"] == 2


def test_a_failed_overwrite_of_last_keeps_the_old_last(tmp_path, tiny):
    """The write that fails is the one replacing an existing last.ckpt."""
    model, _ = tiny
    path = tmp_path / "last.ckpt"
    atomic_save({"state_dict": model.state_dict(), "global_step": 1}, path)
    before, side = _sha(path), checksum_path(path).read_text()
    mp = pytest.MonkeyPatch()
    mp.setattr(torch, "save", _failing_save(after_bytes=100_000))
    try:
        with pytest.raises(OSError, match="nothing was written"):
            atomic_save({"state_dict": model.state_dict(), "global_step": 2}, path)
    finally:
        mp.undo()
    assert _listing(tmp_path) == ["last.ckpt", "last.ckpt.sha256"]
    assert _sha(path) == before and checksum_path(path).read_text() == side
    assert load_checkpoint(path)["global_step"] == 1


# ---- reading ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cache_dir) -> Path:
    """Checkpoints of a finished 2-step run: last.ckpt, step000001.ckpt, step000002.ckpt."""
    from tests.conftest import compose_config

    out = tmp_path_factory.mktemp("finished")
    cfg = compose_config(
        "train.yaml",
        [
            f"paths.output_dir={out}",
            f"paths.log_dir={out}/logs",
            f"paths.cache_dir={cache_dir}",
            "print_config=false",
            "trainer.max_steps=2",
            "rl.prompts_per_step=2",
            "rl.group_size=2",
            "rollout.sampling.max_new_tokens=8",
            "callbacks.progress=null",
            *EVERY_STEP,
        ],
    )
    _fit(cfg)
    return out / "checkpoints"


def _copy(finished: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "checkpoints"
    shutil.copytree(finished, dst)
    return dst


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "random_middle":  # 2,000 random bytes into the middle of the file
        mid = len(data) // 2
        data[mid : mid + 2000] = random.Random(0).randbytes(2000)
    elif how == "truncated":
        data = data[: len(data) // 3]
    elif how == "empty":
        data = bytearray()
    elif how == "header":
        data[:64] = b"\x00" * 64
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("how", "sidecar"),
    [(h, True) for h in ("random_middle", "truncated", "empty", "header")]
    # a checkpoint without its sidecar (written by another tool): the zip records' CRC-32s
    + [(h, False) for h in ("random_middle", "truncated", "empty", "header")],
)
def test_damage_is_detected_and_names_the_file_and_an_alternative(finished, tmp_path, how, sidecar):
    ck = _copy(finished, tmp_path)
    last = ck / "last.ckpt"
    _damage(last, how)
    if not sidecar:
        checksum_path(last).unlink()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(last)
    msg = str(info.value)
    assert str(last) in msg and "step000002.ckpt" in msg and "ckpt_path=" in msg, msg
    for internal in ("miniz", "PytorchStreamReader", "weights_only", "EOFError", "Unpickling"):
        assert internal not in msg, msg
    expected = {
        "random_middle": "changed or damaged after it was written" if sidecar else "CRC-32",
        "truncated": "is truncated" if sidecar else "zip structure cannot be read",
        "empty": "empty (0 bytes)",
        "header": "changed or damaged" if sidecar else "CRC-32",
    }[how]
    assert expected in msg, msg


def test_lightning_resume_from_a_damaged_checkpoint_fails_clearly(finished, tmp_path, train_cfg):
    ck = _copy(finished, tmp_path)
    _damage(ck / "last.ckpt", "random_middle")
    cfg = train_cfg(
        *EVERY_STEP,
        f"paths.output_dir={tmp_path}/resumed",
        "trainer.max_steps=3",
        f"ckpt_path={ck / 'last.ckpt'}",
    )
    with pytest.raises(CheckpointError, match=r"last\.ckpt was changed or damaged"):
        _fit(cfg)


def test_no_alternative_is_said_too(finished, tmp_path):
    ck = tmp_path / "alone"
    ck.mkdir()
    shutil.copy(finished / "last.ckpt", ck / "last.ckpt")  # no sidecar, no sibling
    _damage(ck / "last.ckpt", "truncated")
    with pytest.raises(CheckpointError, match="no other checkpoint"):
        load_checkpoint(ck / "last.ckpt")


# ---- non-finite state -------------------------------------------------------------------------


def test_non_finite_state_is_never_written_and_refused_at_load(finished, tmp_path):
    ck = _copy(finished, tmp_path)
    good = load_checkpoint(ck / "step000002.ckpt")
    # the damage of the issue: NaN in the optimizer's second moments
    bad = dict(good)
    opt = bad["optimizer_states"][0]
    idx = sorted(opt["state"])[3]
    opt["state"][idx]["exp_avg_sq"] = opt["state"][idx]["exp_avg_sq"].clone().fill_(float("nan"))
    with pytest.raises(
        NonFiniteStateError, match=rf"optimizer_states\[0\]\.state\.{idx}\.exp_avg_sq"
    ):
        atomic_save(bad, ck / "last.ckpt")
    assert load_checkpoint(ck / "last.ckpt")["global_step"] == 2  # untouched

    # written by something else (plain torch.save, no sidecar): refused when loaded
    torch.save(bad, ck / "last.ckpt")
    checksum_path(ck / "last.ckpt").unlink()
    with pytest.raises(CheckpointError, match=r"non-finite values: optimizer_states") as info:
        load_checkpoint(ck / "last.ckpt")
    assert "step000002.ckpt" in str(info.value)

    weights = dict(good)
    sd = dict(weights["state_dict"])
    name = next(k for k in sd if k.endswith("weight"))
    sd[name] = sd[name].clone()
    sd[name].view(-1)[0] = float("inf")
    weights["state_dict"] = sd
    with pytest.raises(NonFiniteStateError, match=re.escape(name)):
        atomic_save(weights, ck / "step000003.ckpt")
    assert not (ck / "step000003.ckpt").exists()
    assert not [p for p in ck.iterdir() if p.name.startswith(".")]


def test_a_run_whose_weights_go_nan_does_not_overwrite_last(train_cfg, tmp_path):
    out = tmp_path / "run"
    ck = out / "checkpoints"

    def poison(module):
        with torch.no_grad():
            next(module.policy.parameters()).view(-1)[0] = float("nan")

    cfg = train_cfg(*EVERY_STEP, f"paths.output_dir={out}", "trainer.max_steps=3")
    with pytest.raises(NonFiniteStateError, match="refusing to write checkpoint"):
        _fit(cfg, AtStep(2, poison))
    assert load_checkpoint(ck / "last.ckpt")["global_step"] == 2
    assert not (ck / "step000003.ckpt").exists()


def test_assert_finite_state_names_the_first_bad_tensor(tiny):
    model, _ = tiny
    model = type(model)(model.config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.tensor([[1, 2, 3]])
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert_finite_state(model, opt)  # a healthy step passes
    name, p = list(model.named_parameters())[5]
    opt.state[p]["exp_avg_sq"].view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteStateError, match=f"exp_avg_sq of {re.escape(name)}"):
        assert_finite_state(model, opt)
    opt.state[p]["exp_avg_sq"].view(-1)[0] = 0.0
    with torch.no_grad():
        p.view(-1)[1] = float("-inf")
    with pytest.raises(NonFiniteStateError, match=rf"parameter {re.escape(name)} \(0 NaN, 1 inf"):
        assert_finite_state(model, opt)


# ---- temporaries of killed writers (issue 25 item 17) ---------------------------------------


def _killed_writer(target: Path) -> None:
    """A real process killed with SIGKILL in the middle of ``atomic_save(..., target)``."""
    script = (
        "import time, torch\n"
        "from mrtpo.run.checkpointing import atomic_save\n"
        "def stuck(obj, f, *a, **k):\n"
        "    f.write(b'x' * 65536); f.flush(); print('writing', flush=True); time.sleep(600)\n"
        "torch.save = stuck\n"
        f"atomic_save({{'state_dict': {{}}}}, {str(target)!r})\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=target.parent
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stdout.close()


def test_a_save_killed_midway_leaves_a_temporary_the_next_start_removes(train_cfg, tmp_path):
    from mrtpo.lightning.pipeline import train

    out = tmp_path / "run"
    train(train_cfg(*EVERY_STEP, f"paths.output_dir={out}"))
    ck = out / "checkpoints"
    _killed_writer(ck / "last.ckpt")
    (temp,) = ck.glob(".*.tmp")
    assert temp.name.startswith(".last.ckpt.") and temp.stat().st_size >= 65536
    assert load_checkpoint(ck / "last.ckpt")["global_step"] == 2  # the old one, intact
    train(
        train_cfg(*EVERY_STEP, f"paths.output_dir={out}", f"+resume={out}", "trainer.max_steps=3")
    )
    assert list(ck.glob(".*.tmp")) == []
    assert load_checkpoint(ck / "last.ckpt")["global_step"] == 3


def test_only_temporaries_of_dead_writers_are_removed_without_the_lock(tmp_path):
    from mrtpo.run.checkpointing import remove_stale_temporaries

    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = int(done.stdout)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        names = {
            "dead": f".last.ckpt.{dead}.ab12cd34.tmp",
            "dead_sidecar": f".last.ckpt.sha256.{dead}.zz99yy88.tmp",
            "live": f".step000002.ckpt.{live.pid}.ab12cd34.tmp",
            "no_pid": ".last.ckpt.ab12cd34.tmp",
            "other": ".notes.txt.123.tmp",
        }
        for n in names.values():
            (tmp_path / n).write_bytes(b"x")
        removed = remove_stale_temporaries(tmp_path)
        assert sorted(p.name for p in removed) == sorted([names["dead"], names["dead_sidecar"]])
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [names["live"], names["no_pid"], names["other"]]
        )
        # holding the run folder's lock, every temporary of a checkpoint is stale
        remove_stale_temporaries(tmp_path, all_stale=True)
        assert sorted(p.name for p in tmp_path.iterdir()) == [names["other"]]
    finally:
        live.kill()
        live.wait()
