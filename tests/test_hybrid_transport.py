"""TP-merge transports of the hybrid engine (gloo, 2 and 4 ranks).

The shared-memory transport (CPU ranks on one host) must produce the generation buffer
bit for bit as the bucketed collectives do, with the same bytes received, also when
its staging slots are far smaller than a parameter (pieces cut across rows and across
the gate/up halves of ``linear_fc1``), and leave nothing behind in /dev/shm.
"""

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank


def _engines_agree(tp: int, slot_bytes: int, pp: int = 1, gen_shape: tuple = (1, 1)) -> dict:
    import glob

    import torch.distributed as dist

    from hyflow.hybrid.executor import HybridEngine
    from hyflow.models.builder import build_gpt_model
    from hyflow.models.description import tiny_llama
    from hyflow.models.weights import load_full_state_dict, random_full_state_dict
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout

    world = dist.get_world_size()
    groups = init_training_groups(Layout(tp=tp, pp=pp, dp=world // (tp * pp)), seed=3)
    desc = tiny_llama(vocab_size=200, num_attention_heads=8, num_query_groups=4)
    model = build_gpt_model(desc, groups)
    load_full_state_dict(model, random_full_state_dict(desc, seed=1), desc, groups)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    leftovers = set(glob.glob("/dev/shm/hyflow-reshard-*"))
    out = {}
    for transport in ("shared_memory", "collective"):
        engine = HybridEngine(model, desc, groups, gen_shape, transport=transport, staging_slot_bytes=slot_bytes)
        out[f"{transport}_name"] = engine.transport.name
        out[f"{transport}_pp"] = engine.pp_exchange.name if engine.pp_exchange is not None else None
        if transport == "shared_memory" and engine.pp_exchange is not None:  # mapped: own slots and peers'
            out["pp_staging_mapped"] = engine.pp_exchange.staging_bytes * len(engine.pp_exchange.segments)
            out["max_planned"] = max(engine.plan.bytes_recv)
        gen = engine.to_generation()
        out[transport] = {n: p.detach().clone() for n, p in gen.named_parameters()}
        out[f"{transport}_bytes"] = engine.stats.bytes_received
        engine.to_training()
    out["planned"] = engine.plan.bytes_recv[dist.get_rank()]
    out["restored"] = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    out["leftover_files"] = sorted(set(glob.glob("/dev/shm/hyflow-reshard-*")) - leftovers)
    return out


@pytest.mark.parametrize("tp,pp,gen,world,slot_bytes", [
    (2, 1, (1, 1), 2, 8192), (2, 1, (1, 1), 2, 1 << 20), (4, 1, (1, 1), 4, 4000),
    (1, 2, (1, 1), 2, 5000), (1, 2, (1, 1), 2, 1 << 20), (2, 2, (1, 1), 4, 8192), (1, 4, (1, 2), 4, 4096),
], ids=["tp2-small-slots", "tp2-large-slots", "tp4-unaligned-slots", "pp2-small-slots", "pp2-large-slots",
        "tp2pp2-to-1x1", "pp4-to-pp2"])
def test_shared_memory_transport_equals_collectives(tp, pp, gen, world, slot_bytes):
    """TP merge by shared memory == all-gathers; PP merge by shared memory == gloo send/recv."""
    for rank, r in enumerate(run_on_ranks(_engines_agree, world, tp, slot_bytes, pp, gen)):
        tp_name = "shared_memory" if tp > 1 else "collective"   # no TP merge: nothing to share
        assert r["shared_memory_name"] == tp_name and r["collective_name"] == "collective"
        assert r["shared_memory_pp"] == ("shared_memory" if pp > gen[1] else None)
        assert r["collective_pp"] == ("p2p" if pp > gen[1] else None)
        if (tp, pp, gen) == (1, 2, (1, 1)):   # `hyflow plan` sizes the PP staging the same way
            from hyflow.hybrid.reshard_plan import PP_STAGING_SLOT, staging_bytes_per_rank

            slot = min(slot_bytes, PP_STAGING_SLOT)
            assert r["pp_staging_mapped"] == staging_bytes_per_rank(r["max_planned"], 2, slot), rank
        assert r["shared_memory"].keys() == r["collective"].keys()
        for name, value in r["collective"].items():
            assert torch.equal(r["shared_memory"][name], value), (rank, name)
        assert r["shared_memory_bytes"] == r["collective_bytes"] == r["planned"], rank
        assert r["restored"], rank
        assert r["leftover_files"] == [], rank


def _auto_choice(force_other_host: bool, directory: str) -> dict:
    import torch.distributed as dist

    from hyflow.hybrid import transport as T

    group = dist.new_group([0, 1])
    real = T.same_host
    if force_other_host:
        T.same_host = lambda g: False  # as if the two ranks ran on different machines
    try:  # (workers are pooled: restore the module)
        out = {"auto": T.make_transport("auto", group, [0, 1], torch.device("cpu"), 4096).name}
    finally:
        T.same_host = real
    try:
        T.SharedMemoryGather(group, [0, 1], 4096, directory=directory)
        out["error"] = None
    except RuntimeError as exc:
        out["error"] = str(exc)
    return out


def test_auto_transport_choice_and_unusable_staging_error(tmp_path):
    same = run_on_ranks(_auto_choice, 2, False, str(tmp_path))
    assert [r["auto"] for r in same] == ["shared_memory"] * 2
    assert [r["error"] for r in same] == [None, None]
    other = run_on_ranks(_auto_choice, 2, True, "/nonexistent-dir/for-staging")
    assert [r["auto"] for r in other] == ["collective"] * 2
    for r in other:  # every rank reports the same, actionable error
        assert "could not be created in /nonexistent-dir/for-staging" in r["error"]
        assert "transport='collective'" in r["error"]
