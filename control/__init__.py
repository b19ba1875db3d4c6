"""Cluster control: worker registry, prefix index, autoscaling policies, ratio tuner.

Shares the block-hash contract with the engine through :mod:`baton.engine.block_hash`, which has no
torch dependency so that router-side code can import it.
"""
