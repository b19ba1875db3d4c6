"""Shared builders: tiny random models (Hugging Face directory and GGUF), engine helpers, and the
one fixture that starts clusters of real processes (tests/support/cluster.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The repository's top-level folders are Baton's packages under the `baton.` prefix (kernels/ is
# baton.kernels, engine/ baton.engine): at the front of sys.path (`python -m pytest` puts the
# working directory there, pytest's default import mode the repository) they shadow PyPI
# packages of the same names. transformers 5.25 imports the `kernels` package it depends on and
# found ours: every test with a Hugging Face reference failed with "cannot import name
# 'CUDAProperties' from 'kernels'". The repository goes to the back, where the `tests` package
# is still found, and pytest appends rather than prepends (`--import-mode=append`,
# pyproject.toml).
_ROOT = Path(__file__).resolve().parent.parent


def _is_root(entry: str) -> bool:
    try:
        return Path(entry or ".").resolve() == _ROOT
    except OSError:
        return False


sys.path[:] = [e for e in sys.path if not _is_root(e)] + [str(_ROOT)]

from baton.cli.up import threads_each  # noqa: E402 (no torch)

# The cores shared out among the pytest workers (`-n 2` on two cores: one torch thread each),
# as `baton up` shares them among its workers, for this process and, through OMP_NUM_THREADS,
# the processes it starts that set no --threads. With torch's default (a thread per core) in
# every worker, each OpenMP parallel region spin-waits for threads the other worker's
# computation has descheduled: on the 2-vCPU VM, test_smollm2 and test_cluster on two workers
# took 473 s (866 s of CPU) instead of 153 s (243 s).
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _XDIST_WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_each(_XDIST_WORKERS)))

# Every worker the tests start without --num-blocks (test clusters, `baton up`)
# takes a 256 MiB KV pool, not the 1 GiB a CPU worker zero-fills by default: on the
# 2-vCPU VM that 1 GiB took 1-2.4 s of each worker's start (ready in 3.1-4.4 s against 2.0-2.1 s
# with a small pool); in a clean-clone .ci/run the tests' times added to 2,016 s against 2,071 s
# (docs/testing.md). SmolLM2's float32 blocks are the largest here: 256 MiB holds 364 of them
# (5,824 tokens). A test that needs the default sets --num-blocks or --kv-cache-gb itself.
os.environ.setdefault("BATON_KV_CACHE_GB", "0.25")
# ... and on plain pages: on the 2-vCPU Firecracker VM faulting in transparent huge pages costs
# ~8 s of system time a GiB against ~0.5 s (engine/model.py advise_huge_pages), in every fresh
# process; test_transfer.py alone took 100 s (21 s system) against 112 s (35 s), test_cluster.py
# 139 s against 151 s. Nothing here times the engine; tests/unit/test_engine.py checks the
# advice itself.
os.environ.setdefault("BATON_HUGE_PAGES", "0")

import pytest  # noqa: E402 (after OMP_NUM_THREADS, which torch reads as it loads)
import torch  # noqa: E402

if _XDIST_WORKERS > 1:  # if torch had loaded before
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from baton.bench.tiny_model import (  # noqa: E402, F401
    CORPUS,
    make_hf_model,
    write_tokenizer,
)

# The modules that take longest, started first: `pytest -n 2 --dist loadfile
# --no-loadscope-reorder` (README) hands whole modules to the two workers in collection order,
# so these start first and the short ones fill in behind them, instead of a 4-minute module
# starting last while the other worker idles. The order is longest first as measured by
# `pytest -n 2 --dist loadfile --durations=120` on the 2-vCPU VM of docs/testing.md
# (2026-11-27); the seconds per module (setup, calls, teardown) are the clean-clone `.ci/run` of
# b0d92f9 (2026-12-02, `--durations=0`), no longer in that order, kept because with it the two
# workers ended 18 s apart (a new order is a new CI run to check). A module missing here only
# runs later, and a stale order costs time, never a result.
HEAVY_MODULES = [
    "tests/integration/test_smollm2.py",  # 102 s: transformers' reference generations
    "tests/integration/test_cluster.py",  # 169
    "tests/chaos/test_faults.py",  # 144
    "tests/integration/test_transfer.py",  # 113
    "tests/integration/test_gemma3.py",  # 99
    "tests/integration/test_hosts.py",  # 41 (its root built beforehand by .ci/run)
    "tests/integration/test_tensor_parallel_cluster.py",  # 72
    "tests/unit/test_fp8.py",  # 85
    "tests/integration/test_redis_outage.py",  # 93
    "tests/integration/test_families_cluster.py",  # 80
    "tests/unit/test_triton_engine.py",  # 58
    "tests/chaos/test_baton_up.py",  # 71
    "tests/integration/test_bench.py",  # 59
    "tests/integration/test_worker_lifecycle.py",  # 54
    "tests/integration/test_access.py",  # 45
    "tests/unit/test_tune.py",  # 107 (the real `baton profile` 100 of it)
]


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="no CUDA device")
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(skip)
    rank = {m: i for i, m in enumerate(HEAVY_MODULES)}
    # stable: the tests of one module keep their order (module-scoped fixtures), the rest of
    # the modules theirs
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session", autouse=True)
def _temporary_folder_under_pytests(tmp_path_factory):
    """This process's temporary folder, and through ``TMPDIR`` that of every process it starts
    (workers, ``baton up``, Redis), is one under pytest's own base folder, which pytest keeps
    for its last three runs and then removes. A worker a test crashes on purpose keeps its log
    folder (services/launch/local.py), as does a Redis whose ``baton up`` a test SIGKILLs: in
    the system's /tmp a day of test runs left 113 such folders; here they go with the run."""
    import tempfile

    folder = tmp_path_factory.getbasetemp() / "tmp"
    folder.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:  # put back at the session's end
        # Ray keeps its sessions where it did (it reads TMPDIR on Linux): its socket paths under
        # this folder pass the 107 bytes AF_UNIX allows, and `baton up --ray local` fails
        if "RAY_TMPDIR" not in os.environ:
            mp.setenv("RAY_TMPDIR", os.environ.get("TMPDIR", "/tmp"))
        mp.setenv("TMPDIR", str(folder))
        mp.setattr(tempfile, "tempdir", str(folder))
        yield


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    return path, make_hf_model(path, tie_word_embeddings=False)


@pytest.fixture
def tiny_engine(tiny_llama):
    from baton.engine.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.engine.loader import load_model

    model = load_model(tiny_llama[0])

    def build(**cfg):
        cfg.setdefault("num_kv_blocks", 64)
        cfg.setdefault("block_size", 4)
        return LLMEngine(model, EngineConfig(**cfg))

    return build


@pytest.fixture(scope="module")
def start_cluster():
    """``start_cluster(**shape)`` -> a :class:`tests.support.cluster.Cluster` of that shape; every
    cluster the module started is stopped when the module ends (a failed start stops its own
    processes at once)."""
    from tests.support.cluster import Cluster

    made: list[Cluster] = []

    def start(**shape) -> Cluster:
        c = Cluster(**shape)
        made.append(c)
        return c

    yield start
    for c in reversed(made):
        c.stop()
