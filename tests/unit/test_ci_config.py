"""CI runs what the docs say it runs: the portable rerun of the recorded-number tests after
the suite, in the GitHub workflow as in ``.ci/run`` (issue 47, item 0)."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _make_targets(commands: list[str]) -> list[str]:
    return [c.split()[1] for c in commands if c.split()[:1] == ["make"] and len(c.split()) > 1]


def test_the_workflow_runs_the_portable_tests_after_the_suite():
    flow = yaml.safe_load((ROOT / ".github/workflows/ci.yml").read_text())
    runs = [s["run"] for s in flow["jobs"]["test"]["steps"] if "run" in s]
    targets = _make_targets(runs)
    assert "test" in targets and "test-portable" in targets, runs
    assert targets.index("test") < targets.index("test-portable")


def test_the_ci_script_runs_the_portable_tests_after_the_suite():
    lines = [ln.strip() for ln in (ROOT / ".ci/run").read_text().splitlines()]
    targets = _make_targets(lines)
    assert targets.index("test") < targets.index("test-portable")
