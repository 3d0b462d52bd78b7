"""Progress with the time left (issue 41, item 1): each step's line says step N of M, the
rewards, seconds per step and the ETA, in plain text when stdout is no terminal (a log file);
on a pseudo-terminal a live bar runs under the lines; SFT shows its total and its held-out
checks."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
from tests.conftest import ROOT

from mrtpo.lightning.callbacks.console import duration
from mrtpo.lightning.pipeline import build

PROGRESS = "callbacks.progress={_target_:mrtpo.lightning.callbacks.console.StepLine}"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_durations_read_as_waits():
    assert [duration(s) for s in (0, 44.6, 245, 3720)] == ["0s", "45s", "4m05s", "1h02m"]


def test_plain_lines_without_a_terminal(train_cfg, capsys):
    trainer, module, dm = build(train_cfg(PROGRESS, "trainer.max_steps=3"))
    trainer.fit(module, datamodule=dm)
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out  # no colours, no redrawn lines
    lines = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in lines] == ["1/3", "2/3", "3/3"]
    for ln in lines:
        assert re.search(r"reward \d\.\d{3}  success \d\.\d{3}", ln), ln
        assert re.search(r"\d+\.\d\d s/step  eta \d+s$", ln), ln
    assert lines[-1].endswith("eta 0s")


def test_sft_shows_its_total_and_its_checks(train_cfg, capsys):
    cfg = train_cfg(
        PROGRESS, "stage=sft", "trainer.max_steps=4", "stage.sft.eval_every=2",
        "stage.sft.min_steps=2", "stage.sft.eval_prompts=2", "stage.sft.target_success=1.0",
        "stage.sft.batch_size=2",
    )  # fmt: skip
    trainer, module, dm = build(cfg)
    trainer.fit(module, datamodule=dm)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert lines[0].startswith("step 1/4  loss ")
    assert "held-out success: first check at step 2, stops at ≥ 1" in lines[0]
    assert re.search(r"held-out success \d\.\d{3} \(step 2, stops at ≥ 1\)", lines[2]), lines
    assert re.search(r"eta ≤\d+s$", lines[-1])  # an upper bound: the target may stop it


def _on_a_terminal(args, timeout=900) -> tuple[int, str]:
    """Run src/train.py on a pseudo-terminal of 120 columns; its exit status and output."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TERM": "xterm-256color"}
    proc = subprocess.Popen([sys.executable, "src/train.py", *args], cwd=ROOT, env=env,
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True)  # fmt: skip
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=60), out.decode("utf-8", "replace")
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


@pytest.mark.skipif(not hasattr(pty, "openpty"), reason="no pseudo-terminals here")
def test_a_live_bar_on_a_terminal(tmp_path):
    rc, out = _on_a_terminal([f"paths.log_dir={tmp_path}/logs", f"paths.cache_dir={tmp_path}/c",
                              "trainer.max_steps=4"])  # fmt: skip
    assert rc == 0, out[-3000:]
    assert "Traceback" not in out
    plain = ANSI.sub("", out)
    bars = re.findall(r"rl ━[━╸╺ ]* (\d)/4 \d+\.\d\d s/step eta \d+s reward ", plain)
    assert bars and bars[-1] == "4", plain[-3000:]  # the bar reached the end
    assert "\x1b[2K" in out  # redrawn in place
    for i in range(1, 5):  # and the step lines stay above it
        assert f"step {i}/4  reward " in plain
    assert "means over blocks of 5 steps" in plain  # the summary after the bar
