"""What docs/method.md and the step's docstrings say about stale samples (issue 47, item 17).

The loss truncates the behaviour weight at the cap (its gradient is checked in
tests/integration/test_stale_loss.py) where AReaL's code masks the token: the text must say so.
Replay runs under pi_old, the weights at the step's start, which under one_step_off/async are
not the weights that sampled the batch: no text may say it runs under the sampling ones.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _section(text: str, title: str) -> str:
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start : end if end >= 0 else None]


def test_method_md_says_the_cap_truncates_where_areal_masks():
    stale = _section((ROOT / "docs" / "method.md").read_text(), "## Stale samples")
    assert "Truncated, not masked" in stale
    assert "behav_imp_weight_cap" in stale and "weight 0" in stale


def test_replay_is_said_to_run_under_pi_old_not_the_sampling_weights():
    method = (ROOT / "docs" / "method.md").read_text()
    replay_item = re.search(r"2\. \*\*Replay\.\*\*(.*?)\n3\. ", method, re.S).group(1)
    assert "π_old" in replay_item and "step's start" in replay_item
    for rel in ("docs/method.md", "src/mrtpo/core/replay.py", "src/mrtpo/step/step.py"):
        text = " ".join((ROOT / rel).read_text().split())
        assert "parameters that sampled" not in text, rel
        assert "(= sampling) parameters" not in text, rel
