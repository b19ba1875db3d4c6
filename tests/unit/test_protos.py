"""The committed gRPC stubs are what protos/generate.py makes from the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stubs_are_fresh():
    r = subprocess.run([sys.executable, str(ROOT / "protos" / "generate.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_handle_round_trips_through_protobuf():
    from baton.transfer.handle import KVHandle

    h = KVHandle("prefill-0", "abc123", "127.0.0.1:5000", "l" * 24, (3, 9, 4), 40, "f" * 32,
                 1795382000.25, (1, 2, 4294967295))
    assert KVHandle.from_proto(h.to_proto()) == h
    assert KVHandle.from_proto(type(h.to_proto()).FromString(h.to_proto().SerializeToString())) == h
