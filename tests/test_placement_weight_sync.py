"""Weight sync from the training pool to a separate generation pool, on 4 gloo ranks.

The acceptance shape: the quickstart's actor trains at TP=2 on ranks 0-1
(``trainer.mode=one_step_off`` splits 4 ranks in half), generation runs TP_g=1 x 2 replicas on
ranks 2-3. The generation models start from other weights; after one sync their logits equal the
training model's (fp32, <= 1e-5), each generation rank received exactly its slice (the planner's
bytes, measured by the executor and by ``hyflow.monitor.comm``), the training ranks received
nothing, and a second sync after the training weights change carries the change.
"""

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

SEQ = 10


def _full_logits(model, groups, tokens):
    """[b, s, V] logits of this rank's model replica (TP shards gathered over its tp group)."""
    import torch.distributed as dist

    from hyflow.training.step import position_ids

    with torch.no_grad():
        out = model(tokens, position_ids(tokens), None)
    tp = groups.pgs.tp
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size(tp))]
    dist.all_gather(parts, out.contiguous(), group=tp)
    return torch.cat(parts, dim=-1)


def _scenario(bucket_bytes, config):
    import torch.distributed as dist

    from hyflow.jobs.registry import load_job_config
    from hyflow.models.builder import build_gpt_model
    from hyflow.models.weights import load_full_state_dict, random_full_state_dict
    from hyflow.monitor import comm
    from hyflow.parallel.layout import pad_vocab_size
    from hyflow.placement.groups import build_pool_groups, build_sync_group
    from hyflow.placement.sync_planner import plan_actor_sync
    from hyflow.placement.weight_sync import WeightSync
    from hyflow.testing.rl import REPO

    comm.forget_groups()
    cfg = load_job_config(f"{REPO}/configs/{config}.yaml", ["trainer.nproc=4", "trainer.mode=one_step_off"])
    placement = cfg.resolved_placement()
    desc = cfg.model
    rank = dist.get_rank()
    groups = build_pool_groups(placement)
    actor, gen = placement.roles["actor"], placement.roles["rollout"]
    sync_group = build_sync_group(actor.pool, gen.pool)
    training = rank in actor.pool
    padded = pad_vocab_size(desc.vocab_size, actor.layout.tp)
    model = build_gpt_model(desc, groups, padded_vocab_size=padded, seed=11)
    load_full_state_dict(model, random_full_state_dict(desc, seed=1 if training else 2), desc, groups)
    plan = plan_actor_sync(placement, desc, 4, bucket_bytes=bucket_bytes)
    sync = WeightSync(plan, model, sync_group)

    tokens = torch.randint(0, desc.vocab_size, (3, SEQ), generator=torch.Generator().manual_seed(5))
    logits = _full_logits(model, groups, tokens)[..., :desc.vocab_size]

    def exchange(x):  # test-only: rank 0's logits to every rank
        box = x.clone() if rank == 0 else torch.empty_like(x)
        dist.broadcast(box, src=0)
        return box

    want = exchange(logits)
    before = (logits - want).abs().max().item()
    comm.install()
    try:
        comm.step_summary()
        stats = sync.run()
        p2p = comm.totals()
    finally:
        comm.uninstall()
    after = _full_logits(model, groups, tokens)[..., :desc.vocab_size]
    err = ((after - want).norm() / want.norm()).item()

    # the training weights move (as after an update); the next sync carries them over
    if training:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9).add_(0.01)
    want2 = exchange(_full_logits(model, groups, tokens)[..., :desc.vocab_size])
    sync.run()
    err2 = ((_full_logits(model, groups, tokens)[..., :desc.vocab_size] - want2).norm() / want2.norm()).item()
    own = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"training": training, "before": before, "err": err, "err2": err2,
            "measured": stats.bytes_received, "sent": stats.bytes_sent, "planned": plan.bytes_recv(rank),
            "planned_sent": plan.bytes_sent(rank), "own_bytes": own,
            "comm_p2p_reshard": p2p.get(("p2p", "reshard"), (0, 0.0, 0))[2],
            "rounds": plan.rounds, "buckets": stats.buckets, "model_bytes": plan.model_bytes}


@pytest.mark.parametrize("bucket_bytes,config", [(64 << 20, "quickstart"), (16 << 10, "quickstart"),
                                                 (16 << 10, "moe_quickstart")],
                         ids=["one-bucket", "small-buckets", "moe-ep2-small-buckets"])
def test_sync_to_separate_generation_pool(bucket_bytes, config):
    """``moe_quickstart``: the actor's 8 experts per layer split EP=2 over the training pool; each
    generation replica receives all of them (EP_g = 1) from their holders."""
    results = run_on_ranks(_scenario, 4, bucket_bytes, config)
    gen = [r for r in results if not r["training"]]
    train = [r for r in results if r["training"]]
    assert len(gen) == 2 and len(train) == 2
    for r in gen:
        assert r["before"] > 1e-2  # the generation model started from other weights
        assert r["err"] <= 1e-5 and r["err2"] <= 1e-5, r
        # exactly its slice, once: the planned bytes, measured by the executor and by monitor/comm,
        # equal to the generation rank's own parameters (no full copy of the TP=2 model twice)
        assert r["measured"] == r["planned"] == r["comm_p2p_reshard"] == r["own_bytes"], r
        assert r["sent"] == 0
    for r in train:
        assert r["measured"] == 0 and r["planned"] == 0
        assert r["sent"] == r["planned_sent"] == r["comm_p2p_reshard"] > 0
    # each generation replica gets the model once: what the training ranks send is 2 x the model
    assert sum(r["sent"] for r in train) == sum(r["measured"] for r in gen) == 2 * gen[0]["model_bytes"]
    if bucket_bytes < 1 << 20:
        assert gen[0]["rounds"] > 1
