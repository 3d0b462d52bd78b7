"""A run folder that someone else prepared: links planted in it, its lock file deleted under a
running trainer, a FIFO or a folder named ``run.lock``, a read-only mount (issue 37, cases
2, 4 and 16).

Everything is real: training on the tiny model, a second process holding the folder's lock,
a FIFO, a tmpfs mounted read-only in a mount namespace of its own.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import ROOT, SHARED_DATA, compose_config

from mrtpo.lightning.pipeline import train
from mrtpo.run.folder import LOCK_NAME, RunFolderLock
from mrtpo.run.resume import ResumeRefused

HANG_GUARD_S = 900  # a bound for a machine far slower than this one, not a speed check
USER_TEXT = b"the user's own notes\n"

RUN = (
    "print_config=false",
    "rl.prompts_per_step=2",
    "rl.group_size=2",
    "rollout.sampling.max_new_tokens=4",
    "callbacks.progress=null",
    "callbacks.export=null",
    "callbacks.model_checkpoint.every_n_train_steps=1",
    "callbacks.sample_table.every=1",  # so that the resumed step writes both record files
    "callbacks.sample_table.print_table=false",
    "callbacks.relevance_dump.every=1",
)


def _overrides(run: Path, cache_dir: Path, logs: Path) -> list[str]:
    return [
        *RUN,
        f"paths.output_dir={run}",
        f"paths.log_dir={logs}",
        f"paths.cache_dir={cache_dir}",
        f"paths.data_dir={SHARED_DATA}",
    ]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, cache_dir) -> Path:
    """A 2-step run with its checkpoint, samples and relevance records; copied per test."""
    run = tmp_path_factory.mktemp("finished") / "run"
    train(compose_config("train.yaml", [*_overrides(run, cache_dir, run.parent / "logs"),
                                        "trainer.max_steps=2"]))  # fmt: skip
    for name in ("samples.jsonl", "relevance.jsonl", "csv/metrics.csv", "checkpoints/last.ckpt"):
        assert (run / name).is_file(), name
    return run


@pytest.fixture
def root_handlers_left_as_found():
    """A resume adds a file handler for its run's log to the root logger: remove it."""
    before = list(logging.getLogger().handlers)
    yield
    root = logging.getLogger()
    for h in list(root.handlers):
        if h not in before:
            root.removeHandler(h)
            h.close()


def tree(folder: Path) -> dict[str, bytes | str]:
    """Every entry below ``folder`` without following links: a file's bytes, a link's target."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            key = str(p.relative_to(folder))
            if p.is_symlink():
                out[key] = "-> " + os.readlink(p)
            elif p.is_file():
                out[key] = p.read_bytes()
    return out


# ---- case 2: a link planted where the run writes ----------------------------------------

#: What a resume writes in its folder (a file, or a folder it writes into).
PLANTED = [
    LOCK_NAME,
    "train.log",
    ".hydra/history.yaml",
    ".hydra/resumes",
    "csv",
    "csv/metrics.csv",
    "samples.jsonl",
    "relevance.jsonl",
]


@pytest.mark.parametrize("name", PLANTED)
def test_a_link_planted_in_a_run_folder_is_never_written_through(
    name, finished_run, cache_dir, tmp_path, root_handlers_left_as_found
):
    """Each name a resume writes, made a link to a user's file (or folder): the resume is
    refused naming the link, before anything changes; the user's file is byte for byte as
    it was. (It was written into: run.lock's link left the file emptied, samples.jsonl and
    the logs appended to it, a linked csv/ got its metrics.csv replaced.)"""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_bytes(USER_TEXT)
    (user / "metrics.csv").write_bytes(b"step,mine\n0,1\n")
    target = user if name in (".hydra/resumes", "csv") else user / "notes.txt"
    planted = run / name
    if planted.is_dir():
        shutil.rmtree(planted)
    planted.unlink(missing_ok=True)
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.symlink_to(target)
    user_before, run_before = tree(user), tree(run)
    cfg = compose_config(
        "train.yaml",
        [*_overrides(run, cache_dir, tmp_path / "logs"), "trainer.max_steps=3", f"+resume={run}"],
    )
    with pytest.raises(ResumeRefused, match="symbolic link") as info:
        train(cfg)
    assert str(planted) in str(info.value)
    assert tree(user) == user_before
    assert tree(run) == run_before


def test_the_writers_themselves_refuse_a_link(tmp_path):
    """Past the check when a run starts, each writer opens without following a link: the
    metrics table, the appended history and logs, a replaced file, a folder made."""
    from mrtpo.run.loggers import KeepingWriter
    from mrtpo.safe_files import NoFollowFileHandler, UnsafePath, make_dirs, no_follow, write_atomic

    user = tmp_path / "notes.txt"
    user.write_bytes(USER_TEXT)
    run = tmp_path / "run"
    (run / "csv").mkdir(parents=True)
    (run / "csv" / "metrics.csv").symlink_to(user)
    writer = KeepingWriter(str(run / "csv"))
    writer.log_metrics({"loss": 1.0}, step=0)
    with pytest.raises(UnsafePath, match=r"metrics\.csv"):
        writer.save()
    for name in ("a.log", "b.yaml"):
        (run / name).symlink_to(user)
    with pytest.raises(UnsafePath, match=r"a\.log"):
        NoFollowFileHandler(run / "a.log")
    with pytest.raises(UnsafePath, match=r"a\.log"), open(run / "a.log", "a", opener=no_follow):
        pass
    with pytest.raises(UnsafePath, match=r"b\.yaml"):
        write_atomic(run / "b.yaml", "x: 1\n")
    (run / "d").symlink_to(tmp_path)
    with pytest.raises(UnsafePath, match="symbolic link"):
        make_dirs(run / "d" / "e", run)
    assert user.read_bytes() == USER_TEXT
    assert not (tmp_path / "e").exists()


# ---- case 4: the lock holds when run.lock is deleted ------------------------------------

HOLD = (
    "import sys, time\n"
    "from mrtpo.run.folder import RunFolderLock\n"
    "with RunFolderLock(sys.argv[1]):\n"
    "    print('held', flush=True)\n"
    "    time.sleep(600)\n"
)


def test_deleting_run_lock_does_not_let_a_second_run_in(tmp_path):
    """``rm run.lock`` under a running trainer let a resume in (two trainers, one folder):
    the lock is on the folder itself, so the second is refused, naming the first."""
    from mrtpo.run.folder import RunFolderBusy

    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        (run / LOCK_NAME).unlink()
        with (
            pytest.raises(RunFolderBusy, match="in use by another run") as info,
            RunFolderLock(run),
        ):
            pass
        if Path("/proc/locks").is_file():
            assert f"process {holder.pid} on this machine" in str(info.value)
        assert not (run / LOCK_NAME).exists()  # the refused one wrote nothing
    finally:
        holder.kill()
        holder.wait(timeout=60)
        holder.stdout.close()
    with RunFolderLock(run) as lock:  # the holder died: the folder is free
        assert lock.fd is not None
        lock.accept()


# ---- case 16: run.lock as a FIFO or a folder; a read-only run folder --------------------

TAKE = (
    "import sys\n"
    "from mrtpo.run.folder import RunFolderLock\n"
    "try:\n"
    "    with RunFolderLock(sys.argv[1]):\n"
    "        print('taken')\n"
    "except ValueError as exc:\n"
    "    print('refused:', exc)\n"
)


@pytest.mark.parametrize("kind", ["FIFO", "folder"])
def test_run_lock_as_a_fifo_or_a_folder_is_named(kind, tmp_path):
    """A FIFO or a folder named run.lock: one clear refusal naming it (raw OSErrors before),
    and never a wait on the FIFO (the lock is taken in a child with a time limit)."""
    run = tmp_path / "run"
    run.mkdir()
    lock = run / LOCK_NAME
    os.mkfifo(lock) if kind == "FIFO" else lock.mkdir()
    res = subprocess.run(
        [sys.executable, "-c", TAKE, str(run)],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0 and out.startswith("refused:"), out[-3000:]
    assert str(lock) in out and kind in out and "Traceback" not in out, out
    assert lock.is_fifo() if kind == "FIFO" else lock.is_dir()


def _can_mount(where: Path) -> str | None:
    """Why a tmpfs cannot be mounted in a mount namespace here; None when it can."""
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    probe = subprocess.run(
        ["unshare", "-m", "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    return None if probe.returncode == 0 else f"mount not permitted: {probe.stderr.strip()}"


def test_resume_of_a_run_on_a_read_only_mount_is_one_line(finished_run, cache_dir, tmp_path):
    """``+resume`` of a run folder on a read-only filesystem: one line saying so and what to
    do (a 27-line EROFS traceback before). The mount lives in a namespace of the command."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    why = _can_mount(mnt)
    if why:
        pytest.skip(why)
    run = mnt / "run"
    args = [
        *_overrides(run, cache_dir, tmp_path / "logs"),
        "trainer.max_steps=3",
        f"+resume={run}",
    ]
    script = (
        'mount -t tmpfs -o size=64m tmpfs "$1" && cp -a "$2" "$1/run" && '
        'mount -o remount,ro "$1" && shift 2 && exec "$@"'
    )
    train_py = [sys.executable, str(ROOT / "src" / "train.py"), *args]
    res = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", str(mnt), str(finished_run), *train_py],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        env={
            **os.environ,
            "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}",
            "HF_HUB_OFFLINE": "1",
        },
    )
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert len(errors) == 1 and "read-only" in errors[0] and "Copy it" in errors[0], errors
    assert not any(mnt.iterdir())  # the mount was the command's own: nothing left here
