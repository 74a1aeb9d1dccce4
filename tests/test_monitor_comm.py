"""Communication statistics (hyflow.monitor.comm): bytes and kinds of every collective, on
real gloo ranks, and the acceptance checks of a quickstart run: the reshard's bytes equal the
planner's, the DP all-reduce's bytes equal the gradient buffer times the optimizer steps."""

import datetime
import os
import time

import pytest

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "configs", "quickstart.yaml")


def _collectives():
    import torch
    import torch.distributed as dist
    from torch.distributed import _coalescing_manager

    from hyflow.monitor import comm

    rank = dist.get_rank()
    pair = dist.new_group([0, 1])
    single, _ = dist.new_subgroups_by_enumeration([[0], [1]])
    comm.register_group(pair, "tp")
    comm.register_group(single, "dp")
    before = dist.all_reduce
    comm.install()
    try:
        assert dist.all_reduce is not before and dist.distributed_c10d.all_reduce is dist.all_reduce
        x = torch.ones(100)                                    # 400 bytes
        dist.all_reduce(x, group=pair)                         # tp all_reduce: 400
        dist.all_reduce(x, group=single)                       # one rank: moves nothing
        dist.all_reduce(x)                                     # world: 400
        out = torch.empty(2 * 25)
        dist.all_gather_into_tensor(out, torch.ones(25), group=pair)   # 100 arrive
        lst = [torch.empty(10) for _ in range(2)]
        dist.all_gather(lst, torch.ones(10), group=pair)       # 40 arrive
        dist.broadcast(torch.ones(8), src=0, group=pair)       # 32
        rs = torch.empty(16)
        dist.reduce_scatter_tensor(rs, torch.ones(32), group=pair)     # 64 leave
        work = dist.all_reduce(torch.ones(4), group=pair, async_op=True)  # 16, timed at wait()
        work.wait()
        peer = 1 - rank
        ops = [dist.P2POp(dist.isend, torch.ones(6), peer, group=pair),
               dist.P2POp(dist.irecv, torch.empty(6), peer, group=pair)]
        for req in dist.batch_isend_irecv(ops):                # 48 (24 out, 24 in)
            req.wait()
        with _coalescing_manager(pair, async_ops=False):       # Megatron's bucketed reduction
            dist.all_reduce(torch.ones(10), group=pair)        # 40
            dist.all_reduce(torch.ones(5), group=pair)         # 20
        with comm.transfer("all_gather", pair) as xfer:        # shared-memory style transfer
            dist.barrier(group=pair)                           # inside: not charged again
            xfer.nbytes = 1000
        objs = [None, None]
        dist.all_gather_object(objs, rank)                     # world all_gather of pickles
        table = comm.totals()
        summary = comm.step_summary()
        after = comm.step_summary()
    finally:
        comm.uninstall()
    assert dist.all_reduce is before
    return {f"{op}/{kind}": (calls, nbytes) for (op, kind), (calls, _, nbytes) in table.items()}, summary, after


def test_bytes_and_kinds_of_each_collective():
    results = run_on_ranks(_collectives, 2)
    for table, summary, after in results:
        assert table["all_reduce/tp"] == (4, 400 + 16 + 40 + 20)
        assert table["all_reduce/dp"] == (1, 0)
        assert table["all_reduce/world"] == (1, 400)
        assert table["all_gather/tp"] == (3, 100 + 40 + 1000)
        assert table["broadcast/tp"] == (1, 32)
        assert table["reduce_scatter/tp"] == (1, 64)
        assert table["p2p/tp"] == (1, 48)
        assert "barrier/tp" not in table  # the transfer's barrier is part of the transfer
        assert table["all_gather/world"][1] > 0  # the pickled objects' sizes and bytes
        assert summary["comm/tp/bytes"] == 476 + 1140 + 32 + 64 + 48
        assert summary["comm/all_reduce/bytes"] == 476 + 400
        assert summary["comm/timeouts"] == 0
        assert summary["comm/seconds"] > 0
        assert summary["comm/bytes"] == sum(summary[f"comm/{op}/bytes"] for op in
                                            ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p"))
        # the next step starts from zero, with the same keys (stable TensorBoard curves)
        assert after["comm/bytes"] == 0 and set(after) == set(summary)


def _timeout():
    import torch
    import torch.distributed as dist

    from hyflow.monitor import comm

    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    comm.install()
    try:
        if dist.get_rank() == 0:  # rank 1 never joins: rank 0's all-reduce times out
            with pytest.raises(RuntimeError):
                dist.all_reduce(torch.ones(4), group=group)
        else:
            time.sleep(4)
        summary = comm.step_summary()
    finally:
        comm.uninstall()
    dist.barrier()
    return summary["comm/timeouts"]


def test_timeouts_are_counted():
    assert run_on_ranks(_timeout, 2) == [1.0, 0.0]


def test_wrapper_overhead_is_microseconds():
    from hyflow.monitor import comm

    assert 0 <= comm.wrapper_overhead(2000) < 1e-3


def _quickstart(overrides):
    import torch.distributed as dist

    import hyflow.jobs.rl as rl
    from hyflow.jobs.registry import load_job_config
    from hyflow.hybrid.reshard_plan import gpt_param_specs, plan_reshard
    from hyflow.models.builder import build_gpt_model
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import pad_vocab_size

    cfg = load_job_config(QUICKSTART, overrides)
    history = rl.run(cfg)
    d, layout = cfg.model, cfg.actor.layout.with_dp_for(dist.get_world_size())
    specs = gpt_param_specs(d.num_layers, d.hidden_size, d.num_attention_heads, d.num_query_groups, d.head_dim,
                            d.ffn_hidden_size, pad_vocab_size(d.vocab_size, layout.tp),
                            tied_embeddings=d.tied_embeddings, qkv_bias=d.qkv_bias, dtype_bytes=4)
    plan = plan_reshard(specs, layout, cfg.rollout.layout.as_layout())
    model = build_gpt_model(d, init_training_groups(layout))
    grad_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)  # fp32 grad buffer
    return history, plan.bytes_recv[dist.get_rank()], grad_bytes


def test_quickstart_reshard_and_dp_bytes(tmp_path):
    base = ["actor.sft_warmup_steps=0", "trainer.total_steps=2", "trainer.loggers=[console]"]
    # TP=2 training -> TP=1 generation: the reshard all-gathers what the planner planned
    results = run_on_ranks(_quickstart, 2, base + [f"trainer.output_dir={tmp_path / 'tp2'}"], timeout=900)
    for history, planned, _ in results:
        assert planned > 0
        assert [m["comm/reshard/bytes"] for m in history] == [planned, planned]
        assert all(m["comm/all_reduce/bytes"] > 0 and m["comm/tp/bytes"] > 0 for m in history)
    # TP=1, DP=2: one all-reduce of the gradient buffer per optimizer step (ppo_epochs=2 x 4
    # mini-batches), plus float64 scalars: the mini-batches' token / sequence counts (the loss's
    # global denominators), each update's statistics and the step's metrics (a few hundred bytes)
    # (rows re-dealt for token balance would add their exchange: off here, so the count is exact)
    results = run_on_ranks(_quickstart, 2, base + ["actor.layout.tp=1", "actor.balance_batch=false",
                                                   f"trainer.output_dir={tmp_path / 'dp2'}"], timeout=900)
    for history, _, grad_bytes in results:
        for m in history:
            extra = m["comm/dp/bytes"] - grad_bytes * 2 * (32 * 8 // 64)
            assert 0 <= extra < 2048 and extra % 8 == 0, (m["comm/dp/bytes"], grad_bytes)
            assert m["comm/reshard/bytes"] == 0


def _event_timing():
    """The monitor as on CUDA (a fake device test and fake timing events, 1 ms each): a TP=2 decode
    loop's all-reduces are counted without events; 100 all-reduces outside it get at most
    EVENTS_PER_STEP events and are charged their mean."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from hyflow.monitor import comm
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.rollout import GenerationConfig, GenerationEngine, SamplingConfig
    from hyflow.rollout.loading import megatron_from_hf

    class Event:
        made = 0

        def __init__(self):
            Event.made += 1

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 1.0

    groups = init_training_groups(Layout(tp=2))
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)).eval()
    model, desc = megatron_from_hf(hf, groups)
    engine = GenerationEngine.from_description(model, desc, GenerationConfig(max_concurrent=4), tp_group=groups.pgs.tp)
    saved = comm._cuda_tensor, comm._new_events
    comm._cuda_tensor = lambda args: args[0] if args and isinstance(args[0], torch.Tensor) else None
    comm._new_events = lambda: (Event(), Event())
    comm.install()
    try:
        engine.generate([[5, 9, 100], [17, 3]], SamplingConfig(temperature=0, max_new_tokens=8, ignore_eos=True))
        decode = comm.step_summary()
        decode_events = Event.made
        for _ in range(100):
            dist.all_reduce(torch.ones(4), group=groups.pgs.tp)
        loop = comm.totals()[("all_reduce", "tp")]
    finally:
        comm.uninstall()
        comm._cuda_tensor, comm._new_events = saved
    return decode, decode_events, loop, Event.made - decode_events


def test_cuda_events_per_group_and_step_not_per_call():
    for decode, decode_events, (calls, seconds, nbytes), loop_events in run_on_ranks(_event_timing, 2):
        assert decode["comm/calls"] >= 2 * 2 * 8 and decode["comm/tp/bytes"] > 0  # counted: 2 per layer per token
        assert decode_events == 0  # ... without a CUDA event
        from hyflow.monitor.comm import EVENTS_PER_STEP

        assert calls == 100 and nbytes == 100 * 16
        assert loop_events == 2 * EVENTS_PER_STEP  # a start and an end event for the first 16 calls only
        assert seconds == pytest.approx(100 * 1e-3)  # the others charged the timed calls' mean
