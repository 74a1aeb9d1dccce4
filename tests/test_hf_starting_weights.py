"""``actor.checkpoint`` = an HF directory (or a ``.gguf`` file): each rank reads its own shards, no
conversion step. At TP=2 x PP=2 the actor's weights are bit-identical to those loaded from the
converted checkpoint (``hyflow convert hf2mcore``), its logits equal theirs exactly and transformers'
to 1e-5, and the run trains; the opt-in cache converts once and is reused."""

from __future__ import annotations

import os

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

TOKENS = [[5, 17, 42, 99, 3, 250, 7], [1, 2, 3, 4, 5, 6, 7]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    pytest.importorskip("transformers")
    from hyflow.tools.convert.hf2mcore import hf2mcore
    from hyflow.testing.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("hf_start")
    hf = str(root / "qwen2")
    model = make_tiny_hf_model(hf, "qwen2", weights_format="sharded")  # Q/K/V biases, untied, sharded files
    with torch.no_grad():
        reference = model(torch.tensor(TOKENS)).logits.float()
    converted = str(root / "qwen2_mcore")
    hf2mcore(hf, converted, tp=1, pp=1, dtype="fp32", log=lambda _: None)
    return hf, converted, reference


def _train_from_hf(hf: str, converted: str, cache: str):
    import torch.distributed as dist

    from hyflow.checkpoint.model import build_model_for_loading, load_model_checkpoint
    from hyflow.testing.rl import rl_setup, rl_step
    from hyflow.tools.convert.verify import forward_logits

    cfg, state, job = rl_setup([
        f"actor.checkpoint={hf}", f"actor.checkpoint_cache={cache}", "actor.layout.tp=2", "actor.layout.pp=2",
        "trainer.nproc=4", "actor.sft_warmup_steps=0", "data.train_batch_size=4", "rollout.n=2",
        "actor.mini_batch_size=8", "actor.micro_batch_size=4", "rollout.max_new_tokens=4",
        "actor.entropy_coeff=0.01"])  # a gradient although a random model scores 0 everywhere
    models = state.models
    actor = models.actor.chunks[0].module
    converted_model = build_model_for_loading(models.desc, models.groups, dtype="fp32", spec=cfg.actor.spec)
    load_model_checkpoint(converted_model, converted, models.groups)
    mine, theirs = dict(actor.named_parameters()), dict(converted_model.named_parameters())
    same = mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    tokens = torch.tensor(TOKENS)
    logits = forward_logits(actor, tokens, models.desc.vocab_size, models.groups)
    converted_logits = forward_logits(converted_model, tokens, models.desc.vocab_size, models.groups)
    metrics, _ = rl_step(cfg, state, job)
    last = models.groups.pp_rank == models.groups.layout.pp - 1 and models.groups.tp_rank == 0
    return (dist.get_rank(), same, logits if last else None, converted_logits if last else None,
            metrics["actor/grad_norm"], cfg.notes)


@pytest.mark.slow
def test_hf_directory_trains_at_tp2_pp2_with_the_converted_checkpoints_logits(models, tmp_path):
    hf, converted, reference = models
    cache = str(tmp_path / "cache")
    out = run_on_ranks(_train_from_hf, 4, hf, converted, cache, timeout=600)
    assert all(same for _, same, *_ in out)  # every rank's shards, bit for bit
    logits = [r for r in out if r[2] is not None]
    assert len(logits) == 1
    _, _, got, conv, grad_norm, notes = logits[0]
    assert torch.equal(got, conv)
    assert float((got - reference).abs().max() / reference.abs().max()) <= 1e-5
    assert grad_norm == grad_norm and grad_norm > 0  # it trained
    # the opt-in cache: a hyflow checkpoint recording its source, reused while the files are unchanged
    from hyflow.checkpoint.model import read_checkpoint_info
    from hyflow.checkpoint.starting_weights import _cache_valid

    assert read_checkpoint_info(cache).extra["converted_from"] == os.path.abspath(hf)
    assert _cache_valid(cache, hf)
    config = os.path.join(hf, "config.json")
    os.utime(config, ns=(1, 1))  # the source changed: the cache is stale
    assert not _cache_valid(cache, hf)


def test_a_bad_hf_model_is_one_error_before_any_rank(models, tmp_path):
    from hyflow.checkpoint.errors import CheckpointError
    from hyflow.checkpoint.starting_weights import check_starting_weights, starting_description

    hf, _, _ = models
    desc = starting_description(hf)
    assert desc.num_layers == 4 and desc.tokenizer is None  # no tokenizer files in the tiny model
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(hf):
        if name != "model.safetensors.index.json" and not name.endswith(".safetensors"):
            os.symlink(os.path.join(hf, name), broken / name)
    with pytest.raises(CheckpointError, match="actor.checkpoint=.*has no weights"):
        check_starting_weights(str(broken))
    with pytest.raises(CheckpointError, match="does not exist"):
        check_starting_weights(str(tmp_path / "nothing"))
