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
