"""Baton prefill service."""
