"""What pyproject.toml cannot say about Baton's build: the packages under each mapped folder.

Every top-level code folder is a subpackage of ``baton`` (``[tool.setuptools] package-dir`` in
pyproject.toml, the one list, of top-level folders only); the packages inside those folders are
found here, so a new subfolder with an ``__init__.py`` reaches the wheel without editing a list
(``tests/unit/test_packaging.py`` builds the wheel and compares).
"""

import tomllib
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
with open(HERE / "pyproject.toml", "rb") as f:
    ROOTS = tomllib.load(f)["tool"]["setuptools"]["package-dir"]

packages = []
for name, folder in ROOTS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(str(HERE / folder))]

setup(packages=packages)
