"""How an FP8 weight's scales are laid out, shared by the loader and the FP8 kernels (no Triton
here): float32 scales [N, G], one per output row and group of ``group`` columns."""

from __future__ import annotations


def groups(k: int, group: int) -> int:
    """Scale columns of a K-column weight in groups of ``group`` columns (0: one, per row)."""
    return 1 if not group or group >= k else -(-k // group)
