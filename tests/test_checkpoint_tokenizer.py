"""Training checkpoints carry their tokenizer: every saved model's ``model.json`` names a
tokenizer that exists (copied beside it), so ``hyflow generate --ckpt`` and ``hyflow export``
work on a checkpoint alone, also after the run directory is moved."""

import json
import os
import shutil

import pytest

from hyflow.checkpoint.model import read_description, resolve_tokenizer, store_tokenizer
from hyflow.testing import run_on_ranks
from hyflow.testing.fixtures import write_tiny_hf_tokenizer


def test_store_tokenizer_copies_directories_and_references_the_rest(tmp_path, monkeypatch):
    tok = write_tiny_hf_tokenizer(str(tmp_path / "tok"))
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    assert store_tokenizer(tok, str(model_dir)) == "tokenizer"
    assert sorted(os.listdir(model_dir / "tokenizer")) == sorted(os.listdir(tok))
    assert resolve_tokenizer(str(model_dir), "tokenizer") == str(model_dir / "tokenizer")
    spm = tmp_path / "sp.model"
    spm.write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    assert store_tokenizer("sp.model", str(model_dir)) == str(spm)           # a file: absolute path
    assert store_tokenizer("char", str(model_dir)) == "char"
    assert resolve_tokenizer(str(model_dir), "char") == "char"               # a name, not a path
    assert store_tokenizer("org/some-hub-name", str(model_dir)) == "org/some-hub-name"
    assert store_tokenizer(None, str(model_dir)) is None


def _save(out: str, tokenizer: str) -> None:
    """Rank function: save a tiny model as a trained actor and a frozen reference."""
    from hyflow.models.builder import build_gpt_model
    from hyflow.models.description import ModelDescription
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.checkpoint.checkpointer import Checkpointer, TrainedModel

    desc = ModelDescription(family="llama", vocab_size=16, hidden_size=16, num_layers=1, num_attention_heads=2,
                            num_query_groups=1, ffn_hidden_size=32, max_position_embeddings=32,
                            tokenizer="tokenizer")   # as a converted checkpoint's model.json says
    groups = init_training_groups(Layout())
    model = build_gpt_model(desc, groups)
    ckpt = Checkpointer(out, groups, desc, tokenizer=tokenizer, log=lambda m: None)
    ckpt.save(1, {"actor": TrainedModel([model])}, {}, frozen={"reference": model})
    ckpt.close()


@pytest.mark.multirank
def test_saved_models_name_a_tokenizer_that_exists_and_export_copies_it(tmp_path, capsys):
    from transformers import AutoTokenizer

    from hyflow.cli import main
    from hyflow.data.tokenizer import load_tokenizer

    tok = write_tiny_hf_tokenizer(str(tmp_path / "tok"))
    run_on_ranks(_save, 1, str(tmp_path / "run"), tok, timeout=300)
    moved = tmp_path / "moved"
    shutil.move(str(tmp_path / "run"), moved)    # the checkpoints must not point back into the run
    shutil.rmtree(tok)                           # ... nor at the original tokenizer
    step = moved / "checkpoints" / "step_000001"
    for model_dir in (step / "actor", moved / "checkpoints" / "reference"):
        assert json.loads((model_dir / "model.json").read_text())["tokenizer"] == "tokenizer"
        desc = read_description(str(model_dir))
        assert desc.tokenizer == str(model_dir / "tokenizer")
        assert load_tokenizer(desc.tokenizer).encode_chat([{"role": "user", "content": "what is 2"}]) \
            == [2, 4, 6, 7, 8, 3, 2, 5]
    hf = str(tmp_path / "hf")
    assert main(["export", "--ckpt", str(moved), "--out", hf]) == 0
    assert AutoTokenizer.from_pretrained(hf).convert_tokens_to_ids("assistant") == 5
