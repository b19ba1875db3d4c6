"""Processes around the engine: router, prefill worker, decode worker, shared bootstrap."""
