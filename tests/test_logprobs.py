"""Vocab-parallel log-probs and entropy (values and gradients) against a float64
full-vocabulary computation that drops the padded rows."""

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

VOCAB, PADDED = 200, 256


def _data():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, PADDED, generator=g) * 3
    logits[..., VOCAB:] = 0.0  # what zero padded rows produce
    labels = torch.randint(0, VOCAB, (3, 5), generator=g)
    w, u = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    return logits, labels, w, u


def _reference():
    logits, labels, w, u = _data()
    x = logits[..., :VOCAB].double().requires_grad_(True)
    logp_all = torch.log_softmax(x, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    ((logp * w).sum() + (ent * u).sum()).backward()
    grad = torch.cat([x.grad, torch.zeros(3, 5, PADDED - VOCAB, dtype=torch.float64)], dim=-1)
    return logp.detach(), ent.detach(), grad


def _sharded():
    import torch.distributed as dist

    from hyflow.training.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs

    tp = dist.get_world_size()
    group = dist.new_group(list(range(tp)))
    logits, labels, w, u = _data()
    width = PADDED // tp
    rank = dist.get_rank()
    local = logits[..., rank * width:(rank + 1) * width].clone().requires_grad_(True)
    logp = vocab_parallel_logprobs(local, labels, VOCAB, group)
    ent = vocab_parallel_entropy(local, VOCAB, group)
    ((logp * w).sum() + (ent * u).sum()).backward()
    return logp.detach(), ent.detach(), local.grad


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_logprobs_and_entropy(tp):
    ref_logp, ref_ent, ref_grad = _reference()
    results = run_on_ranks(_sharded, tp)
    width = PADDED // tp
    for rank, (logp, ent, grad) in enumerate(results):
        torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
        # (the reference gradient is exactly zero on padded columns)
        torch.testing.assert_close(grad.double(), ref_grad[..., rank * width:(rank + 1) * width],
                                   rtol=1e-4, atol=1e-6)
