"""A worker or a cluster that cannot start says why in one line, as a new user meets it: the
real `baton up` and worker commands, run as processes."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("module", ["baton.services.prefill", "baton.services.decode"])
def test_a_worker_with_a_missing_model_says_so_in_one_line(module):
    r = run("-m", module, "--model", "/no/such/path")
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == "error: model path does not exist: '/no/such/path'"
    assert "Traceback" not in r.stderr


@pytest.mark.slow  # four processes, ~6 s: the fast lane keeps the in-process checks
def test_baton_worker_runs_each_role():
    # `baton worker --role R` is the worker the docs show: it starts that role's entry point
    # (bug: it imported a `main` the worker modules no longer had, for every role); a CPU worker
    # asked for an FP8 KV cache says why it cannot in one line
    for role in ("prefill", "decode", "both"):
        r = run("-m", "baton.cli.main", "worker", "--role", role, "--help")
        assert r.returncode == 0, r.stderr[-2000:]
        assert "--kv-cache-dtype {auto,fp8}" in r.stdout and "--model" in r.stdout
    r = run("-m", "baton.cli.main", "worker", "--role", "decode", "--device", "cpu",
            "--kv-cache-dtype", "fp8")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--kv-cache-dtype fp8" in r.stderr.strip().splitlines()[-1]


def test_a_bad_huge_pages_setting_is_refused_by_name_on_any_device(monkeypatch):
    """``$BATON_HUGE_PAGES`` is read where a CPU pool or weight is made resident; a worker on a
    GPU (its pool on the device) never read it, so a bad value passed in silence there. The
    worker now refuses it as it starts, whatever its device (before its model: the path here
    does not exist), and `baton up` before starting anything."""
    monkeypatch.setenv("BATON_HUGE_PAGES", "yes")
    said = ("error: $BATON_HUGE_PAGES='yes': 1 (transparent huge pages, the default) or 0 "
            "(plain pages)")
    r = run("-m", "baton.services.decode", "--model", "/no/such/path", "--device", "cpu")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == said
    r = run("-m", "baton.cli.main", "up", "--model", "/no/such/path")
    assert r.returncode == 2 and r.stderr.strip() == said and r.stdout == ""


def test_baton_up_checks_the_model_before_starting_anything(tmp_path):
    r = run("-m", "baton.cli.main", "up", "--model", "/no/such/path")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --model: model path does not exist: '/no/such/path'"
    assert r.stdout == ""  # no process was started (it would have said so)
    (tmp_path / "config.json").write_text('{"model_type": "no-such-family"}')
    r = run("-m", "baton.cli.main", "up", "--model", str(tmp_path))
    assert r.returncode == 2 and "model_type 'no-such-family' is not supported" in r.stderr


def test_baton_up_refuses_a_log_dir_it_cannot_make(tmp_path):
    (tmp_path / "a-file").write_text("")
    r = run("-m", "baton.cli.main", "up", "--log-dir", str(tmp_path / "a-file" / "logs"))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"error: --log-dir {tmp_path / 'a-file' / 'logs'}: Not a directory"
    assert r.stdout == ""  # no process was started (it would have said so)


def test_baton_up_checks_its_ports_before_starting_anything():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run("-m", "baton.cli.main", "up", "--http-port", str(port))
    assert r.returncode == 2
    assert r.stderr.strip().startswith(f"error: --http-port {port}: cannot listen on 127.0.0.1:")
    assert r.stdout == ""


def test_baton_up_takes_a_port_its_last_run_left_in_time_wait():
    """Stopped and started again at once: the HTTP port still holds the last run's served
    connections in TIME_WAIT (a minute on Linux), which the router's servers bind past
    (SO_REUSEADDR); `baton up`'s port check must not refuse it (it did: "Address already in
    use" for a minute after every Ctrl-C)."""
    from types import SimpleNamespace

    from baton.cli.up import _preflight

    with socket.socket() as listener:
        # as uvicorn's: the accepted connections carry its SO_REUSEADDR into TIME_WAIT, and
        # Linux lets a bind pass them only when both sides set it
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            served, _ = listener.accept()
            served.close()  # the server closes first: its side of the port waits in TIME_WAIT
            client.recv(1)
    with socket.socket() as plain, pytest.raises(OSError):  # the TIME_WAIT is there
        plain.bind(("127.0.0.1", port))
    a = SimpleNamespace(model=None, host="127.0.0.1", grpc_port=-1, http_port=port)
    assert _preflight(a) == ""


def test_fault_injection_is_one_hidden_flag_and_refuses_what_it_does_not_know(monkeypatch):
    from baton.services.common.faults import ENV, Faults

    assert Faults.parse("crash_engine_after=3, step_delay=0.05") == Faults(3, 0.05, 0.0)
    with pytest.raises(ValueError, match="unknown fault 'explode'"):
        Faults.parse("explode=1")
    with pytest.raises(ValueError, match="step_delay='soon' is not a number"):
        Faults.parse("step_delay=soon")
    import argparse

    monkeypatch.setenv(ENV, "delay_release=2.5")
    assert Faults.from_args(argparse.Namespace(faults=None)) == Faults(delay_release=2.5)
    assert Faults.from_args(argparse.Namespace(faults="step_delay=1")) == Faults(step_delay=1.0)
    for module in ("baton.services.prefill", "baton.services.decode"):
        r = run("-m", module, "--help")
        assert r.returncode == 0 and "--faults" not in r.stdout and "--fault-" not in r.stdout
    r = run("-m", "baton.services.prefill", "--faults", "explode=1")
    assert r.returncode == 2 and "unknown fault 'explode'" in r.stderr


def test_baton_up_takes_the_devices_and_dtypes_a_worker_takes():
    """baton up reuses the worker's declarations where its copies had drifted (float16,
    cuda:N were refused)."""
    from baton.cli.main import parser

    a = parser().parse_args(["up", "--dtype", "float16", "--device", "cuda:1"])
    assert (a.dtype, a.device) == ("float16", "cuda:1")
    r = run("-m", "baton.cli.main", "up", "--device", "gpu7")
    assert r.returncode == 2 and "'gpu7': want auto, cpu, cuda or cuda:N" in r.stderr


def test_an_unresolvable_hostname_without_a_route_names_advertise_host(monkeypatch):
    """--host 0.0.0.0 in a namespace whose hostname resolves nowhere and that has no route
    out: one line naming --advertise-host, not a socket.gaierror traceback."""
    import socket
    from types import SimpleNamespace

    from baton.services.common.process import advertised_host

    def unresolvable(name):
        raise socket.gaierror(-3, "Temporary failure in name resolution")

    class NoRoute(socket.socket):
        def connect(self, address):
            raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(socket, "gethostbyname", unresolvable)
    monkeypatch.setattr(socket, "socket", NoRoute)
    with pytest.raises(SystemExit, match="--advertise-host"):
        advertised_host(SimpleNamespace(host="0.0.0.0", advertise_host=None))
    assert advertised_host(SimpleNamespace(host="0.0.0.0", advertise_host="10.0.0.7")) \
        == "10.0.0.7"


def test_a_cpu_pools_size_comes_from_kv_cache_gb_then_the_environment(monkeypatch):
    """--kv-cache-gb sizes a CPU worker's pool when --num-blocks is not given, else
    $BATON_KV_CACHE_GB, else 1 GiB; sizes that are not positive numbers, both flags at once, and
    the flag on a GPU are refused naming what was wrong."""
    from dataclasses import replace

    from baton.services.common.config import EngineSettings

    base = EngineSettings(None, "float32", None, 16, 8, None, device="cpu")
    monkeypatch.delenv("BATON_KV_CACHE_GB", raising=False)
    assert base.engine_config(False).kv_cache_bytes == 1 << 30
    monkeypatch.setenv("BATON_KV_CACHE_GB", "0.5")
    assert base.engine_config(False).kv_cache_bytes == 1 << 29
    assert replace(base, kv_cache_gb=0.125).engine_config(False).kv_cache_bytes == 1 << 27
    cfg = replace(base, num_blocks=40).engine_config(False)
    assert (cfg.num_kv_blocks, cfg.kv_cache_bytes) == (40, 1 << 30)  # blocks rule; the
    # variable is a default, not a request
    for bad, says in ((replace(base, kv_cache_gb=0.0), "--kv-cache-gb 0: a KV pool size"),
                      (replace(base, kv_cache_gb=-1.0), "--kv-cache-gb -1: a KV pool size"),
                      (replace(base, kv_cache_gb=1.0, num_blocks=8), "give one"),
                      (replace(base, kv_cache_gb=1.0, device="cuda"),
                       "on cuda the pool is what --gpu-memory-utilization leaves")):
        with pytest.raises(ValueError, match=re.escape(says)):
            bad.engine_config(False)
    monkeypatch.setenv("BATON_KV_CACHE_GB", "lots")
    with pytest.raises(ValueError, match=re.escape("$BATON_KV_CACHE_GB='lots'")):
        base.engine_config(False)
    monkeypatch.setenv("BATON_KV_CACHE_GB", "0.5")
    cfg = replace(base, device="cuda").engine_config(False)  # a GPU pool ignores the variable
    assert cfg.kv_cache_bytes == 1 << 30
    r = run("-m", "baton.cli.main", "up", "--kv-cache-gb", "0.5", "--num-blocks", "64")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == ("error: --kv-cache-gb and --num-blocks both size the KV pool: "
                                "give one")


@pytest.mark.slow  # a worker process, ~3 s
def test_a_worker_started_with_kv_cache_gb_holds_that_much(tiny_llama, monkeypatch):
    """A real worker: the pool --kv-cache-gb asks for, over the variable the suite sets for
    every worker (tests/conftest.py), in blocks of the model's size, as Info and the log say."""
    from baton.engine.loader import load_model
    from baton.services.launch.local import WorkerProcess

    monkeypatch.setenv("BATON_KV_CACHE_GB", "0.25")
    model = load_model(tiny_llama[0])
    c = model.config
    block = 16 * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4  # 16 tokens, k and v, fp32
    w = WorkerProcess("prefill", ["--model", str(tiny_llama[0]), "--threads", "1",
                                  "--metrics-port", "-1", "--kv-cache-gb", "0.0625"])
    try:
        assert w.info().num_blocks == (1 << 26) // block
        assert f"{(1 << 26) // block} blocks of {block // 1024} KiB (0.06 GiB)" in w.log_tail()
    finally:
        w.stop()
