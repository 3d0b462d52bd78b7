"""What the docs state matches the code: docs/method.md's cap and context forms (issue 49),
and every module path that README.md, docs/extending.md and docs/method.md show still imports
(issue 48: the package was regrouped into wings)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mrtpo.core.credit.relevance import CAPS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/extending.md", "docs/method.md")
WINGS = ("tasks", "core", "rollout", "step", "run", "evaluate", "lightning")


def _rows(text: str, first_cell: str) -> dict[str, str]:
    """Markdown table rows whose first cell starts with a backticked name: name -> row."""
    return {
        m.group(1): m.group(0)
        for m in re.finditer(rf"^\s*\| `({first_cell})`[^\n]*\|$", text, re.M)
    }


def test_method_md_gives_each_cap_and_context_form_a_formula():
    text = (ROOT / "docs" / "method.md").read_text(encoding="utf-8")
    preset = OmegaConf.load(ROOT / "configs" / "method" / "mrtpo.yaml")
    caps = _rows(text, "|".join(CAPS))
    assert sorted(caps) == sorted(CAPS)
    for name, row in caps.items():
        assert "A(j) + " in row, name  # the token advantage, written out
        assert ("(the default" in row) == (name == preset.cap), name
    contexts = _rows(text, "delete|mask")
    assert sorted(contexts) == ["delete", "mask"]
    for name, row in contexts.items():
        assert "π_old(· ∣" in row and "y_<t" in row, name  # the distribution it replays
        assert ("(default" in row) == (name == preset.context), name


def _resolve(name: str) -> object:
    """``mrtpo.a.b.C``: import the longest module prefix, then take the attributes."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def _shown_names(text: str) -> set[str]:
    """`mrtpo.x.y` written alone in backticks, and what code blocks import from mrtpo."""
    names = set(re.findall(r"`(mrtpo(?:\.\w+)+)(?:\(\))?`", text))
    for m in re.finditer(r"^\s*from (mrtpo[\w.]*) import ([\w, ]+)$", text, re.M):
        names |= {f"{m.group(1)}.{n.strip()}" for n in m.group(2).split(",") if n.strip()}
    names |= set(re.findall(r"^\s*import (mrtpo[\w.]*)$", text, re.M))
    return names


@pytest.mark.parametrize("doc", DOCS)
def test_every_module_path_a_doc_shows_imports(doc):
    names = _shown_names((ROOT / doc).read_text(encoding="utf-8"))
    assert names, doc
    broken = []
    for name in sorted(names):
        try:
            _resolve(name)
        except (ImportError, AttributeError) as err:
            broken.append(f"{name} ({type(err).__name__}: {err})")
    assert not broken, f"{doc} shows paths that no longer import: {broken}"


def test_readme_layout_and_the_map_of_homes_show_every_wing():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = readme[readme.index("## Layout") :]
    layout = layout[: layout.find("\n## ", 3)]
    homes = (ROOT / "docs" / "extending.md").read_text(encoding="utf-8")
    homes = homes[homes.index("## Map of homes") :]
    homes = homes[: homes.find("\n## ", 3)]
    for wing in WINGS:
        assert (ROOT / "src" / "mrtpo" / wing / "__init__.py").is_file(), wing
        assert f"{wing}/" in layout, f"README's Layout lacks {wing}/"
        assert f"{wing}/" in homes, f"docs/extending.md's map of homes lacks {wing}/"


def test_every_file_the_map_of_homes_names_exists():
    text = (ROOT / "docs" / "extending.md").read_text(encoding="utf-8")
    homes = text[text.index("## Map of homes") :]
    homes = homes[: homes.find("\n## ", 3)]
    src = ROOT / "src" / "mrtpo"
    paths = [p for p in re.findall(r"`([\w./-]+/[\w./-]*)`", homes) if "<" not in p]
    assert len(paths) > 10
    missing = [
        p
        for p in paths
        if not ((ROOT / p).exists() or (src / p).exists() or any(src.glob(f"*/{p}")))
    ]
    assert not missing, f"docs/extending.md's map of homes names files that are gone: {missing}"


def test_every_src_file_named_in_docs_and_configs_exists():
    # Modules move between wings; a doc or config comment that names the old file misleads.
    # The replication reports are generated and name files as they were when written.
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    texts += sorted((ROOT / "configs").rglob("*.yaml"))
    missing = [
        f"{t.relative_to(ROOT)}: {p}"
        for t in texts
        if not t.name.startswith("replication")
        for p in sorted(set(re.findall(r"src/mrtpo/[\w/]+\.py", t.read_text(encoding="utf-8"))))
        if not (ROOT / p).is_file()
    ]
    assert not missing, f"files named that are gone: {missing}"
