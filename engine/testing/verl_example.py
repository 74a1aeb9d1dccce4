"""The files docs/verl.md's command runs on, at test size: a tiny random HF Llama with a
character-level tokenizer (an HF directory, as ``actor_rollout_ref.model.path`` expects), verl-format
train / test parquet files of single-digit additions and a verl ``compute_score`` file."""

from __future__ import annotations

import os
import re
import shlex

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hyflow.data.dataset import write_rows
from hyflow.data.tasks import make_task_rows
from hyflow.testing.tiny_models import make_tiny_hf_model

#: the characters of the tokenizer, after its special tokens
CHARS = "0123456789+-=*/ "
REWARD_FILE = '''"""verl's compute_score: 1 for the right sum, and a 0.1 partial credit per digit answered (at most 2)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answer = solution_str.strip()
    right = float(answer == str(ground_truth))
    return {"score": right + 0.1 * min(sum(c.isdigit() for c in answer), 2), "acc": right}
'''


def write_char_hf_tokenizer(path: str) -> str:
    """An HF fast tokenizer over :data:`CHARS` (one token per character, ``<eos>``, ``<pad>``) whose
    chat template is the messages' contents; saved to the directory ``path``."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(path)
    return path


def make_verl_example(root: str, train_rows: int = 80, test_rows: int = 12) -> dict[str, str]:
    """``{"MODEL": ..., "DATA": ...}`` under ``root``: the tiny model (2 layers, hidden 64) and
    ``train.parquet``, ``test.parquet``, ``reward.py``."""
    model, data = os.path.join(root, "model"), os.path.join(root, "data")
    os.makedirs(data, exist_ok=True)
    make_tiny_hf_model(model, "llama_tied", num_hidden_layers=2, max_position_embeddings=64, rope_scaling=None,
                       vocab_size=32, bos_token_id=None, eos_token_id=1, pad_token_id=0)
    write_char_hf_tokenizer(model)
    write_rows(make_task_rows("digit_add", train_rows, seed=1), os.path.join(data, "train.parquet"))
    write_rows(make_task_rows("digit_add", test_rows, seed=2), os.path.join(data, "test.parquet"))
    with open(os.path.join(data, "reward.py"), "w") as f:
        f.write(REWARD_FILE)
    return {"MODEL": model, "DATA": data}


def documented_command(doc_path: str, env: dict[str, str]) -> list[str]:
    """The arguments after ``hyflow`` of the ``bash`` block following ``<!-- verl-command -->`` in
    ``doc_path``, with ``$NAME`` replaced from ``env`` (the command exactly as documented)."""
    text = open(doc_path, encoding="utf-8").read()
    block = re.search(r"<!-- verl-command -->\s*```bash\n(.*?)```", text, re.S)
    if block is None:
        raise ValueError(f"{doc_path} has no <!-- verl-command --> bash block")
    line = block.group(1).replace("\\\n", " ")
    line = re.sub(r"\$(\w+)", lambda m: env[m.group(1)], line)
    args = shlex.split(line)
    if args[:1] != ["hyflow"]:
        raise ValueError(f"the documented command does not start with hyflow: {args[:3]}")
    return args[1:]
