"""The harnesses live in scripts/, outside the installed package: the library never imports
them, and the scripts find them without path code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESSES = {p.name for p in (ROOT / "scripts").iterdir() if (p / "__init__.py").exists()}


def _imported(path: Path) -> set[str]:
    """Top-level names of the absolute imports in one file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_library_imports_no_harness():
    assert {"benchmarks", "replication"} <= HARNESSES
    for path in sorted((ROOT / "src").rglob("*.py")):
        found = _imported(path) & HARNESSES
        assert not found, f"{path.relative_to(ROOT)} imports {sorted(found)} from scripts/"


def test_scripts_carry_no_path_code():
    """Python puts a script's folder on its path; nothing in scripts/ edits ``sys.path``."""
    edit = re.compile(r"sys\.path\s*(\.(insert|append|extend)|\[|\+?=)")
    for path in sorted((ROOT / "scripts").rglob("*.py")):
        assert not edit.search(path.read_text()), path.relative_to(ROOT)
