"""Start worker processes and wait until they serve (used by tests, benchmarks, ``baton up``)."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

from baton.transfer import cluster_secret
from baton.v1 import worker_pb2, worker_pb2_grpc

from baton import LOG_DIR_ENV, launch_env


class WorkerStartError(RuntimeError):
    pass


# The log folders WorkerProcess made itself (no ``log_dir`` given), with their workers: at this
# process's exit the folder of a worker that ended as asked (exit 0, or stopped or killed through
# its WorkerProcess) goes; one that failed, died of another's signal or still runs keeps its log,
# and the exit says where.
_OWN_LOG_DIRS: list[tuple[WorkerProcess, Path]] = []


def _tidy_own_log_dirs() -> None:
    kept = []
    for w, d in _OWN_LOG_DIRS:
        if w.ended_as_asked():
            shutil.rmtree(d, ignore_errors=True)
        else:
            rc = w.proc.poll()
            kept.append(f"{w.log_path} ({w.role}, "
                        f"{'still running' if rc is None else f'exit {rc}'})")
    if kept:
        print("baton: worker logs kept: " + "; ".join(kept), file=sys.stderr)


atexit.register(_tidy_own_log_dirs)


def spawn(cmd: list[str], env: dict, *, stdout=None, stderr=None, cpus: set[int] | None = None,
          die_with_parent: bool = False) -> subprocess.Popen:
    """Start a Baton process. What it should do for its launcher (run on ``cpus``, get
    SIGTERM when this process dies: :func:`baton.launch_env`) goes in its environment, applied
    by the child first thing (:func:`baton.adopt_launch_settings`), never in a ``preexec_fn``:
    that forces a real fork, and a fork of a process with gRPC running can abort the child
    before exec."""
    env = launch_env(env, die_with_parent=die_with_parent, cpus=cpus)
    # a native crash (gRPC, torch) prints the Python stacks to the process's log, not nothing
    env.setdefault("PYTHONFAULTHANDLER", "1")
    return subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env)


def _signal_name(num: int) -> str:
    import signal

    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


class WorkerProcess:
    """``python -m baton.services.<role> --port 0 ARGS``; ready once it prints ``BATON_READY``.

    stderr (the worker's log) goes to ``log_path``; stdout is drained on a thread.
    """

    def __init__(self, role: str, args: list[str] = (), *, env: dict | None = None,
                 ready_timeout: float = 180.0, log_dir: str | None = None,
                 die_with_parent: bool = False, cpus: set[int] | None = None) -> None:
        """``cpus``: pin the process to these cores (benchmarks give setups equal cores)."""
        self.role = role
        self._asked_to_end = False
        if log_dir:
            log_dir = Path(log_dir)
            log_dir.mkdir(parents=True, exist_ok=True)
        else:
            log_dir = Path(tempfile.mkdtemp(prefix="baton-workers-"))
            _OWN_LOG_DIRS.append((self, log_dir))
        self.log_path = log_dir / f"{role}-{time.time_ns()}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (lives as long as the worker)
        cmd = [sys.executable, "-m", f"baton.services.{role}", "--port", "0", *args]
        # the worker's UCX log beside its own (transfer/agent.py): kept or removed with it
        env = {**os.environ, LOG_DIR_ENV: str(log_dir), **(env or {})}
        self._secret = cluster_secret.from_env(env)
        self.proc = spawn(cmd, env, stdout=subprocess.PIPE, stderr=self._log, cpus=cpus,
                          die_with_parent=die_with_parent)
        self.address = self.worker_id = self.incarnation = self.http_address = ""
        self.metrics_address = ""
        ready = threading.Event()
        said = deque(maxlen=20)  # what else it printed before it served (an error, a warning)

        def pump() -> None:
            for raw in self.proc.stdout:
                text = raw.decode(errors="replace")
                line = text.split()
                if line[:1] == ["BATON_HTTP"]:
                    self.http_address = line[1]
                elif line[:1] == ["BATON_METRICS"]:
                    self.metrics_address = line[1]
                elif line[:1] == ["BATON_READY"]:
                    self.address, self.worker_id, self.incarnation = line[1:4]
                    ready.set()
                elif not ready.is_set():
                    said.append(text.rstrip())
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        ended = ready.wait(ready_timeout)  # it served, or its stdout closed (it is exiting)
        if not ended or not self.address:
            try:
                rc = self.proc.wait(10 if ended else 0)
            except subprocess.TimeoutExpired:
                rc = None
            if rc is None:
                self.proc.kill()
                self.proc.wait()
                how = ("its output closed, it did not exit: killed it" if ended
                       else f"not serving after {ready_timeout:g}s: killed it")
            else:
                how = f"exit {rc}" if rc >= 0 else f"killed by {_signal_name(-rc)}"
            tail = self.log_tail()
            self._close()
            out = "; its output:\n" + "\n".join(said) if said else ""
            raise WorkerStartError(f"{role} worker did not start ({how}); log "
                                   f"{self.log_path}:\n{tail or '(empty)'}{out}")
        self.channel = cluster_secret.channel(self.address, secret=self._secret or "")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def info(self, check_integrity: bool = False, timeout: float = 30.0):
        stub_cls = (worker_pb2_grpc.PrefillWorkerStub if self.role == "prefill"
                    else worker_pb2_grpc.DecodeWorkerStub)
        return stub_cls(self.channel).Info(
            worker_pb2.InfoRequest(check_integrity=check_integrity), timeout=timeout)

    def log_tail(self, n: int = 40) -> str:
        if not self._log.closed:
            self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def ended_as_asked(self) -> bool:
        """Exited 0, or ended by :meth:`stop` or :meth:`kill` (a worker already dead when
        they were called did not end as asked)."""
        rc = self.proc.poll()
        return rc is not None and (rc == 0 or self._asked_to_end)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self._asked_to_end = True
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self._asked_to_end = True
            self.proc.kill()
            self.proc.wait()
        self._close()

    def _close(self) -> None:
        if getattr(self, "channel", None) is not None:
            self.channel.close()
            self.channel = None
        self._log.close()
