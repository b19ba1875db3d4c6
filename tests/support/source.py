"""The source tree as the package sees it: every first-party module by its ``baton.*`` name, and
the imports each one makes (read with ``ast``, function-level ones included)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def package_dirs() -> dict[str, Path]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        cfg = tomllib.load(f)
    return {name: ROOT / folder for name, folder in
            cfg["tool"]["setuptools"]["package-dir"].items()}


def modules() -> dict[str, Path]:
    """Every first-party module by its ``baton.*`` name (the longest mapped prefix wins)."""
    out: dict[str, Path] = {}
    for name, folder in sorted(package_dirs().items(), key=lambda kv: len(kv[0])):
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("").parts
            rel = rel[:-1] if rel[-1] == "__init__" else rel
            out[".".join((name, *rel))] = path
    return out


CLIENT = ROOT / "client" / "baton_client"  # the baton-client distribution's package


def client_modules() -> dict[str, Path]:
    """The baton-client distribution's modules (``baton_client.*``), generated stubs included."""
    out = {}
    for path in CLIENT.rglob("*.py"):
        rel = path.relative_to(CLIENT).with_suffix("").parts
        rel = rel[:-1] if rel[-1] == "__init__" else rel
        out[".".join(("baton_client", *rel))] = path
    return out


def imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file, relative ones resolved."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".")
                pkg = pkg[:len(pkg) - node.level + (path.name == "__init__.py")]
                base = ".".join(pkg + ([base] if base else []))
            out += [(node.lineno, base)]
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out
