"""A synthetic `baton profile` for simulator and tuner tests: every step costs 10 ms plus 1 ms
a token (plus what the arguments add), so simulated times can be computed by hand."""

from __future__ import annotations

from baton.control.profile import Profile


def tok(n: int) -> float:
    """Per-token work of the synthetic engine: 10 ms a step plus 1 ms a token."""
    return 0.010 + 0.001 * n


def make_profile(batched: int = 1024, seqs: int = 64, blocks: int = 10_000,
                 per_seq: float = 0.0, attn_decode: float = 0.0, attn_prefill: float = 0.0,
                 handoff=(0.002, 1e-9), block_size: int = 16) -> Profile:
    decode = [{"batch": b, "context": c, "s": tok(b) + per_seq * b + attn_decode * b * c}
              for b, c in ((1, 64), (8, 64), (8, 512), (32, 256))]
    longs = [{"tokens": n, "s": tok(n) + attn_prefill * n * (n + 1) / 2} for n in (128, 512)]
    return Profile(
        model="synthetic", dtype="float32", threads=1, block_size=block_size,
        max_num_batched_tokens=batched, max_num_seqs=seqs, num_blocks=blocks,
        kv_bytes_per_token=1000,
        prefill=[{"tokens": n, "requests": 1, "s": tok(n)} for n in (1, 16, 256, 1024)],
        prefill_long=longs, decode=decode,
        handoff=[{"tokens": n, "bytes": n * 1000, "s": handoff[0] + handoff[1] * n * 1000}
                 for n in (64, 1024)],
        router_s=0.004)
