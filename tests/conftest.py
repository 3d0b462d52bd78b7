"""Shared fixtures: the real public data folder (skip when absent) and the tiny offline model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("MRTPO_DATA_DIR", ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` (or $MRTPO_DATA_DIR); tests that need it skip when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"public benchmark files not found at {SHARED_DATA} (set MRTPO_DATA_DIR)")
    return SHARED_DATA
