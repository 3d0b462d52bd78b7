"""The README's Quickstart (issue 50, item 5): its Python snippet, read from the README
itself, runs as written (the tiny model, CPU) and leaves its run where the section says, its
trained policy in memory; the section stays short and names the commands it promises."""

from __future__ import annotations

import re

import torch
from tests.conftest import ROOT

README = ROOT / "README.md"


def quickstart() -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index("\n## Quickstart\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def test_quickstart_is_short_and_names_its_commands():
    section = quickstart()
    assert len(section.strip().splitlines()) <= 45
    for words in ("make train", "pip install -e .", "logs/train/runs/", "src/relevance.py"):
        assert words in section
    assert len(re.findall(r"```python\n", section)) == 1


def test_quickstart_snippet_runs_as_written(tiny, cache_dir, tmp_path, monkeypatch):
    (snippet,) = re.findall(r"```python\n(.*?)```", quickstart(), flags=re.S)
    # the project's root moved to the test's folder: runs land in <tmp>/logs, not the repo's
    monkeypatch.setenv("MRTPO_ROOT", str(tmp_path))
    monkeypatch.setenv("MRTPO_CACHE_DIR", str(cache_dir))  # the tiny model, built once
    monkeypatch.chdir(tmp_path)
    scope: dict = {"__name__": "__main__"}
    exec(compile(snippet, "README.md (Quickstart)", "exec"), scope)
    run, trainer = scope["run"], scope["trainer"]
    assert run.run_dir.parent == tmp_path / "logs" / "train" / "runs"
    assert run.run_dir.name.endswith("_custom-mrtpo")
    assert (run.run_dir / "csv" / "metrics.csv").is_file() and run.policy is not None
    assert len([r for r in run.history() if "train/reward/reward_words/mean" in r]) == 3
    assert isinstance(scope["policy"], torch.nn.Module) and scope["policy"] is trainer.model
