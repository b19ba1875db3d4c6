"""Separate hosts on one machine for tests: network namespaces on a bridge (in a namespace of its
own) the test creates and removes, each running commands chrooted into an image root filesystem
(deploy/rootfs/build.sh).

Each host's processes get their own network stack (``ip netns``, a veth into the bridge), their
own /tmp and /dev/shm (tmpfs), /proc, /sys and /dev, all mounted inside the private mount
namespace ``ip netns exec`` gives them (nothing is mounted on this machine's side). Root only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path

TOOLS = ("ip", "chroot", "debootstrap", "mount")

# inside the namespace, before chroot: the host's own mounts (private to its mount namespace)
MOUNTS = ('r="$1"; shift; mount -t proc proc "$r/proc" && mount -t sysfs sysfs "$r/sys" '
          '&& mount --bind /dev "$r/dev" && mount -t tmpfs -o size=512m shm "$r/dev/shm" '
          '&& mount -t tmpfs tmp "$r/tmp" && exec chroot "$r" /usr/bin/env -i "$@"')


def missing() -> str | None:
    """Why hosts cannot be made here (not root, a tool missing), or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, chroot)"
    absent = [t for t in TOOLS if shutil.which(t) is None]
    return f"needs {', '.join(absent)}" if absent else None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Host:
    """One network namespace with one address on the bridge; its processes' output lines are
    collected (``lines``) and the ``BATON_READY``/``BATON_HTTP`` ones picked out."""

    def __init__(self, name: str, ns: str, address: str) -> None:
        self.name, self.ns, self.address = name, ns, address
        self.procs: list[subprocess.Popen] = []
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.grpc_address = self.http_address = ""

    def pump(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line)
            words = line.split()
            if words[:1] == ["BATON_HTTP"]:
                self.http_address = words[1]
            elif words[:1] == ["BATON_READY"]:
                self.grpc_address = words[1]
                self.ready.set()
        self.ready.set()  # it ended: whoever waits looks at the output

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def kill(self) -> None:
        """SIGKILL every process in the namespace: the host is gone, mid-whatever."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in self.procs:
            p.wait(30)


class Hosts:
    """Hosts on one switch: a bridge inside a namespace of its own (``bt<tag>-switch``), so that
    this machine's firewall (Docker's FORWARD drop, with bridge netfilter) never sees the hosts'
    traffic; this machine reaches them at 10.213.<n>.1 through a veth into that bridge."""

    def __init__(self, root: Path, tag: str) -> None:
        self.root, self.tag = root, tag
        self.prefix = f"10.213.{int(tag) % 250 + 1}"
        self.switch = f"bt{tag}-switch"
        self.hosts: dict[str, Host] = {}
        self._drop_stale()
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        outer = f"bt{tag}h1"  # this machine's side
        _ip("link", "add", outer, "type", "veth", "peer", "name", "up0", "netns", self.switch)
        _ip("addr", "add", f"{self.prefix}.1/24", "dev", outer)
        _ip("link", "set", outer, "up")
        _ip("-n", self.switch, "link", "set", "up0", "master", "br0", "up")

    def _drop_stale(self) -> None:
        """Namespaces a killed run of this tag left behind (no teardown ran)."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for ns in [line.split()[0] for line in listed.splitlines() if line.strip()]:
            if ns.startswith(f"bt{self.tag}-"):
                Host(ns, ns, "").kill()
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def add(self, name: str) -> Host:
        i = len(self.hosts) + 2
        ns, port = f"bt{self.tag}-{name}", f"p{i}"
        _ip("netns", "add", ns)
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
            "netns", ns)
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{self.prefix}.{i}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        host = self.hosts[name] = Host(name, ns, f"{self.prefix}.{i}")
        return host

    def spawn(self, host: Host, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        """``argv`` on ``host``, chrooted into the root, with only ``env`` (and PATH, HOME)."""
        base = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp"}
        pairs = [f"{k}={v}" for k, v in {**base, **env}.items()]
        proc = subprocess.Popen(["ip", "netns", "exec", host.ns, "sh", "-c", MOUNTS, "sh",
                                 str(self.root), *pairs, *argv],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        host.procs.append(proc)
        threading.Thread(target=host.pump, args=(proc,), daemon=True).start()
        return proc

    def close(self) -> None:
        for host in self.hosts.values():
            host.kill()
            subprocess.run(["ip", "netns", "del", host.ns], capture_output=True)
        # the switch's namespace takes the bridge and every veth with it
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True)
