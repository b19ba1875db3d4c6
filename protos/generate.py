"""Regenerate the Python stubs of Baton's two APIs (``python protos/generate.py``).

The public API (client/baton_client/v1/api.proto) belongs to the baton-client distribution, its
stubs to ``baton_client.v1``; the worker API (protos/baton/v1/worker.proto, which imports the
public one) to ``baton.v1``. The stubs are committed next to the .proto files. ``--check``
regenerates into a scratch folder and fails if the committed stubs differ, which a test runs in
CI.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CLIENT = HERE.parent / "client"
# each proto folder (an include root) and the package folder its stubs land in
FOLDERS = {HERE / "baton" / "v1": HERE, CLIENT / "baton_client" / "v1": CLIENT}


def generate(out: Path) -> dict[Path, Path]:
    """Every stub, fresh under ``out``, keyed by the committed file it should equal."""
    from grpc_tools import protoc

    protos = [p for folder, root in FOLDERS.items()
              for p in sorted(folder.glob("*.proto"))]
    args = ["protoc", f"-I{HERE}", f"-I{CLIENT}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *[str(p.relative_to(FOLDERS[p.parent])) for p in protos]]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    fresh = {}
    for folder, root in FOLDERS.items():
        for f in (out / folder.relative_to(root)).glob("*_pb2*.py*"):
            fresh[folder / f.name] = f
    return fresh


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed stubs are stale")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [str(c.relative_to(HERE.parent)) for c, f in fresh.items()
                 if not c.exists() or not filecmp.cmp(f, c, shallow=False)]
        if args.check:
            if stale:
                print(f"stale gRPC stubs: {stale}; run python protos/generate.py", file=sys.stderr)
                return 1
            return 0
        for committed, f in fresh.items():
            committed.write_bytes(f.read_bytes())
        print(f"wrote {sorted(str(c.relative_to(HERE.parent)) for c in fresh)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
