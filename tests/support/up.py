"""A running `baton up` as tests see a cluster: ``router`` (``channel``, ``address``,
``http_address``), its processes by role, its output as it comes, the workers' KV pools (it gets
a cluster secret the test knows), ``assert_quiet``, ``on_after_test``. For tests that must run
the one-command cluster users run, not processes the harness starts itself."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from baton.bench.common import worker_infos
from baton.transfer import cluster_secret

from tests.support.processes import descendants, free_port


def own_cache(folder: Path) -> dict[str, str]:
    """The environment of a `baton up` with a cache of its own in ``folder`` (its state file,
    profile, converted weights), which shares this run's compiled native kernels: a fresh
    kernels folder had each of its processes compile them again, ~4 s of CPU apiece."""
    from baton import cache_dir

    shared = cache_dir() / "kernels"
    shared.mkdir(parents=True, exist_ok=True)
    (folder / "kernels").symlink_to(shared, target_is_directory=True)
    return {"BATON_CACHE_DIR": str(folder)}


class _Router:
    def __init__(self, address: str, http_address: str) -> None:
        self.address, self.http_address = address, http_address
        self.channel = grpc.insecure_channel(address)


class Up:
    def __init__(self, log_dir: Path, *args: str, env: dict | None = None) -> None:
        """``baton up ARGS`` on a fixed gRPC port (a restarted router comes back on it)."""
        self.secret = "test-" + os.urandom(8).hex()
        port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "baton.cli.main", "up", "--grpc-port", str(port),
             "--log-dir", str(log_dir), *args], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
            env={**os.environ, cluster_secret.ENV: self.secret, **(env or {})})
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self._after = None
        threading.Thread(target=self._read, daemon=True).start()
        self.wait_line(r"ready: gRPC API", "baton up serving")
        text = "".join(self.lines)
        self.redis_url = re.search(r"redis-server on (\S+)", text).group(1)
        if "--http-port" in args and args[list(args).index("--http-port") + 1] != "-1":
            self.wait_line(r"OpenAI-compatible API on", "the HTTP front")
        http = re.search(r"OpenAI-compatible API on https?://(\S+)/v1", "".join(self.lines))
        self.router = _Router(f"127.0.0.1:{port}", http.group(1) if http else "")

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()

    def wait_line(self, pattern: str, what: str, after: int = 0) -> str:
        """The first output line from ``after`` on that matches ``pattern``. The bound is a
        hang detector (a start on the real model), not a timing assertion."""
        end = time.monotonic() + 300
        with self.changed:
            while True:
                for line in self.lines[after:]:
                    if re.search(pattern, line):
                        return line
                assert self.proc.poll() is None, "".join(self.lines[-30:])
                assert time.monotonic() < end, f"never happened: {what}\n" + \
                    "".join(self.lines[-30:])
                self.changed.wait(1)

    def _descendant(self, matches, what: str) -> int:
        """The pid of the process under baton up whose argv (NUL-separated) ``matches``."""
        for pid in descendants(self.proc.pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if matches(cmd):
                return pid
        raise AssertionError(f"no {what} under baton up")

    def redis_pid(self) -> int:
        """The redis-server ``baton up`` runs (the one now, after any restart)."""
        return self._descendant(lambda cmd: b"redis-server" in cmd.split(b"\0")[0],
                                "redis-server")

    def pid_of(self, role: str) -> int:
        return self._descendant(lambda cmd: f"baton.services.{role}".encode() in cmd,
                                f"{role} process")

    def pools(self) -> dict[str, tuple[int, int, int, int]]:
        """(free, total, leases, running) of every worker that answers, integrity checked."""
        infos, _ = worker_infos(self.redis_url, self.secret)
        for wid, i in infos.items():
            assert i.integrity_ok, (wid, i.integrity_error)
        return {wid: (i.num_free_blocks, i.num_blocks, i.active_leases, i.running_requests)
                for wid, i in infos.items()}

    def assert_quiet(self, workers: int | None = None, timeout: float = 120.0) -> None:
        """Until every worker (``workers`` of them, if given) has all its blocks free, no lease
        and nothing running; the bound is a hang detector (a dead reader's lease expires)."""
        end = time.monotonic() + timeout
        while True:
            pools = self.pools()
            if (workers is None or len(pools) == workers) and all(
                    f == t and not leases and not running
                    for f, t, leases, running in pools.values()):
                return
            assert time.monotonic() < end, pools
            time.sleep(0.25)

    def on_after_test(self, fn) -> None:
        self._after = fn

    def stop(self) -> int:
        if self._after is not None:
            self._after()
        self.router.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(120)
