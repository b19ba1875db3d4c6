"""The engine configuration of the greedy references tests compare a cluster with."""

from __future__ import annotations

from baton.engine.config import EngineConfig

# 512 blocks of 16 tokens: the longest context of the models tests serve (SmolLM2's 8,192) in
# one sequence, so any reference a test asks for fits, in a pool of ~360 MiB for SmolLM2 and a
# few MiB for the tiny models, not the default 1 GiB, which each engine's start faults in
# (seconds of the kernel's time a start here, on the suite's two cores). Greedy tokens do not
# depend on the pool's size: a batch it cannot hold is run in turns.
REFERENCE_POOL = EngineConfig(num_kv_blocks=512)
