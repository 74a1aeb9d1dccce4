"""Token-budget and packed micro-batches: the planners, the loss weights, the layout-independent
mini-batches, and parity with the padded fixed-size path (log-probs, loss and gradients, fp32,
<= 1e-6) at TP 1 / 2 and PP 2."""

import random

import pytest
import torch

from hyflow.testing.references import aggregate_loss
from hyflow.rl.batch import (MicroBatching, equalize, make_micro_batches, packed_attention_mask, plan_cost, plan_fixed,
                             plan_packed, plan_sorted, plan_token_budget, scatter_rows)
from hyflow.rl.step_losses import loss_weights
from hyflow.rl.update import minibatch_assignment
from hyflow.testing import run_on_ranks

LENGTHS = [7, 3, 12, 5, 5, 9, 1, 11, 4, 8, 2, 6]


def _covers(plan, n):
    return sorted(r for rows in plan for r in rows) == list(range(n))


def test_token_budget_plan_respects_the_budget_and_pads_least():
    plan = plan_token_budget(LENGTHS, 24)
    assert _covers(plan, len(LENGTHS))
    assert all(c <= 24 for c in plan_cost(plan, LENGTHS, packed=False))
    # fewer padded tokens than fixed micro-batches of the same count in row order
    fixed = plan_fixed(len(LENGTHS), -(-len(LENGTHS) // len(plan)))
    assert sum(plan_cost(plan, LENGTHS, False)) < sum(plan_cost(fixed, LENGTHS, False))
    assert plan_token_budget([30, 2], 24) == [[0], [1]]  # a row over the budget gets its own


def test_fixed_size_plan_groups_rows_of_similar_length():
    plan = MicroBatching(3).plan(LENGTHS)
    assert plan == plan_sorted(LENGTHS, 3) and _covers(plan, len(LENGTHS))
    assert [len(rows) for rows in plan] == [len(rows) for rows in plan_fixed(len(LENGTHS), 3)]
    assert [sorted(LENGTHS[r] for r in rows) for rows in plan] == [[9, 11, 12], [6, 7, 8], [4, 5, 5], [1, 2, 3]]
    # the same micro-batch count as rows in order, with less padding (84 tokens with padding instead of 120 here)
    assert sum(plan_cost(plan, LENGTHS, False)) < sum(plan_cost(plan_fixed(len(LENGTHS), 3), LENGTHS, False))


def test_packed_plan_respects_the_budget_and_equalize_splits_without_padding():
    plan = plan_packed(LENGTHS, 20)
    assert _covers(plan, len(LENGTHS)) and all(c <= 20 for c in plan_cost(plan, LENGTHS, True))
    assert len(plan) == -(-sum(LENGTHS) // 20)  # first fit decreasing fills these exactly
    more = equalize(plan, len(plan) + 3, LENGTHS, packed=True)
    assert len(more) == len(plan) + 3 and _covers(more, len(LENGTHS))
    assert sum(plan_cost(more, LENGTHS, True)) == sum(LENGTHS)


def test_packed_mask_is_block_diagonal_causal():
    mask = packed_attention_mask([2, 3], 6, torch.device("cpu"))[0, 0]
    allowed = ~mask
    assert allowed[1, 0] and not allowed[0, 1]  # causal inside the first sequence
    assert not allowed[2, 1] and allowed[4, 2]  # nothing across sequences; causal in the second
    assert allowed[5].tolist() == [False] * 5 + [True]  # padding sees itself only


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_weighted_contributions_sum_to_the_aggregate_over_any_split(mode):
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(10, 9, generator=gen, dtype=torch.float64)
    mask = (torch.rand(10, 9, generator=gen) > 0.4).double()
    mask[3] = 0  # an empty row is left out of the sequence mean
    want = aggregate_loss(loss, mask, mode, norm_length=9.0)
    tokens, seqs = mask.sum(), (mask.sum(-1) > 0).sum().double()
    rows = list(range(10))
    random.Random(1).shuffle(rows)
    total = torch.zeros((), dtype=torch.float64)
    for part in (rows[:3], rows[3:4], rows[4:]):  # any grouping of rows, e.g. over DP ranks
        w = loss_weights(mask[part], mode, tokens, seqs, norm_length=9.0).double()
        total += (loss[part] * w).sum()
    assert torch.allclose(total, want, rtol=1e-6, atol=1e-12)


def test_minibatch_assignment_does_not_depend_on_dp():
    rows, M = 48, 4  # 48 rows, mini-batches of 12
    one = minibatch_assignment(rows, 0, M, seed=3, step=2, epoch=1)
    for dp in (2, 3, 4):
        per = rows // dp
        parts = [minibatch_assignment(per, r * per, M, seed=3, step=2, epoch=1) for r in range(dp)]
        assert sum(parts, []) == one
        for part in parts:  # every rank gives every mini-batch the same number of rows
            assert sorted(part.count(k) for k in range(M)) == [per // M] * M
    assert one != minibatch_assignment(rows, 0, M, seed=3, step=2, epoch=0)  # reshuffled per epoch


def test_scatter_rows_inverts_packing():
    tokens = torch.arange(4 * 6).view(4, 6)
    lengths = [6, 2, 4, 3]
    micro = make_micro_batches({"tokens": tokens}, lengths, plan_packed(lengths, 8), packed=True)
    back = scatter_rows([mb["tokens"].float() for mb in micro], micro, (4, 6))
    for r, n in enumerate(lengths):
        assert back[r, :n].tolist() == tokens[r, :n].float().tolist()


# --------------------------------------------------------------------------- model parity


def _parity(tp, pp):
    """Log-probs, loss and gradients of the padded fixed-size path vs token-budget vs packed (masked,
    and per-sequence SDPA attention)."""
    import torch.distributed as dist

    from hyflow.models.builder import build_gpt_model
    from hyflow.models.description import tiny_llama
    from hyflow.models.weights import load_full_state_dict, random_full_state_dict
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.rl.batch import MicroBatching
    from hyflow.rl.step_losses import PolicyLoss, forward_score, logprob_scorer
    from hyflow.testing.rl import random_policy_batch
    from hyflow.training.optimizer import wrap_ddp
    from hyflow.training.step import forward_backward

    groups = init_training_groups(Layout(tp=tp, pp=pp), seed=3)
    desc = tiny_llama(vocab_size=96, num_attention_heads=4, num_query_groups=2, num_layers=2)

    def ddp(spec):
        model = build_gpt_model(desc, groups, spec=spec, config_overrides={"perform_initialization": False})
        load_full_state_dict(model, random_full_state_dict(desc, seed=1), desc, groups)
        return wrap_ddp([model], groups, distributed_optimizer=False)

    local, sdpa = ddp("local"), ddp("sdpa")
    lengths = [9, 4, 13, 6, 6, 11, 3, 8]
    B, S = len(lengths), max(lengths)
    cols, cfg = random_policy_batch(lengths, 96, prompt=2)
    mask = cols["response_mask"]
    out = {}
    # packed_sdpa: the SDPA spec runs each packed sequence's causal attention on its own (the
    # row's sequence bounds instead of an s x s mask)
    for name, chunks, batching in (
            ("fixed", local, MicroBatching(3)), ("budget", local, MicroBatching(3, max_tokens=26)),
            ("packed", local, MicroBatching(3, max_tokens=30, packed=True)),
            ("packed_sdpa", sdpa, MicroBatching(3, max_tokens=30, packed=True, bounds=True))):
        micro = make_micro_batches(cols, lengths, batching.plan(lengths), packed=batching.packed,
                                   bounds=batching.bounds)
        assert name != "packed_sdpa" or all(mb["attention_mask"].dim() == 1 for mb in micro)
        logp = forward_score(chunks, micro, logprob_scorer(96, groups.pgs.tp, 0.7), groups, (B, S))
        chunks[0].zero_grad_buffer()
        stats = forward_backward(chunks, micro, loss_fn=PolicyLoss(cfg, 96, groups.pgs.tp, 0.7), with_labels=False)
        loss = torch.tensor([sum(float(s["actor/pg_loss"]) for s in stats)], dtype=torch.float64)
        dist.broadcast(loss, src=dist.get_global_rank(groups.pgs.pp, pp - 1), group=groups.pgs.pp)
        grads = torch.cat([b.grad_data.detach().clone().flatten() for b in chunks[0].buffers])
        out[name] = ((logp * mask).clone(), float(loss), grads, len(micro))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def test_packed_and_token_budget_equal_the_fixed_padded_path(tp, pp):
    results = run_on_ranks(_parity, tp * pp, tp, pp, timeout=600)
    for rank_result in results:
        fixed = rank_result["fixed"]
        assert rank_result["packed"][3] < fixed[3]  # packing needs fewer micro-batches
        for name in ("budget", "packed", "packed_sdpa"):
            logp, loss, grads, _ = rank_result[name]
            assert (logp - fixed[0]).abs().max() <= 1e-6, name
            assert abs(loss - fixed[1]) <= 1e-6 * max(1.0, abs(fixed[1])), name
            assert (grads - fixed[2]).abs().max() <= 1e-6 * max(1.0, float(fixed[2].abs().max())), name
        assert fixed[2].abs().max() > 0


def test_explicit_positions_give_each_packed_sequence_its_own_rotary_table():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from hyflow.compat import cpu
    from hyflow.models import positions

    if not cpu.is_active():  # Megatron's rotary table moves to "the CUDA device"
        cpu.activate()
        request_deactivation = True
    else:
        request_deactivation = False
    try:
        _check_rotary(positions, RotaryEmbedding)
    finally:
        if request_deactivation:
            cpu.deactivate()


def _check_rotary(positions, RotaryEmbedding):
    holder = torch.nn.Module()
    holder.rotary_pos_emb = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=500)
    positions.install(holder)
    rope = holder.rotary_pos_emb
    packed = torch.tensor([[0, 1, 2, 0, 1, 0]])
    with positions.explicit_positions(holder, packed):
        emb = rope(6)
    alone = torch.cat([rope.get_emb(3), rope.get_emb(2), rope.get_emb(1)])
    assert emb.shape == (6, 1, 1, 16) and torch.equal(emb, alone)  # bit for bit each sequence alone
    assert torch.equal(rope(6), rope.get_emb(6)) and not torch.equal(rope(6), alone)  # off outside the block


def test_rollout_batch_from_the_data_planes_tensors():
    from hyflow.jobs.rl import _rollout_batch
    from hyflow.rollout.dp import SampleTensors
    from hyflow.rollout.request import SampleOutput

    samples = [SampleOutput(5, 1, [1, 2, 3], [7, 8], [-0.1, -0.2], "stop"),
               SampleOutput(4, 0, [4, 5], [9, 10, 11], [-0.3, -0.4, -0.5], "length"),
               SampleOutput(5, 0, [1, 2, 3], [], [], "length")]
    wire = SampleTensors.from_samples(samples, torch.device("cpu")).sorted()
    assert [(s.request_index, s.sample_index, s.token_ids) for s in wire.to_outputs()] == \
        [(4, 0, [9, 10, 11]), (5, 0, []), (5, 1, [7, 8])]
    b = _rollout_batch(wire, pad_id=0)
    assert b.tokens.tolist() == [[4, 5, 9, 10, 11], [1, 2, 3, 0, 0], [1, 2, 3, 7, 8]]
    assert b.response_mask.tolist() == [[0, 0, 1, 1, 1], [0] * 5, [0, 0, 0, 1, 1]]
    assert torch.allclose(b.rollout_logprobs[2], torch.tensor([0, 0, 0, -0.1, -0.2]))
    assert b.truncated.tolist() == [True, True, False] and b.group_ids.tolist() == [4, 5, 5]


def test_packed_rows_for_transformer_engine_carry_sequence_bounds():
    """With the TE spec a packed row goes to THD attention: cu_seqlens instead of a mask (the
    padding, up to a width that divides the TP size, is a sequence of its own)."""
    from hyflow.training.step import packed_seq_params

    tokens = torch.arange(3 * 6).view(3, 6)
    micro = make_micro_batches({"tokens": tokens}, [5, 2, 3], [[0, 1, 2]], packed=True, pad_multiple=4, thd=True)
    mb = micro[0]
    assert mb["tokens"].shape == (1, 12) and "attention_mask" not in mb
    assert mb["cu_seqlens"].tolist() == [0, 5, 7, 10, 12] and mb["max_seqlen"] == 5
    params = packed_seq_params(mb)
    assert params.qkv_format == "thd" and params.cu_seqlens_q is mb["cu_seqlens"] and params.max_seqlen_kv == 5
    assert packed_seq_params(make_micro_batches({"tokens": tokens}, [5, 2, 3], [[0, 1, 2]], packed=True)[0]) is None


def test_packed_sequence_bounds_stay_on_the_host_whatever_the_device():
    """The SDPA spec's attention reads a packed row's sequence bounds as a list in every layer: built
    on the batch's device they cost one device-to-host wait per layer (and again in recompute).
    Micro-batches built for another device (meta here) keep them on the host (the attention's reads:
    ``test_rollout_fused_attention.py::test_packed_sdpa_reads_only_its_host_bounds``)."""
    lengths = [5, 3, 7]
    cols = {"tokens": torch.zeros(3, 7, dtype=torch.long, device="meta")}
    micro = make_micro_batches(cols, lengths, plan_packed(lengths, 16), packed=True, bounds=True)
    assert [mb["tokens"].device.type for mb in micro] == ["meta"]
    assert [mb["attention_mask"].device.type for mb in micro] == ["cpu"]
    assert micro[0]["attention_mask"].tolist()[-1] == 15  # the packed row's bounds, read without a device
