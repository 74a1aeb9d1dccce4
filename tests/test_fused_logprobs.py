"""The fused output layer + log-softmax path (response positions only, chunked, recomputed in the
backward) against the full-logits path it replaces: log-probs, entropy, loss and gradients (fp32,
<= 1e-6) at TP 1 / 2 and PP 2, and against a float64 computation."""

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

VOCAB, PADDED, H = 200, 256, 16


def _head_data():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, H, generator=g)
    weight = torch.randn(PADDED, H, generator=g) * 0.25
    weight[VOCAB:] = torch.randn(PADDED - VOCAB, H, generator=g)  # padded rows: must not count
    labels = torch.randint(0, VOCAB, (11,), generator=g)
    w, u = torch.randn(11, generator=g), torch.randn(11, generator=g)
    return hidden, weight, labels, w, u


def _head(temperature):
    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    from hyflow.training.logprobs import fused_logprobs_entropy, vocab_parallel_entropy, vocab_parallel_logprobs

    tp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(tp)))
    hidden, weight, labels, w, u = _head_data()
    width = PADDED // tp
    out = {}
    for name in ("full", "fused", "fused_no_entropy_grad"):
        h = hidden.clone().requires_grad_(True)
        shard = weight[rank * width:(rank + 1) * width].clone().requires_grad_(True)
        x = copy_to_tensor_model_parallel_region(h, group=group) if tp > 1 else h
        if name == "full":
            logits = x @ shard.t()
            lp = vocab_parallel_logprobs(logits, labels, VOCAB, group, temperature)
            ent = vocab_parallel_entropy(logits, VOCAB, group, temperature)
        else:  # 3 rows x 48 columns a block: several row chunks and vocabulary blocks, the last
            # real block narrower than the others, padded columns skipped
            lp, ent = fused_logprobs_entropy(x, shard, labels, VOCAB, group, temperature,
                                             chunk_elements=3 * 48, vocab_block=48)
        if name == "fused_no_entropy_grad":
            (lp * w).sum().backward()
        else:
            ((lp * w).sum() + (ent * u).sum()).backward()
        out[name] = (lp.detach(), ent.detach(), h.grad, shard.grad)
    return out


def _float64_reference(temperature):
    hidden, weight, labels, w, u = _head_data()
    h = hidden.double().requires_grad_(True)
    wt = weight.double().requires_grad_(True)
    logp_all = torch.log_softmax((h @ wt[:VOCAB].t()) / temperature, dim=-1)
    lp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    ((lp * w).sum() + (ent * u).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, wt.grad


@pytest.mark.parametrize("tp,temperature", [(1, 1.0), (2, 0.7)])
def test_fused_head_equals_the_full_logits_path(tp, temperature):
    ref = _float64_reference(temperature)
    width = PADDED // tp
    for rank, out in enumerate(run_on_ranks(_head, tp, temperature)):
        full, fused = out["full"], out["fused"]
        for a, b in zip(fused, full):
            assert (a - b).abs().max() <= 1e-6 * max(1.0, float(b.abs().max()))
        lp, ent, gh, gw = fused
        torch.testing.assert_close(lp.double(), ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent.double(), ref[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gh.double(), ref[2], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(gw.double(), ref[3][rank * width:(rank + 1) * width], rtol=1e-4, atol=1e-5)
        assert float(gw[max(0, VOCAB - rank * width):].abs().sum()) == 0.0  # padded rows get nothing
        # without an entropy term the log-prob gradient alone
        no_ent = out["fused_no_entropy_grad"]
        assert not torch.allclose(no_ent[2], gh)


def _model_parity(tp, pp, tied):
    """PolicyLoss and the log-prob scorer through the real model: fused vs full logits."""
    import torch.distributed as dist

    from hyflow.models.builder import build_gpt_model
    from hyflow.models.description import tiny_llama
    from hyflow.models.weights import load_full_state_dict, random_full_state_dict
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.rl.batch import MicroBatching, make_micro_batches
    from hyflow.rl.step_losses import PolicyLoss, forward_score, logprob_scorer
    from hyflow.testing.rl import random_policy_batch
    from hyflow.training.optimizer import wrap_ddp
    from hyflow.training.step import forward_backward

    groups = init_training_groups(Layout(tp=tp, pp=pp), seed=3)
    desc = tiny_llama(vocab_size=90, num_attention_heads=4, num_query_groups=2, num_layers=2, tied_embeddings=tied)
    model = build_gpt_model(desc, groups, config_overrides={"perform_initialization": False})
    load_full_state_dict(model, random_full_state_dict(desc, seed=1), desc, groups)
    chunks = wrap_ddp([model], groups, distributed_optimizer=False)
    lengths = [9, 4, 13, 6, 6, 11]
    B, S = len(lengths), max(lengths)
    cols, cfg = random_policy_batch(lengths, 90)
    mask = cols["response_mask"]
    micro = make_micro_batches(cols, lengths, MicroBatching(2).plan(lengths), packed=False)
    out = {}
    for fused in (False, True):
        logp = forward_score(chunks, micro, logprob_scorer(90, groups.pgs.tp, 0.7, fused=fused), groups, (B, S))
        chunks[0].zero_grad_buffer()
        loss_fn = PolicyLoss(cfg, 90, groups.pgs.tp, 0.7, fused=fused)
        stats = forward_backward(chunks, micro, loss_fn=loss_fn, with_labels=False)
        vec = torch.tensor([sum(float(s[k]) for s in stats) for k in ("actor/pg_loss", "actor/entropy")],
                           dtype=torch.float64)
        dist.broadcast(vec, src=dist.get_global_rank(groups.pgs.pp, pp - 1), group=groups.pgs.pp)
        grads = torch.cat([b.grad_data.detach().clone().flatten() for b in chunks[0].buffers])
        out[fused] = ((logp * mask).clone(), vec, grads)
    return out


@pytest.mark.parametrize("tp,pp,tied", [(1, 1, True), (2, 1, False), (1, 2, True)], ids=["tp1", "tp2", "pp2"])
def test_policy_loss_fused_head_equals_full_logits(tp, pp, tied):
    for out in run_on_ranks(_model_parity, tp * pp, tp, pp, tied, timeout=600):
        (lp0, st0, g0), (lp1, st1, g1) = out[False], out[True]
        assert (lp1 - lp0).abs().max() <= 1e-6
        assert (st1 - st0).abs().max() <= 1e-6 * max(1.0, float(st0.abs().max()))
        assert float(st0[1]) > 0  # the entropy is really measured
        assert (g1 - g0).abs().max() <= 1e-6 * max(1.0, float(g0.abs().max()))
        assert g0.abs().max() > 0


def _host_syncs(fn) -> int:
    """aten ops that wait for the device (nonzero's output size, a tensor's value) while ``fn`` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.nonzero, torch.ops.aten._local_scalar_dense):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


@pytest.mark.parametrize("rows_per_block", [3, 11])
def test_fused_head_syncs_once_per_micro_batch_whatever_its_blocks(rows_per_block):
    """The label's logit is gathered with a mask, not located with ``nonzero`` (a host sync on a
    GPU) in every block: the response positions are selected once per micro-batch."""
    from hyflow.training.output_head import Hidden, response_logprobs_entropy

    hidden, weight, labels, w, u = _head_data()
    states = hidden.view(1, 11, H).requires_grad_(True)
    tokens = torch.cat([labels[:1], labels]).view(1, 12)[:, :11]
    scored = torch.ones(1, 11, dtype=torch.bool)
    scored[0, :2] = False

    def step():
        from hyflow.training import logprobs

        saved = logprobs.block_shape
        logprobs.block_shape = lambda *a, **k: (rows_per_block, 48)  # 4 row chunks x 5 vocabulary blocks
        try:
            lp, ent = response_logprobs_entropy(Hidden(states, weight.clone().requires_grad_(True)), tokens, scored,
                                                VOCAB)
            (lp.sum() + ent.sum()).backward()
        finally:
            logprobs.block_shape = saved

    assert _host_syncs(step) <= 1


def test_gpu_blocks_span_thousands_of_rows():
    from hyflow.training.logprobs import block_shape

    for vocab_shard in (151936, 128256, 151936 // 8, 49152):
        rows, columns = block_shape(torch.device("cuda"), vocab_shard)
        assert rows >= 2048 and rows * columns * 4 <= 64 * 2 ** 20  # a block of float32 logits <= 64 MiB
    assert block_shape(torch.device("cpu"), 49152) == (4096, 1024)  # the CPU's tuned shape is kept
