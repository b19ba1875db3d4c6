"""Regenerate the Python stubs for protos/baton/v1/*.proto (``python protos/generate.py``).

The stubs are committed next to the .proto files (package ``baton.v1``). ``--check`` regenerates
into a scratch folder and fails if the committed stubs differ, which a test runs in CI.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
V1 = HERE / "baton" / "v1"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(V1.glob("*.proto"))
    args = ["protoc", f"-I{HERE}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *[str(p.relative_to(HERE)) for p in protos]]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out / "baton" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed stubs are stale")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [f.name for f in fresh
                 if not (V1 / f.name).exists() or not filecmp.cmp(f, V1 / f.name, shallow=False)]
        if args.check:
            if stale:
                print(f"stale gRPC stubs: {stale}; run python protos/generate.py", file=sys.stderr)
                return 1
            return 0
        for f in fresh:
            (V1 / f.name).write_bytes(f.read_bytes())
        print(f"wrote {[f.name for f in fresh]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
