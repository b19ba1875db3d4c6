"""A self-signed certificate for TLS tests (openssl, one day, for 127.0.0.1 and localhost)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def self_signed_cert(d: Path) -> tuple[Path, Path]:
    """Write ``cert.pem`` and ``key.pem`` into ``d``; returns (certificate, key)."""
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"),
                    "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"
