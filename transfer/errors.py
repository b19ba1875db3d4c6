"""Typed errors of a KV hand-off. Each says which peer and which lease it concerns."""

from __future__ import annotations

from baton.engine.errors import BatonError


class TransferError(BatonError):
    """A hand-off failed; the reader's blocks for it have been (or must be) freed."""


class FingerprintMismatchError(TransferError):
    """Holder and reader run different models, dtypes, block sizes or KV layouts."""

    def __init__(self, ours: str, theirs: str, peer: str, detail: str = "") -> None:
        self.ours, self.theirs, self.peer = ours, theirs, peer
        super().__init__(detail or f"peer {peer} has model fingerprint {theirs[:16]}..., "
                         f"this worker {ours[:16]}...: refusing to exchange KV")


def kv_dtype_name(kv) -> str:
    """A KV pool's element type as the handshake names it: ``bfloat16``, ``float8_e4m3fn``."""
    return str(kv.dtype).removeprefix("torch.")


def kv_dtype_mismatch(holder: str, holder_dtype: str, reader: str, reader_dtype: str) -> str:
    return (f"KV cache dtype mismatch: holder {holder} stores {holder_dtype}, reader {reader} "
            f"{reader_dtype}; blocks of one cannot be read as the other (start both pools "
            "with the same --kv-cache-dtype)")


class LeaseLostError(TransferError):
    """The holder's lease ended (expired, or the holder restarted) before the read was released:
    what was read may have been overwritten, so it is discarded."""

    def __init__(self, lease_id: str, peer: str, reason: str) -> None:
        self.lease_id, self.peer, self.reason = lease_id, peer, reason
        super().__init__(f"lease {lease_id} at {peer} was not intact: {reason}")


class PeerUnavailableError(TransferError):
    """The holder cannot be reached, died, or restarted (a new incarnation) during the hand-off."""


class TransferDeadlineError(TransferError):
    """The hand-off did not finish within its deadline."""


class ChecksumMismatchError(TransferError):
    """Per-block checksums (a debugging option) disagree after the read."""


class ReadInFlightError(TransferDeadlineError):
    """A READ passed its deadline and the transport could not cancel it: it may still write
    into the reader's blocks. The reader must not reuse them until ``read.settled()`` says the
    transfer reached a terminal state (or its peer was removed)."""

    def __init__(self, message: str, read) -> None:
        self.read = read  # baton.transfer.agent.InFlightRead
        super().__init__(message)
