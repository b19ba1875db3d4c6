"""The wheel holds every first-party module under its ``baton.*`` name, and nothing else at the
top of site-packages: built here from the working tree, compared with the source folders that
``[tool.setuptools] package-dir`` maps."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.support.source import ROOT, modules

pytestmark = pytest.mark.slow  # builds a wheel (~20 s)


def test_the_wheel_holds_every_module_and_the_kernel_sources(tmp_path):
    # built from a copy: an in-tree build/ from an earlier build may hold modules since removed
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".venv", "results", "*.so"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(src)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("baton-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    in_wheel = {n[:-3].replace("/", ".").removesuffix(".__init__")
                for n in names if n.endswith(".py")}
    assert in_wheel == set(modules())
    assert {n.split("/")[0] for n in names} == {"baton", wheel.name.split("-")[0] + "-"
                                                + wheel.name.split("-")[1] + ".dist-info"}
    sources = {p.name for p in (ROOT / "kernels" / "csrc").glob("*.c")}
    assert sources and {n.rsplit("/", 1)[1] for n in names
                        if n.startswith("baton/kernels/csrc/")} >= sources


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_the_images_copy_everything_the_build_reads(dockerfile):
    """`pip install .` in an image needs setup.py and every folder pyproject.toml maps to a
    package (no Docker engine here: the Dockerfile is read, not built)."""
    import tomllib

    root = ROOT
    folders = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"].values()
    copied = set()
    for line in (root / "deploy" / "docker" / dockerfile).read_text().splitlines():
        if line.startswith("COPY "):
            copied.update(p.rstrip("/").removeprefix("./") for p in line.split()[1:-1])
    # client/: the baton-client distribution, which the main package depends on
    missing = {"setup.py", "pyproject.toml", "client",
               *(f.split("/")[0] for f in folders)} - copied
    assert not missing, f"{dockerfile} does not copy {sorted(missing)}"
