"""Baton decode service."""
