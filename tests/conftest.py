"""Shared builders: tiny random models (Hugging Face directory and GGUF), engine helpers, and the
one fixture that starts clusters of real processes (tests/support/cluster.py)."""

from __future__ import annotations

import pytest
import torch
from baton.bench.tiny_model import CORPUS, make_hf_model, write_tokenizer  # noqa: F401


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="no CUDA device")
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(skip)


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
