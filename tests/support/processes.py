"""Starting Baton's own commands in tests: a free port, and ``baton up`` until it is ready."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from baton.bench.common import descendants  # noqa: F401 (the tests' import point)


def alive(pid: int) -> bool:
    """Running (a zombie counts as gone: it has exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999). Tests choose a port that a
    process binds seconds later (a worker's ``--port``, ``baton up``'s router after its
    workers start, a Redis a test starts after its clients): in the ephemeral range an
    outgoing connection or another process's listener on port 0 can take it meanwhile (a
    chaos cluster's decode worker met "Address already in use" so, 2026-12-07)."""
    import random

    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # all 200 taken: what the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_baton_up(*args: str) -> tuple[subprocess.Popen, list[str]]:
    """``baton up ARGS`` and its output up to its "ready:" line (or an error line, or its end);
    the caller stops it (SIGINT) and asserts on the lines."""
    up = subprocess.Popen([sys.executable, "-m", "baton.cli.main", "up", *args],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    for line in up.stdout:
        lines.append(line)
        if "ready:" in line or "error" in line:
            break
    return up, lines


def baton_request(router: str, text: str, max_tokens: int = 10,
                  timeout: float = 180) -> subprocess.CompletedProcess:
    """``baton request --json`` against ``router``."""
    return subprocess.run([sys.executable, "-m", "baton.cli.main", "request", "--json",
                           "--max-tokens", str(max_tokens), "--router", router, text],
                          capture_output=True, text=True, timeout=timeout)
