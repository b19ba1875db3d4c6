"""Launchers: start Baton worker processes on this machine (``local``) or as Ray actors
(``ray_actors``), for ``baton up``, the benchmarks and the tests. No service imports them."""
