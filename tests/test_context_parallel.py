"""Context parallelism without Transformer Engine (all-to-all attention over the CP group, gloo).

A tiny Llama (GQA with fewer key/value groups per TP rank than CP ranks, YaRN RoPE so the
attention factor and global positions both matter) runs the same two micro-batches at CP=1,
CP=2, CP=2 x TP=2 and CP=2 x PP=2 through Megatron's ``forward_backward`` schedule and DDP. Each CP rank
holds its share of every sequence (:func:`split_for_cp`); per-token outputs are gathered back
(:func:`gather_from_cp`). Logits, log-probs of the next tokens, the loss and every parameter's
gradient equal the CP=1 run (fp32, <= 1e-5 relative); so do logits under a whole-sequence
block-diagonal mask (sequence packing), also given as sequence bounds (per-sequence attention). The ``lm`` job trains at CP=2 with CP=1's losses.
"""
from __future__ import annotations

import os

import pytest
import torch

from hyflow.testing import run_on_ranks

SEQ, MICRO, BATCHES = 64, 2, 2
LM_TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "lm_tiny.yaml")
TOLERANCE = 1e-5


def _desc():
    from hyflow.models.description import tiny_llama

    return tiny_llama(vocab_size=200, num_attention_heads=4, num_query_groups=2, max_position_embeddings=256,
                      rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})


def _batches():
    from hyflow.models.context_parallel import next_token_labels

    gen = torch.Generator().manual_seed(5)
    out = []
    for _ in range(BATCHES):
        tokens = torch.randint(0, 200, (MICRO, SEQ), generator=gen)
        mask = torch.ones(MICRO, SEQ)
        mask[0, 40:] = 0  # padding at the end of one row: the CP ranks hold unequal token counts
        mask[:, -1] = 0  # no label after the last token
        out.append({"tokens": tokens, "labels": next_token_labels(tokens), "loss_mask": mask,
                    "position_ids": torch.arange(SEQ).expand(MICRO, SEQ)})
    return out


def _packing_mask() -> torch.Tensor:
    """Two packed documents per row: causal inside each, nothing across (True = masked)."""
    pos = torch.arange(SEQ)
    doc = (pos >= 24).long()
    allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    return (~allowed).view(1, 1, SEQ, SEQ).expand(MICRO, 1, SEQ, SEQ)


def _run(tp: int, cp: int, pp: int = 1) -> dict:
    import torch.distributed as dist

    from hyflow.models.builder import build_model_chunks
    from hyflow.models.context_parallel import cp_token_mean, gather_from_cp, sequence_bounds, split_for_cp
    from hyflow.models.weights import gather_full_state_dict, load_full_state_dict, random_full_state_dict
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.training.logprobs import vocab_parallel_logprobs
    from hyflow.training.optimizer import wrap_ddp
    from hyflow.training.step import forward_backward

    groups = init_training_groups(Layout(tp=tp, cp=cp, pp=pp), seed=3)
    desc = _desc()
    (model,) = build_model_chunks(desc, groups, spec="local")
    load_full_state_dict(model, random_full_state_dict(desc, seed=1), desc, groups)
    tp_group, cp_group = groups.pgs.tp, groups.pgs.cp
    local = [split_for_cp(b, cp_group) for b in _batches()]
    assert local[0]["tokens"].shape == (MICRO, SEQ // cp)

    def full_logits(logits: torch.Tensor) -> torch.Tensor:
        shards = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(shards, logits.contiguous(), group=tp_group)
        return gather_from_cp(torch.cat(shards, dim=-1)[..., :desc.vocab_size], cp_group)

    out: dict = {"logits": [], "logprobs": []}
    model.eval()
    with torch.no_grad():
        if pp == 1:  # direct forwards need the whole depth
            for b in local:
                logits = model(b["tokens"], b["position_ids"], None)
                out["logits"].append(full_logits(logits))
                lp = vocab_parallel_logprobs(logits, b["labels"], desc.vocab_size, tp_group)
                out["logprobs"].append(gather_from_cp(lp, cp_group))
            packed = split_for_cp({**_batches()[0], "attention_mask": _packing_mask()}, cp_group)
            out["packed"] = full_logits(model(packed["tokens"], packed["position_ids"], packed["attention_mask"]))
            if cp > 1:  # the same packing as sequence bounds: per-sequence attention, no s x s mask
                bounds = sequence_bounds([24, SEQ - 24], SEQ)
                out["bounds"] = full_logits(model(packed["tokens"], packed["position_ids"], bounds))
    model.train()

    def loss_fn(output, batch):
        loss = cp_token_mean(output, batch["loss_mask"], cp_group)
        reported = loss.detach().clone()
        dist.all_reduce(reported, group=cp_group)
        return loss, {"loss": reported}

    (ddp,) = wrap_ddp([model], groups, distributed_optimizer=False)
    stats = forward_backward([ddp], local, loss_fn=loss_fn)
    out["loss"] = [float(s["loss"]) for s in stats]
    with torch.no_grad():
        for p in ddp.module.parameters():
            p.copy_(p.main_grad)
    out["grads"] = gather_full_state_dict(ddp, desc, groups)
    return out if dist.get_rank() == dist.get_world_size() - 1 else None  # a last-stage rank


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_on_ranks(_run, 1, 1, 1, timeout=600)[-1]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


@pytest.mark.multirank
@pytest.mark.parametrize("tp, cp, pp", [(1, 2, 1), (2, 2, 1), (1, 2, 2)], ids=["cp2", "cp2tp2", "cp2pp2"])
def test_context_parallel_equals_cp1(reference, tp, cp, pp):
    got = run_on_ranks(_run, tp * cp * pp, tp, cp, pp, timeout=900)[-1]
    errors = {}
    if pp == 1:
        for key in ("logits", "logprobs"):
            for g, w in zip(got[key], reference[key]):
                assert g.shape == w.shape
                errors[key] = max(errors.get(key, 0.0), _rel(g, w))
        errors["packed logits"] = _rel(got["packed"], reference["packed"])
        errors["packed logits (bounds)"] = _rel(got["bounds"], reference["packed"])
        assert _rel(got["packed"], reference["logits"][0]) > 1e-2  # the packing mask matters
    assert len(got["loss"]) == BATCHES
    errors["loss"] = max(abs(g - w) / abs(w) for g, w in zip(got["loss"], reference["loss"]))
    assert set(got["grads"]) == set(reference["grads"])
    errors["grads"] = max(_rel(got["grads"][n], reference["grads"][n]) for n in reference["grads"])
    print(f"tp={tp} cp={cp} pp={pp} max relative error vs CP=1: "
          + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert all(v <= TOLERANCE for v in errors.values()), errors
    assert all(reference["grads"][n].abs().max() > 0 for n in reference["grads"])


def test_split_and_gather_round_trip_without_ranks():
    from hyflow.models.context_parallel import cp_chunk_index, cp_order, next_token_labels

    assert cp_chunk_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_chunk_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert sorted(cp_order(24, 3).tolist()) == list(range(24))
    assert next_token_labels(torch.tensor([[3, 4, 5]]), fill=-1).tolist() == [[4, 5, -1]]
    with pytest.raises(ValueError, match="not divisible by 2 \\* cp = 4; pad the batch"):
        cp_chunk_index(10, 2, 0)


def test_layout_names_heads_that_do_not_split_over_tp_x_cp():
    from hyflow.models.description import tiny_llama
    from hyflow.parallel.layout import Layout, LayoutError

    desc = tiny_llama(num_attention_heads=4, num_query_groups=2)
    Layout(tp=2, cp=2).check_model(desc)
    with pytest.raises(LayoutError, match=r"cp=4: .* tp x cp = 2 x 4 = 8 .*num_attention_heads=4"):
        Layout(tp=2, cp=4).check_model(desc)


def _lm_job(cp: int, out_dir: str) -> list:
    import torch.distributed as dist

    from hyflow.jobs.registry import load_job_config
    from hyflow.jobs.lm import run

    cfg = load_job_config(LM_TINY, ["actor.layout.tp=1", f"actor.layout.cp={cp}", "trainer.total_steps=4",
                                    f"trainer.nproc={dist.get_world_size()}", f"trainer.output_dir={out_dir}",
                                    "trainer.log_every=100"])
    return [(m["loss"], m["grad_norm"]) for m in run(cfg)]


@pytest.mark.multirank
def test_lm_job_trains_the_same_at_cp2(tmp_path):
    """The lm job end to end (4 optimizer steps, Adam, clipping) at CP=2 on 2 ranks: the same
    losses and gradient norms as CP=1 on one rank."""
    want = run_on_ranks(_lm_job, 1, 1, str(tmp_path / "cp1"), timeout=600)[0]
    got = run_on_ranks(_lm_job, 2, 2, str(tmp_path / "cp2"), timeout=600)
    for rank_result in got:
        for (loss, norm), (ref_loss, ref_norm) in zip(rank_result, want):
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss) and abs(norm - ref_norm) <= 1e-5 * ref_norm
    assert want[-1][0] < want[0][0]
