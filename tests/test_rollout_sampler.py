"""Sampler of the rollout engine on fixed logits: distributions, log-probs, padding, TP sharding.

The intended truncated distributions come from ``transformers``' own logits warpers
(temperature -> top-k -> top-p), an independent reference.
"""
from __future__ import annotations

import math

import pytest
import torch

from hyflow.rollout.sampler import RowParams, VocabParallelSampler, stream_seed, uniforms
from hyflow.testing import run_on_ranks

V = 40  # real vocabulary of the fixed-logit tests
CASES = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.7, 5, 1.0),
    (1.3, 0, 0.8),
    (0.9, 8, 0.6),
    (2.0, 0, 0.97),
]


def _logits(seed: int = 0, vocab: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * 2.0


def _reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """HF ``generate``'s warpers applied to one row of logits -> probabilities."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    scores = logits.unsqueeze(0).clone()
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1)[0]


def _draw(sampler: VocabParallelSampler, local: torch.Tensor, case, n: int, seed: int = 0):
    t, k, p = case
    u = torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    params = RowParams.build([t] * n, [k] * n, [p] * n, u)
    return sampler(local.unsqueeze(0).expand(n, -1).contiguous(), params)


@pytest.mark.parametrize("case", CASES)
def test_empirical_distribution_matches_truncated_distribution(case):
    logits = _logits()
    padded = torch.cat([logits, torch.full((8,), 50.0)])  # padding rows with huge logits
    sampler = VocabParallelSampler(V, V + 8)
    n = 20_000
    tokens, logprobs = _draw(sampler, padded, case, n)
    want = _reference_probs(logits, *case)
    counts = torch.bincount(tokens, minlength=V + 8).double()
    assert counts[V:].sum() == 0, "padded vocabulary rows were sampled"
    freq = counts[:V] / n
    assert torch.all(counts[:V][want == 0] == 0), "a token outside the truncated set was sampled"
    sigma = torch.sqrt(want * (1 - want) / n)
    assert torch.all((freq - want).abs() <= 5 * sigma + 1e-9), (case, (freq - want).abs().max())
    chi2 = float((((counts[:V] - n * want) ** 2) / (n * want)).nan_to_num(0)[want > 0].sum())
    dof = int((want > 0).sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof), (case, chi2, dof)
    # Log-probs: of the untruncated tempered distribution.
    ref = torch.log_softmax(logits / case[0], dim=-1)
    assert torch.allclose(logprobs, ref[tokens], atol=1e-5)


def test_greedy_rows_take_first_argmax_and_mix_with_sampled_rows():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 9.0]])
    sampler = VocabParallelSampler(3, 4)  # id 3 is padding
    params = RowParams.build([0.0, 0.0, 1.0], [0, 0, 0], [1.0, 1.0, 1.0],
                             torch.tensor([0.5, 0.5, 0.999], dtype=torch.float64))
    tokens, logprobs = sampler(logits, params)
    assert tokens[:2].tolist() == [1, 0]
    assert tokens[2].item() in (0, 1, 2)  # padding (id 3, logit 9) never sampled
    ref = torch.log_softmax(logits[:, :3], dim=-1)
    assert torch.allclose(logprobs[:2], ref[[0, 1], tokens[:2]], atol=1e-6)


def test_counter_based_uniforms_are_deterministic_and_uniform():
    streams = [stream_seed(7, i, j) for i in range(50) for j in range(4)]
    a = uniforms(streams, [3] * len(streams))
    assert torch.equal(a, uniforms(streams, [3] * len(streams)))
    assert not torch.equal(a, uniforms(streams, [4] * len(streams)))
    assert len(set(streams)) == len(streams)
    big = uniforms([stream_seed(1, 0, 0)] * 20000, list(range(20000)))
    assert 0 <= float(big.min()) and float(big.max()) < 1
    hist = torch.histc(big.float(), bins=10, min=0, max=1)
    assert torch.all((hist - 2000).abs() < 200)


# ----------------------------------------------------------------------------- TP = 2


def _sharded_draws(vocab: int, local: int, initial: int):
    """Rank fn: sample from the rank's half of fixed logits; returns tokens and log-probs per case."""
    import torch.distributed as dist

    from hyflow.rollout import sampler as sampler_mod

    sampler_mod._INITIAL_CANDIDATES = initial  # force the top-p candidate widening
    group = dist.new_group([0, 1])
    full = torch.cat([_logits(3, vocab), torch.full((2 * local - vocab,), 30.0)])
    mine = full[dist.get_rank() * local:(dist.get_rank() + 1) * local]
    sharded = VocabParallelSampler(vocab, local, group)
    single = VocabParallelSampler(vocab, 2 * local)
    out = {}
    for case in CASES + [(0.0, 0, 1.0)]:
        tp2 = _draw(sharded, mine, case, 500, seed=11)
        tp1 = _draw(single, full, case, 500, seed=11)
        out[case] = (tp2, tp1)
    return out


@pytest.mark.multirank
def test_vocab_parallel_sampling_equals_single_rank_sampling():
    # 300 real ids over 2 x 256 columns: rank 1 holds 44 real ids and 212 padding rows.
    results = run_on_ranks(_sharded_draws, 2, 300, 256, 4)
    for rank_out in results:
        for case, ((tok2, lp2), (tok1, lp1)) in rank_out.items():
            assert torch.equal(tok2, tok1), case
            assert int(tok2.max()) < 300
            assert torch.allclose(lp2, lp1, atol=1e-5), case
