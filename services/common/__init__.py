"""Baton common service."""
