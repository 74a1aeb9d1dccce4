"""Checkpoint saves at scale (issue #33 section 3): what a save moves in pickled collectives does not
grow with the world on ranks other than 0.

* the manifest: rank 0 lists the checkpoint and sends each rank the names of its own files only
  (the whole list was broadcast to every rank: O(world x shards) names per rank);
* Megatron's access-integrity check (an ``all_gather_object`` of every rank's shard metadata onto
  every rank) runs at the first save of each part of a run only: the sharding is the same at every
  save.

Two gloo ranks (TP=2: each writes shards of its own) save a tiny model three times.
"""

import os

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank


def _save_three_times(out: str) -> dict:
    """Rank function: three checkpoints of a tiny TP=2 model; report what this rank received in
    pickled collectives while writing the manifests, and how often Megatron gathered the shard
    metadata."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import state_dict_utils

    from hyflow.checkpoint import manifest
    from hyflow.checkpoint.checkpointer import Checkpointer, TrainedModel
    from hyflow.models.builder import build_gpt_model
    from hyflow.models.description import ModelDescription
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout

    desc = ModelDescription(family="llama", vocab_size=16, hidden_size=16, num_layers=1, num_attention_heads=2,
                            num_query_groups=2, ffn_hidden_size=32, max_position_embeddings=32)
    torch.manual_seed(0)
    groups = init_training_groups(Layout(tp=2))
    model = build_gpt_model(desc, groups)

    received: list = []  # what the manifest's object collectives handed this rank
    gathers = [0]
    originals = {name: getattr(dist, name) for name in ("broadcast_object_list", "scatter_object_list")}

    def broadcast_object_list(objects, *args, **kwargs):
        out_ = originals["broadcast_object_list"](objects, *args, **kwargs)
        received.append(repr(objects))
        return out_

    def scatter_object_list(output, *args, **kwargs):
        out_ = originals["scatter_object_list"](output, *args, **kwargs)
        received.append(repr(output))
        return out_

    original_metadata = state_dict_utils.determine_global_metadata

    def determine_global_metadata(*args, **kwargs):
        gathers[0] += 1
        return original_metadata(*args, **kwargs)

    original_write = manifest.write_manifest

    def write_manifest(*args, **kwargs):  # record only inside the manifest's own collectives
        dist.broadcast_object_list, dist.scatter_object_list = broadcast_object_list, scatter_object_list
        try:
            return original_write(*args, **kwargs)
        finally:
            dist.broadcast_object_list = originals["broadcast_object_list"]
            dist.scatter_object_list = originals["scatter_object_list"]

    state_dict_utils.determine_global_metadata = determine_global_metadata
    from hyflow.checkpoint import checkpointer as checkpointer_module
    checkpointer_module.write_manifest = write_manifest
    try:
        ckpt = Checkpointer(out, groups, desc, keep_last=5, log=lambda m: None, tokenizer="char")
        for step in (1, 2, 3):
            ckpt.save(step, {"actor": TrainedModel([model])}, {"step": step})
        ckpt.close()
    finally:
        state_dict_utils.determine_global_metadata = original_metadata
        checkpointer_module.write_manifest = original_write
    return {"rank": dist.get_rank(), "received": received, "metadata_gathers": gathers[0]}


def test_saves_send_each_rank_its_own_names_and_validate_the_sharding_once(tmp_path):
    from hyflow.checkpoint.discovery import checkpoints_root, step_dir_name
    from hyflow.checkpoint.manifest import _owner, read_manifest, verify_manifest

    out = tmp_path / "run"
    results = run_on_ranks(_save_three_times, 2, str(out), timeout=600)
    path = os.path.join(checkpoints_root(str(out)), step_dir_name(3))
    files = read_manifest(path)["files"]
    ones = [rel for rel in files if _owner(rel, 2) == 1]
    zeros = [rel for rel in files if _owner(rel, 2) == 0]
    assert any(rel.endswith(".distcp") for rel in ones) and any(rel.endswith(".distcp") for rel in zeros)
    assert verify_manifest(path) is not None  # rank 1's own hashes made it into rank 0's manifest
    seen = "".join(results[1]["received"])
    assert seen, "rank 1 took part in no manifest collective"
    assert all(rel in seen for rel in ones)  # the names of the files it wrote
    # the names of rank 0's shards, the models' metadata and the trainer state (rank 0's to hash)
    # never reach rank 1 (old code: the whole file list, broadcast to every rank)
    assert [rel for rel in zeros if rel in seen] == []
    # Megatron's all_gather_object of every rank's shard metadata: once (the actor's first save), not
    # at each of the three saves
    assert [r["metadata_gathers"] for r in results] == [1, 1]
