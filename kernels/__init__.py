"""Attention and KV-cache kernels: torch reference implementations (CPU) and, on CUDA, Triton."""
