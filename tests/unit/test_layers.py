"""Baton's package layers, checked on the source: every ``import`` of a ``baton.*`` module, at
module level or inside a function, read with ``ast`` from the folders the package maps.

Layers, lowest first; a package may import its own layer and those below, never above::

    baton.v1 (generated protocol stubs)  <  kernels  <  engine  <  transfer  <  control
        <  services  <  bench  <  cli

The SDK stands apart: the baton-client distribution (``baton_client``, client/) imports nothing of
``baton`` (it installs without it), ``baton.client`` re-exports it, and only the clients of a
cluster (``bench``, ``cli``) import either; the public API's generated stubs
(``baton_client.v1``) are the one part every layer may import. Within ``services`` the worker
process (``services.worker``), the router and the launchers do not import each other; what the
worker and the router share lives in ``services.common``. The kernels sit under the engine because
the engine's model calls them; nothing in ``kernels`` knows the engine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.source import ROOT, client_modules, imports, modules

ORDER = ["baton.v1", "baton.kernels", "baton.engine", "baton.transfer", "baton.control",
         "baton.services", "baton.bench", "baton.cli"]
APART = {"baton.client": {"baton.client"}}
CLIENTS = ("baton.bench", "baton.cli")  # what talks to a cluster as its users do
# the worker process, the router and the launchers: none imports another; what the worker and
# the router share lives in services.common (the prefill and decode packages are the worker's
# thin entry points)
SIBLINGS = ["baton.services.worker", "baton.services.router", "baton.services.launch"]
# first-party folders a module could be imported by, if ``baton.`` were left off
BARE = ("engine", "kernels", "transfer", "control", "services", "client", "cli", "bench", "v1")


def layer(name: str) -> str | None:
    for top in [*APART, *ORDER]:
        if name == top or name.startswith(top + "."):
            return top
    return None


def violations() -> list[str]:
    found = []
    for module, path in modules().items():
        mine = layer(module)
        for line, target in imports(path, module):
            theirs = layer(target)
            where = f"{_shown(path)}:{line} imports {target}"
            if _sdk(target) and mine not in (*CLIENTS, *APART):
                found.append(f"{where}: only {CLIENTS} use the SDK (clients of a cluster)")
            if not target.startswith("baton.") or layer(target) is None:
                continue
            if mine in APART:
                if theirs not in APART[mine]:
                    found.append(f"{where}: {mine} may import only {sorted(APART[mine])}")
            elif theirs in APART and mine not in CLIENTS:
                found.append(f"{where}: only {CLIENTS} use the SDK (clients of a cluster)")
            elif mine in ORDER and theirs in ORDER and ORDER.index(theirs) > ORDER.index(mine):
                found.append(f"{where}: {mine} sits below {theirs}")
            for a in SIBLINGS:
                if module.startswith(a + ".") and any(
                        target.startswith(b) for b in SIBLINGS if b != a):
                    found.append(f"{where}: the worker, the router and the launchers share "
                                 "through services.common")
    for module, path in client_modules().items():
        found += [f"{_shown(path)}:{line} imports {target}: baton_client installs without baton"
                  for line, target in imports(path, module) if target.split(".")[0] == "baton"]
    return found


def _sdk(target: str) -> bool:
    """The SDK proper (not the public API's stubs, which the router serves)."""
    return target.split(".")[0] == "baton_client" and not target.startswith("baton_client.v1")


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def test_every_import_respects_the_layers():
    assert violations() == []


def test_a_package_that_imports_a_higher_one_is_caught(tmp_path, monkeypatch):
    """The check itself: an engine module importing the services is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from baton.services.common import process\n")
    real = modules()
    monkeypatch.setattr(sys.modules[__name__], "modules",
                        lambda: {**real, "baton.engine.bad": bad})
    found = [v for v in violations() if "bad.py" in v]
    assert found and "baton.engine sits below baton.services" in found[0]


def test_first_party_modules_are_imported_by_one_name_only():
    """``engine.model`` and ``baton.engine.model`` would be two modules with two states:
    first-party code always imports the ``baton.*`` name."""
    bare = []
    for module, path in modules().items():
        for line, target in imports(path, module):
            if target.split(".")[0] in BARE:
                bare.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    for path in (ROOT / "tests").rglob("*.py"):
        for line, target in imports(path, "tests"):
            if target.split(".")[0] in BARE:
                bare.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert bare == []


@pytest.mark.parametrize("package", ["baton.services.router", "baton.client", "baton_client"])
def test_the_router_and_the_sdk_import_no_torch_numpy_or_nixl(package):
    mods = [m for m in {**modules(), **client_modules()}
            if (m == package or m.startswith(package + ".")) and not m.endswith(".__main__")]
    code = (f"import sys; import {', '.join(mods)}; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'nixl'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
