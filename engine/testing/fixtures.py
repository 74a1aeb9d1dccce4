"""Small files that tests build on the fly (no model hub at test time)."""
from __future__ import annotations

#: The words of :func:`write_tiny_hf_tokenizer`'s vocabulary, in id order.
TINY_HF_WORDS = ("<unk>", "<eos>", "<|im_start|>", "<|im_end|>", "user", "assistant", "what", "is", "2", "+",
                 "3", "?")


def write_tiny_hf_tokenizer(path: str) -> str:
    """Save a 12-word, whitespace-split HF fast tokenizer with an im_start/im_end chat template
    to the directory ``path``; returns ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(TINY_HF_WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="<unk>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
    tok.save_pretrained(path)
    return path
