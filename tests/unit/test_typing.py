"""mypy on the packages that load no torch: the router (``baton.services.router``) and the SDK
(``baton_client``, its own distribution, and ``baton.client``, which re-exports it). The
``baton.*`` names are folders mapped by ``package-dir``, which mypy does not read, so the check
runs on a tree of links laid out as the installed package is; the settings are ``[tool.mypy]`` in
pyproject.toml."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.source import CLIENT, ROOT, package_dirs

CHECKED = ("baton.services.router", "baton.client", "baton_client")


def test_the_torch_free_packages_type_check(tmp_path):
    pytest.importorskip("mypy")
    for name, folder in sorted(package_dirs().items()):
        link = tmp_path.joinpath(*name.split("."))
        if name == "baton":
            link.mkdir()
            for f in folder.iterdir():
                (link / f.name).symlink_to(f)
        elif not link.exists():
            link.symlink_to(folder, target_is_directory=True)
    (tmp_path / "baton_client").symlink_to(CLIENT, target_is_directory=True)
    packages = [arg for p in CHECKED for arg in ("-p", p)]
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file",
                        str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / ".cache"),
                        *packages], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
