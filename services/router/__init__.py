"""Baton router service."""
