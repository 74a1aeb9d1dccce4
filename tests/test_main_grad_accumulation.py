"""Weight gradients that go straight into Megatron DDP's ``main_grad`` buffer -- the fused output
head, the embedding lookup (:mod:`hyflow.models.embedding_grad`) and Megatron's gradient-accumulation
fusion on the linear layers (the CPU layer's GEMM-accumulate kernel) -- equal the gradients plain
autograd gives the same model outside DDP (``param.grad``, dense embedding gradient, separate
weight-gradient GEMMs), over several micro-batches, with tied and untied output weights."""

import pytest

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank


def _grads(tied: bool, fused: bool):
    from hyflow.models.builder import build_gpt_model
    from hyflow.models.description import tiny_llama
    from hyflow.models.weights import load_full_state_dict, random_full_state_dict
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.rl.batch import MicroBatching, make_micro_batches
    from hyflow.rl.step_losses import PolicyLoss
    from hyflow.testing.rl import random_policy_batch
    from hyflow.training.optimizer import wrap_ddp
    from hyflow.training.step import forward_backward

    groups = init_training_groups(Layout(), seed=3)
    desc = tiny_llama(vocab_size=90, num_attention_heads=4, num_query_groups=2, num_layers=2, tied_embeddings=tied)
    state = random_full_state_dict(desc, seed=1)
    lengths = [9, 4, 13, 6, 6, 11]
    cols, cfg = random_policy_batch(lengths, 90)
    micro = make_micro_batches(cols, lengths, MicroBatching(2).plan(lengths), packed=False)
    out = {}
    for wrapped in (False, True):
        model = build_gpt_model(desc, groups, config_overrides={"perform_initialization": False})
        load_full_state_dict(model, state, desc, groups)
        chunks = wrap_ddp([model], groups, distributed_optimizer=False) if wrapped else [model]
        if wrapped:
            chunks[0].zero_grad_buffer()
        forward_backward(chunks, micro, loss_fn=PolicyLoss(cfg, 90, groups.pgs.tp, 0.7, fused=fused),
                         with_labels=False)
        grads = {}
        for name, p in model.named_parameters():
            g = p.main_grad if wrapped else p.grad
            grads[name] = None if g is None else g.detach().clone()
        fused_layers = sum(bool(getattr(m, "gradient_accumulation_fusion", False)) for m in model.modules())
        out[wrapped] = (grads, fused_layers)
    return out


@pytest.mark.parametrize("tied,fused", [(True, True), (True, False), (False, True)],
                         ids=["tied-fused-head", "tied-full-logits", "untied-fused-head"])
def test_main_grad_paths_equal_plain_autograd(tied, fused):
    out = run_on_ranks(_grads, 1, tied, fused, timeout=300)[0]
    (plain, plain_fused), (ddp, ddp_fused) = out[False], out[True]
    assert plain_fused == 0 and ddp_fused > 0  # the fusion runs only where main_grad exists
    assert set(plain) == set(ddp)
    for name, want in plain.items():
        assert want is not None and float(want.abs().max()) > 0, name
        got = ddp[name]
        assert (got - want).abs().max() <= 1e-6 * max(1.0, float(want.abs().max())), name
