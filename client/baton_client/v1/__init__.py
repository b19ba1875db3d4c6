"""Generated stubs of Baton's public gRPC API (``api.proto``, package ``baton.v1``): this
distribution is their one owner; the server side imports them from here."""
