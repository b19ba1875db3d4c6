"""Workers as Ray actors, for ``baton up --ray ADDRESS|local``.

Each worker is a Ray actor that owns one worker process (``python -m baton.services.<role>``,
the same process ``baton up`` starts locally): Ray places the actor on a node with the resources
asked for its role (CPUs, GPUs), the actor starts the worker there, bound to every interface and
advertising the node's IP, and drains it on stop. The worker dies with its actor. Workers
register in the same Redis as always, so the router finds them as it finds local ones.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path


class _WorkerActor:
    def start(self, role: str, args: list[str], env: dict, log_dir: str | None, local: bool):
        import ray
        from baton.services.launch.local import WorkerProcess

        ip = "127.0.0.1" if local else ray.util.get_node_ip_address()
        bind = ["--host", ip] if local else ["--host", "0.0.0.0", "--advertise-host", ip]
        self.proc = WorkerProcess(role, [*args, *bind], env=env, log_dir=log_dir,
                                  die_with_parent=True)
        return (self.proc.address, self.proc.worker_id, self.proc.incarnation,
                str(self.proc.log_path), ip)

    def poll(self):
        return self.proc.proc.poll()

    def stop(self, timeout: float) -> int | None:
        self.proc.stop(timeout)
        return self.proc.proc.returncode


class _ActorProc:
    """``subprocess.Popen``-like view (poll) of the actor's worker, for ``baton up``'s loop."""

    def __init__(self, actor) -> None:
        self.actor, self.returncode = actor, None

    def poll(self):
        import ray

        try:
            self.returncode = ray.get(self.actor.poll.remote(), timeout=30)
        except Exception:  # the actor itself is gone (its node died)
            self.returncode = -1
        return self.returncode


class RayWorker:
    """A worker process under a Ray actor; same attributes as ``WorkerProcess`` that ``baton up``
    uses (role, address, worker_id, incarnation, log_path, proc.poll(), stop())."""

    def __init__(self, role: str, args: list[str], *, env: dict, num_cpus: float, num_gpus: float,
                 log_dir: str | None, local: bool, ready_timeout: float = 600.0) -> None:

        import ray

        self.role = role
        actor_cls = ray.remote(_WorkerActor)
        self.actor = actor_cls.options(num_cpus=num_cpus, num_gpus=num_gpus,
                                       max_concurrency=4).remote()
        t = time.monotonic()
        (self.address, self.worker_id, self.incarnation, log, self.node_ip) = ray.get(
            self.actor.start.remote(role, args, env, log_dir, local), timeout=ready_timeout)
        self.log_path = Path(log)
        self.start_s = time.monotonic() - t
        self.proc = _ActorProc(self.actor)

    def stop(self, timeout: float = 10.0) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.get(self.actor.stop.remote(timeout), timeout=timeout + 10)
        ray.kill(self.actor)
