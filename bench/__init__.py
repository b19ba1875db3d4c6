"""``baton bench``: the load generator (``loadgen``), its commands (``cli``, ``compare``), and
the benchmark scripts that measure Baton against its peers and the hardware."""
