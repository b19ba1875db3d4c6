"""The engine configuration of the greedy references tests compare a cluster with."""

from __future__ import annotations

from baton.engine.config import EngineConfig

# 512 blocks of 16 tokens: the longest context of the models tests serve (SmolLM2's 8,192) in
# one sequence, so any reference a test asks for fits, in a pool of ~360 MiB for SmolLM2 and a
# few MiB for the tiny models, not the default 1 GiB, which each engine's start faults in
# (seconds of the kernel's time a start here, on the suite's two cores). A batch the pool
# cannot hold at once runs in turns; the tests already hold greedy tokens to be the same
# however a batch is made up (a cluster batches otherwise than the reference).
REFERENCE_POOL = EngineConfig(num_kv_blocks=512)
