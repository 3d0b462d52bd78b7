"""A wheel (a non-editable install) ships the package's templates: the relevance viewer's page
is ``mrtpo/evaluate/templates/relevance.html.j2``, which is no Python file, so only
pyproject's ``[tool.setuptools.package-data]`` puts it in the wheel."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

from tests.conftest import ROOT


def test_the_wheel_holds_every_template(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "mrtpo", src / "src" / "mrtpo",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))  # fmt: skip
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(tmp_path / "dist"), str(src)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("mrtpo-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    templates = sorted(
        str(p.relative_to(ROOT / "src"))
        for p in (ROOT / "src" / "mrtpo").rglob("templates/*")
        if p.is_file()
    )
    assert "mrtpo/evaluate/templates/relevance.html.j2" in templates
    assert [t for t in templates if t not in shipped] == []
