"""Which UCX transports a hand-off used is read from UCX's own protocol report."""

from __future__ import annotations


def test_transports_are_read_from_ucx_protocol_tables(tmp_path):
    from baton.transfer.agent import _TransportLog

    log = tmp_path / "ucx.log"
    row = "[1795383681.16] [vm:9006 :0]   "
    log.write_text("\n".join(row + line for line in [
        "| bench-reader intra-node cfg#1                                    |",
        "| remote memory write by ucp_put* from host memory to host |",
        "| 0..inf | zero-copy   | 52% on tcp/lo and 48% on tcp/eth0 |",
        "| remote memory read by ucp_get*(multi) into host memory from host |",
        "| Range  | Description |                  Config                   |",
        "| 0..inf | zero-copy   | cma/memory                                |",
        "| active message by ucp_am_send* from host memory |",
        "|   1..16515 | zero-copy          | tcp/lo        |",
    ]) + "\n")
    t = _TransportLog(log)
    assert t.poll() == ["cma/memory"]  # only READ tables count: that is all a hand-off does
    with open(log, "a") as f:  # later tables (a new peer) add to what was seen
        f.write(row + "| remote memory read by ucp_get* into host memory from host |\n")
        f.write(row + "| 0..8192 | software emulation | 60% on tcp/lo and 40% on tcp/eth0 |\n")
    assert t.poll() == ["cma/memory", "tcp/eth0", "tcp/lo"]
    assert _TransportLog(None).poll() == []
