"""ruff (``[tool.ruff]`` in pyproject.toml: 100 columns, pyflakes, bugbear, import order, ...)
passes on the whole tree."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.source import ROOT


def test_ruff_passes():
    pytest.importorskip("ruff")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_suites_longest_modules_are_named_as_they_are_now():
    # tests/conftest.py starts these first under xdist; a renamed or removed module would
    # silently fall back to collection order
    from tests.conftest import HEAVY_MODULES

    missing = [m for m in HEAVY_MODULES if not (ROOT / m).is_file()]
    assert not missing, f"HEAVY_MODULES names modules that do not exist: {missing}"
    assert len(set(HEAVY_MODULES)) == len(HEAVY_MODULES)
