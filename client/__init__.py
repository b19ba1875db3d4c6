"""gRPC client SDK for Baton's public API."""
