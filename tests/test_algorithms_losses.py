"""Parity tests for hyflow.algorithms' losses (aggregation modes, PPO with dual clip, value,
DPO, KTO) against independent float64 references. PPO and the value loss are aggregated as the
step aggregates them: per-token losses times the per-token weights of ``aggregation_weights``.

Every reference below is written straight from the formula with Python loops / numpy; none
calls the function under test.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hyflow.algorithms import (
    LOSS_AGG_MODES,
    aggregation_weights,
    dpo_loss,
    kto_loss,
    masked_mean,
    value_token_loss,
    vanilla_policy_loss,
)
from hyflow.testing.references import aggregate_loss

from algorithms_reference import (
    B,
    F64,
    MASK_ROWS,
    NORM,
    T,
    close,
    mask_t,
    rand,
    valid,
    with_garbage,
)


# ---------------------------------------------------------------------------------- losses


def ref_aggregate(lm, mode, norm_length=None, rows=None):
    rows = MASK_ROWS if rows is None else rows
    idx = [[t for t, on in enumerate(row) if on] for row in rows]
    if mode == "token-mean":
        vals = [lm[b][t] for b in range(len(rows)) for t in idx[b]]
        return sum(vals) / len(vals)
    seqs = []
    for b in range(len(rows)):
        if not idx[b]:
            continue
        s = sum(lm[b][t] for t in idx[b])
        seqs.append({"seq-mean-token-sum": s, "seq-mean-token-mean": s / len(idx[b]),
                     "seq-mean-token-sum-norm": s / (norm_length or NORM)}[mode])
    return sum(seqs) / len(seqs)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_loss_modes(mode):
    lm = rand(B, T, seed=18)
    close(aggregate_loss(with_garbage(lm), mask_t(), mode, NORM), ref_aggregate(lm.numpy(), mode))
    if mode == "seq-mean-token-sum-norm":
        close(aggregate_loss(lm, mask_t(), mode, norm_length=32), ref_aggregate(lm.numpy(), mode, 32))
    empty = torch.zeros(B, T, dtype=torch.bool)
    assert aggregate_loss(lm, empty, mode, NORM).item() == 0.0


def test_seq_mean_token_sum_norm_needs_a_constant_normaliser():
    """Dr. GRPO divides each sequence's token sum by a constant of the run; the padded width of a
    batch is not one (it changes from step to step), so it is never used as a default."""
    lm = rand(B, T, seed=18)
    with pytest.raises(ValueError, match="max_new_tokens"):  # the step's weights
        aggregation_weights(mask_t(F64), "seq-mean-token-sum-norm")
    # extra padding columns (a longer sequence elsewhere in the step) change nothing
    wide = torch.cat([lm, rand(B, 5, seed=99)], dim=1)
    wide_mask = torch.cat([mask_t(), torch.zeros(B, 5, dtype=torch.bool)], dim=1)
    assert aggregated(wide, wide_mask, "seq-mean-token-sum-norm", 64).item() == \
        pytest.approx(aggregated(lm, mask_t(), "seq-mean-token-sum-norm", 64).item(), rel=1e-14)


def test_aggregate_loss_rejects_unknown_mode():
    with pytest.raises(ValueError):
        aggregate_loss(rand(2, 3), torch.ones(2, 3), "seq-sum")


def aggregated(loss_mat, mask, mode, norm_length=None):
    """One batch's loss as the step aggregates it on one rank: sum(w * x) / d."""
    w, d = aggregation_weights(mask.to(F64), mode, norm_length)
    return (w * loss_mat).sum() / d


def ppo_policy_loss(logp, old, adv, mask, lo, hi=None, clip_ratio_c=None, agg_mode="token-mean", norm_length=None):
    """vanilla_policy_loss aggregated over the batch, with its statistics' masked means."""
    tok, st = vanilla_policy_loss(logp, old, adv, mask, clip_ratio_low=lo, clip_ratio_high=hi,
                                  clip_ratio_c=clip_ratio_c)
    stats = {"clip_frac": st["clip_frac"], "clip_frac_lower": st["clip_frac_lower"], "approx_kl": st["approx_kl"],
             "ratio_mean": st["ratio"]}
    return aggregated(tok, mask, agg_mode, norm_length), {k: masked_mean(v, mask) for k, v in stats.items()}


def value_loss(v, old, ret, mask, clip, agg_mode="token-mean"):
    """value_token_loss aggregated over the batch, with its clip fraction's masked mean."""
    tok, st = value_token_loss(v, old, ret, mask, clip)
    return aggregated(tok, mask, agg_mode), {"vf_clipfrac": masked_mean(st["vf_clipfrac"], mask)}


# One row, every PPO branch: eps_low=0.2, eps_high=0.28, c=3.
#   t0 A>0, ratio 1.5 > 1.28   -> clipped (-A*1.28)
#   t1 A>0, ratio 0.5 < 0.8    -> unclipped (-A*0.5)
#   t2 A<0, ratio 0.5 < 0.8    -> clipped (-A*0.8)
#   t3 A<0, ratio 5.0 > c      -> dual clip (-A*3)
#   t4 A<0, ratio 2.0 in (1.28, c) -> unclipped (-A*2)
#   t5 A>0, ratio 1.1 inside   -> unclipped
#   t6 padding (garbage)
PPO_RATIO = [1.5, 0.5, 0.5, 5.0, 2.0, 1.1, 7.0]
PPO_ADV = [1.0, 2.0, -1.5, -0.5, -1.0, 0.7, 9.0]
PPO_MASK = [1, 1, 1, 1, 1, 1, 0]


def ppo_inputs():
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.2, -0.7, -1.0]], dtype=F64)
    logp = (old + torch.log(torch.tensor([PPO_RATIO], dtype=F64))).requires_grad_(True)
    return logp, old, torch.tensor([PPO_ADV], dtype=F64), torch.tensor([PPO_MASK])


def ref_ppo_token(ratio, a, lo, hi, c):
    l1 = -a * ratio
    l2 = -a * min(max(ratio, 1 - lo), 1 + hi)
    out = max(l1, l2)
    clipped = l2 > l1
    lower = False
    if c is not None and a < 0 and -a * c < out:
        out, lower = -a * c, True
    return out, clipped, lower


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_ppo_policy_loss_dual_clip(mode):
    logp, old, adv, m = ppo_inputs()
    loss, stats = ppo_policy_loss(logp, old, adv, m, 0.2, 0.28, clip_ratio_c=3.0, agg_mode=mode, norm_length=NORM)
    toks = [ref_ppo_token(PPO_RATIO[t], PPO_ADV[t], 0.2, 0.28, 3.0) for t in range(6)]
    lm = [[x[0] for x in toks] + [0.0]]
    close(loss, ref_aggregate(lm, mode, rows=[PPO_MASK]))
    # hand counts: the clipped branch is taken on t0 and t2 only (on t3 the unclipped
    # -A*5 = 2.5 beats -A*1.28 = 0.64); the dual-clip bound -A*3 = 1.5 < 2.5 is taken on t3.
    assert [x[1] for x in toks] == [True, False, True, False, False, False]
    assert [x[2] for x in toks] == [False, False, False, True, False, False]
    assert stats["clip_frac"].item() == pytest.approx(2 / 6, abs=1e-12)
    assert stats["clip_frac_lower"].item() == pytest.approx(1 / 6, abs=1e-12)
    assert stats["ratio_mean"].item() == pytest.approx(sum(PPO_RATIO[:6]) / 6, rel=1e-12)
    assert stats["approx_kl"].item() == pytest.approx(-sum(math.log(r) for r in PPO_RATIO[:6]) / 6, rel=1e-12)
    # exact values of the hand-picked branches
    assert toks[0][0] == pytest.approx(-1.28) and toks[3][0] == pytest.approx(1.5)
    assert toks[2][0] == pytest.approx(1.2) and toks[4][0] == pytest.approx(2.0)


def test_ppo_gradient_zero_on_clipped_tokens():
    logp, old, adv, m = ppo_inputs()
    loss, _ = ppo_policy_loss(logp, old, adv, m, 0.2, 0.28, clip_ratio_c=3.0, agg_mode="token-mean")
    loss.backward()
    g = logp.grad[0]
    # clipped (t0, t2), dual-clipped (t3), padding (t6): exactly zero
    for t in (0, 2, 3, 6):
        assert g[t].item() == 0.0
    # unclipped: d/dlogp (-A * ratio) / N = -A * ratio / 6
    for t in (1, 4, 5):
        assert g[t].item() == pytest.approx(-PPO_ADV[t] * PPO_RATIO[t] / 6, rel=1e-10)
    # without dual clip t3 follows the unclipped branch and has gradient
    logp2, old, adv, m = ppo_inputs()
    loss2, stats2 = ppo_policy_loss(logp2, old, adv, m, 0.2, 0.28, clip_ratio_c=None)
    loss2.backward()
    assert logp2.grad[0, 3].item() == pytest.approx(0.5 * 5.0 / 6, rel=1e-10)
    assert stats2["clip_frac_lower"].item() == 0.0


def test_ppo_symmetric_random_parity_and_ratio_clamp():
    logp, old, adv = rand(B, T, seed=19, scale=0.4), rand(B, T, seed=20, scale=0.4), rand(B, T, seed=21)
    logp[0, 0] = old[0, 0] + 50.0  # log-ratio clamped at 20
    loss, stats = ppo_policy_loss(with_garbage(logp), old, adv, mask_t(), 0.2, agg_mode="seq-mean-token-mean")
    lm, n_clip, n = np.zeros((B, T)), 0, 0
    for b in range(B):
        for t in valid(b):
            ratio = math.exp(min(max(logp[b, t].item() - old[b, t].item(), -20), 20))
            lm[b][t], c, _ = ref_ppo_token(ratio, adv[b, t].item(), 0.2, 0.2, None)
            n_clip += c
            n += 1
    close(loss, ref_aggregate(lm, "seq-mean-token-mean"))
    assert stats["clip_frac"].item() == pytest.approx(n_clip / n, abs=1e-12) and 0 < n_clip < n
    with pytest.raises(ValueError):
        ppo_policy_loss(logp, old, adv, mask_t(), 0.2, clip_ratio_c=1.0)


@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss(clip):
    v = rand(B, T, seed=22).requires_grad_(True)
    old, ret = rand(B, T, seed=23), rand(B, T, seed=24)
    loss, stats = value_loss(v, old, ret, mask_t(), clip, agg_mode="token-mean")
    lm, taken = np.zeros((B, T)), []
    for b in range(B):
        for t in valid(b):
            vv, vo, r = v[b, t].item(), old[b, t].item(), ret[b, t].item()
            e1 = (vv - r) ** 2
            if clip is None:
                lm[b][t] = e1
                continue
            vc = vo + min(max(vv - vo, -clip), clip)
            e2 = (vc - r) ** 2
            lm[b][t] = max(e1, e2)
            taken.append((b, t) if e2 > e1 else None)
    close(loss, 0.5 * ref_aggregate(lm, "token-mean"))
    hits = [x for x in taken if x is not None]
    n = sum(len(valid(b)) for b in range(B))
    assert stats["vf_clipfrac"].item() == pytest.approx(len(hits) / n, abs=1e-12)
    loss.backward()
    if clip is not None:
        assert hits, "test data should exercise the clipped branch"
        for b, t in hits:
            assert v.grad[b, t].item() == 0.0
    for b in range(B):
        for t in range(T):
            if not MASK_ROWS[b][t]:
                assert v.grad[b, t].item() == 0.0


@pytest.mark.parametrize("kind,ls", [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0)])
def test_dpo_loss(kind, ls):
    pc, pr, rc, rr = (rand(5, seed=s) for s in (26, 27, 28, 29))
    beta = 0.25
    loss, cr, rj = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=ls, kind=kind)
    per = []
    for i in range(5):
        h = (pc[i].item() - rc[i].item()) - (pr[i].item() - rr[i].item())
        if kind == "sigmoid":
            lsig = lambda x: -math.log1p(math.exp(-x))  # noqa: E731
            per.append(-(1 - ls) * lsig(beta * h) - ls * lsig(-beta * h))
        else:
            per.append((h - 1 / (2 * beta)) ** 2)
    close(loss, sum(per) / 5)
    close(cr, [beta * (pc[i].item() - rc[i].item()) for i in range(5)])
    close(rj, [beta * (pr[i].item() - rr[i].item()) for i in range(5)])
    per_t, _, _ = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=ls, kind=kind, reduction="none")
    close(per_t, per)
    assert not cr.requires_grad


def test_kto_loss():
    pl, rl = rand(6, seed=30), rand(6, seed=31)
    des = torch.tensor([True, False, True, True, False, False])
    beta, wd, wu = 0.3, 1.0, 1.33
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    for kl_point in (0.4, -0.2):
        z0 = max(kl_point, 0.0)
        ref = []
        for i in range(6):
            r = pl[i].item() - rl[i].item()
            ref.append(wd * (1 - sig(beta * (r - z0))) if des[i] else wu * (1 - sig(beta * (z0 - r))))
        kp = torch.tensor(kl_point, dtype=F64, requires_grad=True)
        loss = kto_loss(pl, rl, des, kp, beta, wd, wu)
        close(loss, sum(ref) / 6)
    # the reference point receives no gradient
    pl_g = pl.clone().requires_grad_(True)
    kp = torch.tensor(0.4, dtype=F64, requires_grad=True)
    kto_loss(pl_g, rl, des, kp, beta, wd, wu).backward()
    assert kp.grad is None and pl_g.grad is not None
