"""A process that exits before it serves says how it ended and what it printed: the start error
``baton up`` and the tests show is all there is to go on when a start fails once in a while."""

from __future__ import annotations

import pytest
from baton.services.launch.local import WorkerProcess, WorkerStartError

from baton import PARENT_ENV


def test_a_process_that_prints_and_exits_before_serving_shows_its_output(tmp_path):
    # `--help` prints the usage on stdout (where only the ready lines are read) and exits 0
    with pytest.raises(WorkerStartError) as e:
        WorkerProcess("router", ["--help"], log_dir=str(tmp_path), ready_timeout=120)
    said = str(e.value)
    assert "router worker did not start (exit 0)" in said, said
    assert "(empty)" in said and str(tmp_path) in said, said  # nothing on stderr: it says so
    out = said.split("; its output:\n", 1)[1]  # its last 20 lines: the usage's end
    assert out.splitlines()[-1].split()[:2] == ["--tls-key", "TLS_KEY"], out


def test_a_process_killed_before_serving_names_the_signal(tmp_path):
    # told its launcher is a process it is not the child of, it sends itself SIGTERM first thing
    with pytest.raises(WorkerStartError, match=r"did not start \(killed by SIGTERM\)"):
        WorkerProcess("router", [], env={PARENT_ENV: "1"}, log_dir=str(tmp_path),
                      ready_timeout=120)
