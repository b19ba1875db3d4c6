"""Tokenizer and chat template, taken from the model files (GGUF metadata or tokenizer.json)."""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from pathlib import Path

import jinja2
import jinja2.sandbox
from baton.engine.errors import InvalidRequestError, UnsupportedModelError
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
_CONTROL, _USER_DEFINED = 3, 4


class BatonTokenizer:
    """Wraps a ``tokenizers.Tokenizer`` with the model's BOS/EOS conventions and chat template."""

    def __init__(
        self, tk: Tokenizer, bos_token_id: int | None, eos_token_ids: Sequence[int],
        chat_template: str | None, add_bos: bool,
    ) -> None:
        self.tk = tk
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)

    # ---- text <-> ids -------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tk.encode(text, add_special_tokens=False).ids
        if (add_special_tokens and self.add_bos and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_str(self, token_id: int) -> str:
        return self.tk.id_to_token(token_id) or ""

    # ---- chat ---------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            **template_kwargs) -> str:
        """The prompt the model's chat template makes of ``messages``, as transformers renders
        it; ``template_kwargs`` are the template's own variables (Qwen3's ``enable_thinking``:
        what OpenAI-style ``chat_template_kwargs`` carry)."""
        if not self.chat_template:
            raise InvalidRequestError("messages", "...", "this model has no chat template")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InvalidRequestError(f"messages[{i}]", m, "needs 'role' and 'content'")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

        def raise_exception(msg: str) -> None:
            raise InvalidRequestError("messages", "...", f"chat template: {msg}")

        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False,
                                                                   indent=indent)
        bos = self.token_to_str(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.token_to_str(self.eos_token_ids[0]) if self.eos_token_ids else ""
        return env.from_string(self.chat_template).render(
            **template_kwargs, messages=list(messages),
            add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos,
        )

    def encode_chat(self, messages: Sequence[dict], **template_kwargs) -> list[int]:
        # the template already writes any BOS it wants (Hugging Face does the same)
        return self.encode(self.apply_chat_template(messages, **template_kwargs),
                           add_special_tokens=False)

    # ---- construction -------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"tokenizer": self.tk.to_str(), "bos_token_id": self.bos_token_id,
                "eos_token_ids": list(self.eos_token_ids), "chat_template": self.chat_template,
                "add_bos": self.add_bos}

    @classmethod
    def from_json(cls, d: dict) -> BatonTokenizer:
        return cls(Tokenizer.from_str(d["tokenizer"]), d["bos_token_id"], d["eos_token_ids"],
                   d["chat_template"], d["add_bos"])

    @classmethod
    def from_gguf_fields(cls, f: dict) -> BatonTokenizer:
        kind = f.get("tokenizer.ggml.model")
        arch = f.get("general.architecture")
        if kind == "llama" and arch == "gemma3":
            tk = _gemma_sentencepiece(f)
        elif kind == "gpt2":
            tk = _byte_level_bpe(f)
        else:
            raise UnsupportedModelError(
                f"GGUF tokenizer.ggml.model={kind!r} (architecture {arch!r}) is not supported: "
                "byte-level BPE ('gpt2') for any architecture, SentencePiece ('llama') for gemma3")
        tokens: list[str] = list(f["tokenizer.ggml.tokens"])
        types = list(f.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        vocab = tk.get_vocab()
        tk.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
             if ty == _CONTROL])
        tk.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
             if ty == _USER_DEFINED and t in vocab])
        eos = f.get("tokenizer.ggml.eos_token_id")
        eos_ids = [eos] if eos is not None else []
        eot = f.get("tokenizer.ggml.eot_token_id")
        if eot is not None and eot not in eos_ids:
            eos_ids.append(eot)
        return cls(tk, f.get("tokenizer.ggml.bos_token_id"), eos_ids,
                   f.get("tokenizer.chat_template"), bool(f.get("tokenizer.ggml.add_bos_token")))
    @classmethod
    def from_hf_dir(cls, path: Path, eos_token_ids: Sequence[int]) -> BatonTokenizer:
        tk = Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}

        def token_id(name: str) -> int | None:
            tok = cfg.get(name)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return tk.token_to_id(tok) if tok else None

        template = cfg.get("chat_template")
        tmpl_file = path / "chat_template.jinja"
        if template is None and tmpl_file.exists():
            template = tmpl_file.read_text()
        eos = list(eos_token_ids) or [i for i in [token_id("eos_token")] if i is not None]
        return cls(tk, token_id("bos_token"), eos, template, bool(cfg.get("add_bos_token", False)))


def _byte_level_bpe(f: dict) -> Tokenizer:
    """GGUF ``gpt2`` tokenizers: byte-level BPE with the file's merges."""
    tokens: list[str] = list(f["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in f["tokenizer.ggml.merges"]]
    tk = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if f.get("tokenizer.ggml.pre") in ("smollm", "qwen2", "llama-bpe", "llama3"):
        # these pre-tokenizers split digits apart before the byte-level regex (llama.cpp)
        digits = pre_tokenizers.Digits(individual_digits=f.get("tokenizer.ggml.pre") == "smollm")
        tk.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        tk.pre_tokenizer = byte_level
    tk.decoder = decoders.ByteLevel()
    return tk


def _gemma_sentencepiece(f: dict) -> Tokenizer:
    """Gemma's SentencePiece vocabulary from GGUF metadata, as transformers builds it from the
    same file (``from_pretrained(gguf_file=...)``): BPE with byte fallback over spaces spelled
    "▁", merges recovered from the vocabulary. Two Gemma quirks: a token of spaces is
    stored with real spaces (respelled "▁"), and the file's order of tokens, not their
    scores, is the merge priority."""
    tokens = ["▁" * len(t) if " " in t and not t.strip() else t
              for t in f["tokenizer.ggml.tokens"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = f.get("tokenizer.ggml.unknown_token_id")
    tk = Tokenizer(models.BPE(vocab, _merges_by_rank(tokens, vocab), fuse_unk=True,
                              unk_token=tokens[unk] if unk is not None else "<unk>",
                              byte_fallback=True))
    tk.normalizer = normalizers.Replace(" ", "▁")
    tk.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse()])
    return tk


def _merges_by_rank(tokens: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens of the vocabulary, as a merge ranked by the
    token's place in the file (earlier: applied first); a token's own splits with the longer
    left part first (then the longer right one, then the parts' ids)."""
    rank = {t: -i for i, t in enumerate(tokens)}  # the last of a repeated token wins
    merges = []
    for token, score in rank.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        merges.extend((left, right, score) for left, right in pairs)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting UTF-8 characters.

    Decodes a small window (``prefix_offset``..end) and emits what grew past ``read_offset``; a
    window that ends in U+FFFD is an incomplete multi-byte character and waits for more tokens.
    A few prompt tokens seed the window so that tokenizers that drop a leading space still agree.
    """

    def __init__(self, tokenizer: BatonTokenizer, prompt_ids: Sequence[int]) -> None:
        self.tok = tokenizer
        self.ids = list(prompt_ids[-5:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]
