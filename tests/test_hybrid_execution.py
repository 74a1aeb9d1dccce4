"""How the hybrid engine executes its table (gloo, 2 ranks, the collective / point-to-point
code path a GPU runs):

* the executor follows the table: a permuted table moves the bytes accordingly, a table
  without a route for a parameter is refused by name;
* a transition under ``torch.device("meta")`` (any tensor made without an explicit device
  becomes a meta tensor and breaks it) gives the same generation weights and restores the
  training weights bit for bit;
* the TP merge is one all-gather per bucket, not per parameter; the PP merge one batched
  send/recv; the generation buffer is the same memory every transition;
* memory ordering: optimizer state and gradient buffers leave before the generation buffer
  is taken, and come back only after it is given back.
"""

import dataclasses

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

# (isend / irecv are not wrapped: P2POp checks their identity; batched p2p is counted.)
COUNTED = ("all_gather_into_tensor", "all_gather", "all_reduce", "broadcast", "barrier",
           "batch_isend_irecv", "send", "recv", "all_gather_object", "reduce_scatter_tensor")


def _setup(tp, pp, with_optimizer=False):
    from hyflow.models.builder import build_gpt_model
    from hyflow.models.description import tiny_llama
    from hyflow.models.weights import load_full_state_dict, random_full_state_dict
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout

    groups = init_training_groups(Layout(tp=tp, pp=pp), seed=3)
    desc = tiny_llama(vocab_size=200, num_attention_heads=8, num_query_groups=4)
    model = build_gpt_model(desc, groups)
    load_full_state_dict(model, random_full_state_dict(desc, seed=1), desc, groups)
    if not with_optimizer:
        return groups, desc, model, None, None
    from hyflow.jobs.lm import arith_batch
    from hyflow.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
    from hyflow.training.step import train_step

    chunks = wrap_ddp([model], groups, distributed_optimizer=False)
    optimizer, scheduler = build_optimizer(chunks, OptimConfig(lr=1e-3), 10)
    batch = [arith_batch(desc.vocab_size, 2, 12, 5, torch.Generator().manual_seed(0))]
    train_step(chunks, optimizer, scheduler, batch, groups=groups)
    return groups, desc, model, chunks, optimizer


class _Counter:
    """Counts torch.distributed calls while active (the transports look them up at call time)."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.calls, self.saved = dist, {}, {}

    def __enter__(self):
        for name in COUNTED:
            fn = getattr(self.dist, name)
            self.saved[name] = fn

            def wrapped(*a, _fn=fn, _name=name, **k):
                self.calls[_name] = self.calls.get(_name, 0) + 1
                return _fn(*a, **k)
            setattr(self.dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(self.dist, name, fn)


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _tp_merge_scenario() -> dict:
    from hyflow.hybrid.executor import HybridEngine
    from hyflow.hybrid.param_specs import ReshardPlanError
    from hyflow.hybrid.reshard_table import VIA_TP_MERGE
    from hyflow.hybrid.transport import plan_buckets

    groups, desc, model, _, _ = _setup(tp=2, pp=1)
    train0 = _snapshot(model)
    engine = HybridEngine(model, desc, groups, (1, 1), transport="collective")
    out = {"gathered_params": sum(r.via == VIA_TP_MERGE for r in engine.table.routes)}
    with _Counter() as count:
        ref = _snapshot(engine.to_generation())
    out["calls"] = dict(count.calls)
    items = engine._gathers  # (this rank's training shards; released now, shapes still known)
    out["buckets"] = len(plan_buckets([(it.shard.shape[0], it.shard.shape[1:].numel() * 4) for it in items],
                                      engine.transport.slot_bytes))
    ptr = engine.buffer.tensor.data_ptr()
    engine.to_training()
    with torch.device("meta"):  # nothing in a transition may rely on the default device
        got = _snapshot(engine.to_generation())
        engine.to_training()
    out["meta_same"] = ref.keys() == got.keys() and all(torch.equal(ref[n], got[n]) for n in ref)
    out["restored"] = all(torch.equal(train0[n], p) for n, p in model.named_parameters())
    out["same_buffer"] = engine.buffer.tensor.data_ptr() == ptr

    # A permuted table: layer 0's fc2 and input norm come from layer 1's (same shapes).
    routes = list(engine.table.routes)
    swap = {"decoder.layers.0.mlp.linear_fc2.weight": "decoder.layers.1.mlp.linear_fc2.weight",
            "decoder.layers.0.input_layernorm.weight": "decoder.layers.1.input_layernorm.weight"}
    swap.update({v: k for k, v in swap.items()})
    by_name = {r.gen_name: r for r in routes}
    permuted = [dataclasses.replace(r, train_name=by_name[swap[r.gen_name]].train_name)
                if r.gen_name in swap else r for r in routes]
    other = HybridEngine(model, desc, groups, (1, 1), transport="collective",
                         table=dataclasses.replace(engine.table, routes=tuple(permuted)))
    moved = _snapshot(other.to_generation())
    other.to_training()
    out["permuted_follows"] = all(torch.equal(moved[n], ref[swap.get(n, n)]) for n in ref)
    out["permuted_differs"] = not torch.equal(moved["decoder.layers.0.mlp.linear_fc2.weight"],
                                              ref["decoder.layers.0.mlp.linear_fc2.weight"])
    out["restored_after_permuted"] = all(torch.equal(train0[n], p) for n, p in model.named_parameters())
    try:
        HybridEngine(model, desc, groups, (1, 1), transport="collective",
                     table=dataclasses.replace(engine.table, routes=tuple(routes[1:])))
        out["missing_error"] = None
    except ReshardPlanError as exc:
        out["missing_error"] = str(exc)
    out["first_route"] = routes[0].gen_name
    return out


def test_executor_follows_the_table_and_buckets_the_tp_merge():
    for rank, r in enumerate(run_on_ranks(_tp_merge_scenario, 2)):
        # one all-gather per bucket (one bucket for this model), not one per parameter
        assert r["calls"].get("all_gather_into_tensor") == r["buckets"] == 1, (rank, r["calls"])
        assert r["gathered_params"] > 1
        assert set(r["calls"]) == {"all_gather_into_tensor"}, r["calls"]
        assert r["meta_same"] and r["restored"] and r["same_buffer"], rank
        assert r["permuted_follows"] and r["permuted_differs"], rank
        assert r["restored_after_permuted"], rank
        assert r["missing_error"] and r["first_route"] in r["missing_error"], r["missing_error"]
        assert "without a route" in r["missing_error"]


def _pp_merge_scenario(small_slots: bool) -> dict:
    from hyflow.hybrid.executor import HybridEngine

    groups, desc, model, _, _ = _setup(tp=1, pp=2)
    train0 = _snapshot(model)
    slot = 4096 if small_slots else 64 << 20
    ref_engine = HybridEngine(model, desc, groups, (1, 1), transport="shared_memory", staging_slot_bytes=slot)
    ref = _snapshot(ref_engine.to_generation())
    ref_engine.to_training()
    engine = HybridEngine(model, desc, groups, (1, 1), transport="collective", staging_slot_bytes=slot)
    with _Counter() as count, torch.device("meta"):
        got = _snapshot(engine.to_generation())
        received = engine.stats.bytes_received
        engine.to_training()
    return {"calls": dict(count.calls), "same": ref.keys() == got.keys() and all(torch.equal(ref[n], got[n]) for n in ref),
            "restored": all(torch.equal(train0[n], p) for n, p in model.named_parameters()),
            "bytes": (received, engine.plan.bytes_recv[torch.distributed.get_rank()]),
            "exchange": engine.pp_exchange.name}


def test_point_to_point_pp_merge_matches_shared_memory_under_meta_default():
    for rank, r in enumerate(run_on_ranks(_pp_merge_scenario, 2, True)):
        assert r["exchange"] == "p2p"
        assert r["calls"] == {"batch_isend_irecv": 1}, r["calls"]
        assert r["same"] and r["restored"], rank
        assert r["bytes"][0] == r["bytes"][1], r["bytes"]


def _ordering_scenario() -> dict:
    from hyflow.hybrid.executor import HybridEngine

    groups, desc, model, chunks, optimizer = _setup(tp=2, pp=1, with_optimizer=True)
    engine = HybridEngine(chunks[0], desc, groups, (1, 1), optimizer=optimizer,
                          offload_grad_buffers=True, offload_optimizer=True)
    events = []

    def spy(obj, name, label):
        fn = getattr(obj, name)

        def wrapped(*a, **k):
            events.append(label)
            return fn(*a, **k)
        setattr(obj, name, wrapped)

    spy(engine._optimizer_offload, "offload", "optimizer out")
    spy(engine._optimizer_offload, "restore", "optimizer in")
    spy(engine._ddp, "offload_grad_buffers", "grads out")
    spy(engine._ddp, "restore_grad_buffers", "grads in")
    spy(engine.buffer, "acquire", "buffer in")
    spy(engine.buffer, "release", "buffer out")
    spy(engine, "_release_training", "weights out")
    engine.to_generation()
    engine.to_training()
    return {"events": events}


def test_transition_frees_training_state_before_taking_the_buffer():
    for r in run_on_ranks(_ordering_scenario, 2):
        assert r["events"] == ["optimizer out", "grads out", "buffer in", "weights out",
                               "buffer out", "grads in", "optimizer in"], r["events"]
