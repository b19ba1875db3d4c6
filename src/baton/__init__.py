"""Baton: disaggregated prefill/decode LLM serving.

Subpackages map to the repository's top-level folders: ``baton.engine`` (model, paged KV cache,
scheduler), ``baton.kernels`` (attention implementations), ``baton.cli`` (the ``baton`` command),
and the service, transfer and control layers built around the engine.
"""

__version__ = "0.1.0"
