"""Tokenizers behind one small interface: HF tokenizers, sentencepiece models and a built-in
character tokenizer for the tiny CPU quickstart model.

Every adapter exposes the same surface (:class:`Tokenizer`): ``encode`` / ``decode``,
``eos_token_id``, ``pad_token_id``, ``bos_token_id``, ``stop_token_ids()``, ``vocab_size``,
``apply_chat_template(messages) -> str``, ``encode_prompt_texts(texts)`` and
``encode_chat(messages) -> ids``. Chat-formatted text already carries its special tokens, so
it is encoded without adding more (the sentencepiece adapter, whose chat format is plain
text, prepends BOS).

:func:`load_tokenizer` picks the adapter from a spec string: ``"char"``, a ``.gguf`` file, a
sentencepiece ``.model`` file, or a HF tokenizer directory.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Any, Optional, Sequence

__all__ = [
    "Tokenizer", "HFTokenizer", "SentencePieceTokenizer", "CharTokenizer", "TokenizerError",
    "load_tokenizer", "simple_chat_text",
]

_LOG = logging.getLogger(__name__)
Messages = Sequence[dict]
# Tokens that end an assistant turn in common chat formats besides the tokenizer's EOS.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


class TokenizerError(ValueError):
    """A tokenizer could not be loaded or used; the message names the path / spec."""


def simple_chat_text(messages: Messages, add_generation_prompt: bool = True) -> str:
    """Plain-text chat format for tokenizers without a template: ``role: content`` lines."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    text = "\n".join(lines) + "\n"
    return text + "assistant: " if add_generation_prompt else text


class Tokenizer:
    """The interface every adapter implements (subclasses fill in the abstract parts)."""

    name: str = "tokenizer"
    vocab_size: int
    eos_token_id: int
    pad_token_id: int
    bos_token_id: Optional[int] = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's BOS etc. only if ``add_special_tokens``)."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens (EOS, padding, role markers) dropped by default."""
        raise NotImplementedError

    def apply_chat_template(self, messages: Messages, add_generation_prompt: bool = True,
                            tools: Optional[Sequence[dict]] = None) -> str:
        """The prompt text of a chat: ``[{"role": ..., "content": ...}, ...]``. ``tools``: OpenAI-style
        function schemas for templates that render them (the others ignore them)."""
        raise NotImplementedError

    def stop_token_ids(self) -> list[int]:
        """EOS plus the end-of-turn tokens of the chat format, when the vocabulary has them."""
        return [self.eos_token_id]

    def encode_prompt_texts(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of chat-formatted texts (the template already holds its special tokens)."""
        return [self.encode(t, add_special_tokens=False) for t in texts]

    def encode_chat(self, messages: Messages, add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids of a chat: :meth:`apply_chat_template` then :meth:`encode_prompt_texts`."""
        return self.encode_prompt_texts([self.apply_chat_template(messages, add_generation_prompt)])[0]

    def batch_decode(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """:meth:`decode` for each row."""
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size}, "
                f"eos={self.eos_token_id}, pad={self.pad_token_id})")


class HFTokenizer(Tokenizer):
    """Adapter over a ``transformers`` tokenizer (fast or slow, GGUF-backed included)."""

    def __init__(self, tok: Any, name: str = "hf") -> None:
        self.tok = tok
        self.name = name
        if tok.eos_token_id is None:
            raise TokenizerError(f"tokenizer {name!r} defines no EOS token")
        self.eos_token_id = int(tok.eos_token_id)
        self.pad_token_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        self.bos_token_id = None if tok.bos_token_id is None else int(tok.bos_token_id)
        self.vocab_size = len(tok)  # includes added tokens
        self.has_chat_template = bool(getattr(tok, "chat_template", None))
        if not self.has_chat_template:
            _LOG.warning("tokenizer %s has no chat template; using plain 'role: content' lines", name)

    def stop_token_ids(self) -> list[int]:
        ids = [self.eos_token_id]
        vocab = self.tok.get_vocab()
        ids += [vocab[t] for t in _END_OF_TURN if t in vocab and vocab[t] not in ids]
        return ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Messages, add_generation_prompt: bool = True,
                            tools: Optional[Sequence[dict]] = None) -> str:
        if not self.has_chat_template:
            return simple_chat_text(messages, add_generation_prompt)
        extra = {"tools": list(tools)} if tools else {}
        return self.tok.apply_chat_template(list(messages), tokenize=False,
                                            add_generation_prompt=add_generation_prompt, **extra)

    def encode_prompt_texts(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        return [list(ids) for ids in self.tok(list(texts), add_special_tokens=False)["input_ids"]]


class SentencePieceTokenizer(Tokenizer):
    """Adapter over a raw sentencepiece ``.model`` (plain-text chat format, BOS prepended)."""

    def __init__(self, model_file: str) -> None:
        # optional dependency (sentencepiece): only this path needs it
        import sentencepiece as spm

        self.name = model_file
        self.sp = spm.SentencePieceProcessor(model_file=model_file)
        if self.sp.eos_id() < 0:
            raise TokenizerError(f"sentencepiece model {model_file} defines no EOS piece")
        self.eos_token_id = int(self.sp.eos_id())
        self.pad_token_id = int(self.sp.pad_id() if self.sp.pad_id() >= 0 else self.sp.eos_id())
        self.bos_token_id = int(self.sp.bos_id()) if self.sp.bos_id() >= 0 else None
        self.vocab_size = int(self.sp.get_piece_size())

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = list(self.sp.encode(text, out_type=int))
        if add_special_tokens and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if not (self.sp.is_control(i) or self.sp.is_unknown(i))]
        return self.sp.decode(ids)

    def apply_chat_template(self, messages: Messages, add_generation_prompt: bool = True,
                            tools: Optional[Sequence[dict]] = None) -> str:
        return simple_chat_text(messages, add_generation_prompt)

    def encode_prompt_texts(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t, add_special_tokens=True) for t in texts]  # plain text: prepend BOS


class CharTokenizer(Tokenizer):
    """One id per character plus a few special tokens; no files needed.

    Ids 0-6 are ``<pad> <s> </s> <unk> <|system|> <|user|> <|assistant|>``, then one id per
    character of ``alphabet`` (default: printable ASCII and newline, 103 ids in all). The chat
    format is ``<s><|user|>content<|assistant|>``; assistant turns in the history end with
    ``</s>``. Special-token strings inside text are encoded as their single ids; characters
    outside the alphabet become ``<unk>``. Decoding drops the structural specials (padding,
    BOS/EOS, role markers) but shows ``<unk>`` and out-of-vocabulary ids as U+FFFD.
    """

    SPECIALS = ("<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>")
    DEFAULT_ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n"
    INVALID = "\ufffd"

    def __init__(self, alphabet: Optional[str] = None) -> None:
        alphabet = self.DEFAULT_ALPHABET if alphabet is None else alphabet
        if len(set(alphabet)) != len(alphabet):
            raise TokenizerError("CharTokenizer alphabet has repeated characters")
        self.name = "char"
        self.alphabet = alphabet
        self._specials = {s: i for i, s in enumerate(self.SPECIALS)}
        self._char_to_id = {c: i + len(self.SPECIALS) for i, c in enumerate(alphabet)}
        self._id_to_str = list(self.SPECIALS) + list(alphabet)
        self.pad_token_id, self.bos_token_id, self.eos_token_id, self.unk_token_id = 0, 1, 2, 3
        self.vocab_size = len(self._id_to_str)
        self._split = re.compile("(" + "|".join(re.escape(s) for s in self.SPECIALS) + ")")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [self.bos_token_id] if add_special_tokens else []
        for piece in self._split.split(text):
            if piece in self._specials:
                ids.append(self._specials[piece])
            else:
                ids.extend(self._char_to_id.get(c, self.unk_token_id) for c in piece)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. ``<unk>`` and ids past the vocabulary (a model whose embedding is
        larger than the tokenizer can sample them) decode to U+FFFD, never to nothing, so they
        cannot hide inside an otherwise correct answer."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.unk_token_id or not 0 <= i < self.vocab_size:
                out.append(self.INVALID if skip_special_tokens or i != self.unk_token_id else "<unk>")
            elif not (skip_special_tokens and i < len(self.SPECIALS)):
                out.append(self._id_to_str[i])
        return "".join(out)

    def apply_chat_template(self, messages: Messages, add_generation_prompt: bool = True,
                            tools: Optional[Sequence[dict]] = None) -> str:
        parts = ["<s>"]
        for m in messages:
            role = m["role"]
            if role not in ("system", "user", "assistant"):
                raise TokenizerError(f"CharTokenizer chat format has no role {role!r}")
            parts.append(f"<|{role}|>{m['content']}" + ("</s>" if role == "assistant" else ""))
        if add_generation_prompt:
            parts.append("<|assistant|>")
        return "".join(parts)


def _hf_from_pretrained(path: str, **kwargs: Any) -> HFTokenizer:
    try:
        # optional dependency (transformers, sentencepiece, tokenizers): only this path needs it
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - transformers is in the hf extra
        raise TokenizerError(f"loading tokenizer {path} needs `pip install transformers` "
                             f"(hyflow[hf])") from exc
    try:
        tok = AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as exc:  # noqa: BLE001 - re-raised with the path named
        where = f"{path} ({kwargs['gguf_file']})" if "gguf_file" in kwargs else path
        raise TokenizerError(f"could not load a HF tokenizer from {where}: {exc}") from exc
    name = os.path.join(path, kwargs["gguf_file"]) if "gguf_file" in kwargs else path
    return HFTokenizer(tok, name=name)


def load_tokenizer(spec: str) -> Tokenizer:
    """Load a tokenizer from ``spec``.

    * ``"char"`` -- the built-in :class:`CharTokenizer`;
    * ``path/to/file.gguf`` -- the tokenizer embedded in a GGUF checkpoint;
    * ``path/to/file.model`` -- a raw sentencepiece model;
    * a directory -- HF files (``tokenizer.json`` / ``tokenizer_config.json``), else a single
      ``*.gguf`` in it, else a sentencepiece ``tokenizer.model``;
    * anything else is passed to ``AutoTokenizer.from_pretrained`` (a hub name).
    """
    if not spec:
        raise TokenizerError("empty tokenizer spec: set data.tokenizer")
    if spec == "char":
        return CharTokenizer()
    path = os.path.expanduser(spec)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise TokenizerError(f"tokenizer file not found: {path}")
        return _hf_from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    if path.endswith(".model"):
        if not os.path.isfile(path):
            raise TokenizerError(f"sentencepiece model not found: {path}")
        return SentencePieceTokenizer(path)
    if os.path.isdir(path):
        files = set(os.listdir(path))
        if files & {"tokenizer.json", "tokenizer_config.json", "vocab.json"}:
            return _hf_from_pretrained(path)
        ggufs = sorted(f for f in files if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return _hf_from_pretrained(path, gguf_file=ggufs[0])
        if "tokenizer.model" in files:
            return SentencePieceTokenizer(os.path.join(path, "tokenizer.model"))
        found = ", ".join(sorted(files)[:10]) or "nothing"
        raise TokenizerError(
            f"no tokenizer in directory {path}: looked for tokenizer.json / tokenizer_config.json, "
            f"a single *.gguf or tokenizer.model; found {found}")
    if spec.startswith(("/", ".", "~")) or spec.count("/") > 1:
        raise TokenizerError(f"tokenizer path not found: {path}")
    return _hf_from_pretrained(spec)
