"""A greedy reference for the sampling fields: transformers' logits, processed token by token as
OpenAI documents the penalties and vLLM the repetition penalty (tests/unit/test_sampling_fields.py,
tests/integration/test_sampling_fields_cluster.py)."""

from __future__ import annotations

import torch
from baton.engine.params import SamplingParams


def reference_greedy(hf, prompt, n, params: SamplingParams, prefix: int) -> list[int]:
    """Greedy over transformers' logits with :func:`process`'s arithmetic written out here."""
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            row = hf(torch.tensor([ids])).logits[0, -1].float()
            earlier = list(prompt[len(prompt) - prefix:]) + out
            for tok in set(ids):
                r = params.repetition_penalty
                row[tok] = row[tok] / r if row[tok] > 0 else row[tok] * r
            for tok in set(earlier):
                row[tok] -= (params.frequency_penalty * earlier.count(tok)
                             + params.presence_penalty)
            for tok, b in params.logit_bias:
                row[tok] += b
            out.append(int(row.argmax()))
            ids.append(out[-1])
    return out
