"""Baton: disaggregated prefill/decode LLM serving.

Subpackages map to the repository's top-level folders: ``baton.engine`` (model, paged KV cache,
scheduler), ``baton.kernels`` (attention implementations), ``baton.cli`` (the ``baton`` command),
and the service, transfer and control layers built around the engine.
"""

import os
from pathlib import Path

__version__ = "0.1.0"


def cache_dir() -> Path:
    """Where Baton keeps converted weights, `baton profile`'s file and `baton up`'s address:
    ``$BATON_CACHE_DIR``, else ``~/.cache/baton``."""
    return Path(os.environ.get("BATON_CACHE_DIR") or Path.home() / ".cache" / "baton")
