"""A worker's role gate (services/worker/role.py) and `baton role`'s refusals (cli/role.py);
the switch itself, under load on a real cluster, is tests/integration/test_role_switch.py."""

from __future__ import annotations

import grpc
import pytest
from baton.cli.role import refusal
from baton.control.registry import WorkerRecord
from baton.services.worker.role import RoleGate


class Aborted(Exception):
    pass


class Context:
    def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(details)


def test_the_gate_takes_its_roles_work_only_and_counts_switches():
    gate = RoleGate("prefill")
    assert gate.takes("prefill") and not gate.takes("decode")
    ctx = Context()
    with pytest.raises(Aborted):
        gate.refuse("decode", ctx)
    assert ctx.code == grpc.StatusCode.UNAVAILABLE  # retried elsewhere before any token
    assert "no longer takes decode work" in ctx.details
    assert gate.switch("both") == ("prefill", 1)
    gate.refuse("decode", Context())  # no abort
    assert gate.switch("both") == ("both", 1)  # unchanged: no new epoch
    assert gate.switch("decode") == ("both", 2) and not gate.takes("prefill")
    with pytest.raises(ValueError, match="one of prefill, decode, both"):
        gate.switch("colocated")


def rec(wid: str, role: str) -> WorkerRecord:
    return WorkerRecord(wid, role, f"{wid}:1", "f", "i")


def test_baton_role_refuses_to_leave_no_worker_that_decodes():
    workers = [rec("p0", "prefill"), rec("d0", "decode"), rec("b0", "both")]
    assert refusal(workers, "d0", "prefill") == ""  # b0 still decodes
    assert refusal(workers, "p0", "decode") == ""
    alone = [rec("p0", "prefill"), rec("d0", "decode")]
    assert "last worker that decodes" in refusal(alone, "d0", "prefill")
    assert refusal(alone, "d0", "both") == ""
    assert refusal(alone, "p0", "decode") == ""  # no prefill pool: decode workers prefill
    assert "no worker 'x'" in refusal(alone, "x", "decode")
