"""A worker's role while it serves. Every worker serves both worker APIs (PrefillWorker and
KVSource; DecodeWorker); its role is which candidate sets the routers put it in (its registry
entry) and which new work it takes: a prefill call to a worker that no longer prefills, or a
decode call to one that no longer decodes, ends UNAVAILABLE before any token, which the router
retries on another worker. `baton role` switches it (WorkerAdmin.SetRole, behind the cluster
secret like every worker call). What the worker holds stays: its incarnation, its leases (the
handshake and release calls of KVSource are always served), its prefix-index entries, its
running streams.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import grpc
from baton.control.registry import ROLES
from baton.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("baton.services.role")


class RoleGate:
    def __init__(self, role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"role {role!r}: one of {ROLES}")
        self.role, self.epoch = role, 0
        self._lock = threading.Lock()

    def takes(self, work: str) -> bool:
        """Whether new ``work`` (prefill | decode) is this worker's now."""
        return self.role in (work, "both")

    def refuse(self, work: str, context) -> None:
        """End the call UNAVAILABLE (retried elsewhere) unless ``work`` is this worker's."""
        if not self.takes(work):
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"this worker no longer takes {work} work (its role is {self.role} "
                          f"since switch {self.epoch}): try another")

    def switch(self, role: str) -> tuple[str, int]:
        """Take ``role`` from now on; returns (the previous role, the new epoch)."""
        if role not in ROLES:
            raise ValueError(f"role {role!r}: one of {', '.join(ROLES)}")
        with self._lock:
            previous, self.role = self.role, role
            if previous != role:
                self.epoch += 1
            return previous, self.epoch


class AdminService(worker_pb2_grpc.WorkerAdminServicer):
    """``SetRole``: the gate first (new work of a dropped role is refused from here on), then
    the registry entry routers read; answered once both hold. ``registration`` returns the
    worker's Registration (None without Redis)."""

    def __init__(self, gate: RoleGate, worker_id: str, registration) -> None:
        self.gate, self.worker_id, self.registration = gate, worker_id, registration

    def SetRole(self, request, context):
        try:
            previous, epoch = self.gate.switch(request.role)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"role: {e}")
        reg = self.registration()
        if reg is not None and previous != request.role:
            record = dataclasses.replace(reg.record, role=request.role, role_epoch=epoch)
            if not reg.update(record):
                context.abort(grpc.StatusCode.UNAVAILABLE,
                              f"{self.worker_id} takes {request.role} work now, but Redis is "
                              "unreachable: routers see the new role once it answers")
        log.info("role %s -> %s (switch %d)", previous, request.role, epoch)
        return worker_pb2.SetRoleResponse(role=request.role, previous=previous, epoch=epoch)
