"""Baton's engine: dense and mixture-of-experts decoders (docs/engine.md, "Model families"),
paged KV cache, continuous-batching scheduler, sampler.

Nothing here knows about gRPC, Redis or Ray. Import the pieces from their modules
(``baton.engine.engine.LLMEngine``, ``baton.engine.block_hash``...); this ``__init__`` stays empty
so that torch-free modules such as ``block_hash`` can be imported without loading torch.
"""
