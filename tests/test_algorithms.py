"""Parity tests for hyflow.algorithms (masked reductions, advantage estimators, KL) against
independent float64 references; the losses are in test_algorithms_losses.

Every reference below is written straight from the formula with Python loops / numpy; none
calls the function under test.
"""
from __future__ import annotations

import math
import random
from fractions import Fraction

import numpy as np
import pytest
import torch

import hyflow.algorithms as alg
from hyflow.algorithms import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    apply_kl_penalty,
    dpo_loss,
    gae,
    grpo_outcome,
    kl_estimate,
    kto_loss,
    last_token_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    reinforce_pp,
    reinforce_pp_baseline,
    remax,
    rloo,
    scatter_to_last_token,
    value_token_loss,
    vanilla_policy_loss,
    AdaptiveKLController,
    FixedKLController,
)
from hyflow.testing.references import aggregate_loss

from algorithms_reference import (
    B,
    F64,
    NORM,
    T,
    broadcast_ref,
    close,
    mask_t,
    np_whiten,
    rand,
    valid,
    with_garbage,
)


# ----------------------------------------------------------------------------------- masked


def test_masked_reductions_match_numpy_and_ignore_padding():
    x = rand(B, T, seed=1)
    xg = with_garbage(x)
    m = mask_t()
    vals = [x[b, t].item() for b in range(B) for t in valid(b)]
    n = len(vals)
    mean = sum(vals) / n
    close(masked_sum(xg, m), sum(vals))
    close(masked_mean(xg, m), mean)
    close(masked_var(xg, m), sum((v - mean) ** 2 for v in vals) / (n - 1))
    close(masked_var(xg, m, unbiased=False), sum((v - mean) ** 2 for v in vals) / n)
    close(masked_whiten(xg, m), np_whiten(x.numpy()))
    close(masked_whiten(xg, m, shift_mean=False), np_whiten(x.numpy()) + mean * m.numpy())
    # per-row mean, empty row -> 0 (no NaN)
    row_mean = [sum(x[b, t].item() for t in valid(b)) / max(len(valid(b)), 1) for b in range(B)]
    close(masked_mean(xg, m, dim=-1), row_mean)
    close(masked_sum(xg, m.long(), dim=1), [sum(x[b, t].item() for t in valid(b)) for b in range(B)])
    # float mask = weights
    w = torch.rand(B, T, generator=torch.Generator().manual_seed(2), dtype=F64) * m
    ref = sum(x[b, t].item() * w[b, t].item() for b in range(B) for t in range(T)) / w.sum().item()
    close(masked_mean(x, w), ref)
    # empty selection
    z = torch.zeros(B, T, dtype=torch.bool)
    assert masked_mean(x, z).item() == 0.0 and masked_var(x, z).item() == 0.0
    assert torch.isfinite(masked_whiten(x, z)).all()


def test_last_token_index_and_scatter():
    m = mask_t()
    assert last_token_index(m).tolist() == [6, 3, -1, 0, 6, 4]
    scores = torch.arange(1.0, B + 1, dtype=F64)
    out = scatter_to_last_token(scores, m)
    ref = np.zeros((B, T))
    for b in range(B):
        if valid(b):
            ref[b][valid(b)[-1]] = b + 1
    close(out, ref)


# ------------------------------------------------------------------------------ advantages


def ref_gae(r, v, gamma, lam):
    adv, ret = np.zeros((B, T)), np.zeros((B, T))
    for b in range(B):
        next_v, last = 0.0, 0.0
        for t in reversed(valid(b)):
            delta = r[b][t] + gamma * next_v - v[b][t]
            last = delta + gamma * lam * last
            adv[b][t] = last
            ret[b][t] = last + v[b][t]
            next_v = v[b][t]
    return adv, ret


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)])
def test_gae_matches_backward_loop(gamma, lam):
    r, v = rand(B, T, seed=3), rand(B, T, seed=4)
    adv, ret = gae(with_garbage(r), with_garbage(v), mask_t(), gamma, lam)
    ref_adv, ref_ret = ref_gae(r.numpy(), v.numpy(), gamma, lam)
    close(adv, ref_adv)
    close(ret, ref_ret)
    assert adv.dtype == F64 and torch.isfinite(adv).all() and torch.isfinite(ret).all()
    # whitening is a separate option; returns stay the raw ones
    adv_w, ret_w = gae(r, v, mask_t(torch.float64), gamma, lam, whiten_advantages=True)
    close(adv_w, np_whiten(ref_adv))
    close(ret_w, ref_ret)


def test_gae_padding_does_not_propagate():
    """Changing rewards/values at padding leaves every output unchanged."""
    r, v = rand(B, T, seed=5), rand(B, T, seed=6)
    pad = ~mask_t()
    a1, r1 = gae(r, v, mask_t(), 0.9, 0.8)
    a2, r2 = gae(r + 100.0 * pad, v - 50.0 * pad, mask_t(), 0.9, 0.8)
    torch.testing.assert_close(a1, a2, rtol=0, atol=0)
    torch.testing.assert_close(r1, r2, rtol=0, atol=0)
    assert (a1[pad] == 0).all() and (r1[pad] == 0).all()
    # length-1 response: A = r - V (terminal), empty row: all zero
    assert a1[3, 0].item() == pytest.approx(r[3, 0].item() - v[3, 0].item(), abs=1e-12)
    assert (a1[2] == 0).all()


# Groups of sizes 1, 2, 5 and an identical-reward group of 3, interleaved and shuffled.
def make_groups():
    rng = random.Random(0)
    ids = ["solo"] + ["pair"] * 2 + ["five"] * 5 + ["same"] * 3
    rng.shuffle(ids)
    scores = []
    for g in ids:
        scores.append(0.7 if g == "same" else rng.uniform(-2, 3))
    return ids, scores


GT = 5


def group_mask(n):
    rows = [[1] * GT, [1] * 3 + [0] * 2, [0] * GT, [1] + [0] * (GT - 1)]
    return torch.tensor([rows[i % 4] for i in range(n)], dtype=torch.bool)


def ref_group_stats(ids, scores):
    groups = {}
    for g, s in zip(ids, scores):
        groups.setdefault(g, []).append(s)
    return groups


def bcast(per_seq, m):
    return np.array([[per_seq[b] if m[b, t] else 0.0 for t in range(m.shape[1])] for b in range(len(per_seq))])


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_outcome_groups(norm_by_std):
    ids, scores = make_groups()
    n = len(ids)
    m = group_mask(n)
    groups = ref_group_stats(ids, scores)
    ref = []
    for g, s in zip(ids, scores):
        members = groups[g]
        if len(members) == 1:
            ref.append(0.0)
            continue
        # exact rational arithmetic: an identical-score group is exactly 0 in the reference too
        mu = sum(map(Fraction, members)) / len(members)
        sd = math.sqrt(sum((Fraction(x) - mu) ** 2 for x in members) / (len(members) - 1))
        ref.append(float(Fraction(s) - mu) / (sd + 1e-6) if norm_by_std else float(Fraction(s) - mu))
    st = torch.tensor(scores, dtype=F64)
    out = grpo_outcome(st, ids, m, norm_by_std=norm_by_std)
    close(out, bcast(ref, m))
    assert torch.isfinite(out).all()
    same = torch.tensor([g == "same" for g in ids])
    assert (out[same] == 0).all() and (out[[ids.index("solo")]] == 0).all()
    # integer-tensor group ids give the same answer
    int_ids = torch.tensor([{"solo": 7, "pair": -3, "five": 42, "same": 0}[g] for g in ids])
    torch.testing.assert_close(grpo_outcome(st, int_ids, m, norm_by_std=norm_by_std), out, rtol=0, atol=0)
    if not norm_by_std:
        torch.testing.assert_close(ADV_ESTIMATORS["dr_grpo"](st, ids, m), out, rtol=0, atol=0)


def test_rloo_leave_one_out():
    ids, scores = make_groups()
    m = group_mask(len(ids))
    ref = []
    for i, (g, s) in enumerate(zip(ids, scores)):
        others = [scores[j] for j in range(len(ids)) if ids[j] == g and j != i]
        ref.append(float(Fraction(s) - sum(map(Fraction, others)) / len(others)) if others else 0.0)
    out = rloo(torch.tensor(scores, dtype=F64), ids, m)
    close(out, bcast(ref, m))
    assert (out[torch.tensor([g in ("same", "solo") for g in ids])] == 0).all()


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_return_to_go_whitened(gamma):
    r = rand(B, T, seed=7)
    adv, ret = reinforce_pp(with_garbage(r), mask_t(), gamma)
    ref_ret = np.zeros((B, T))
    for b in range(B):
        g = 0.0
        for t in reversed(valid(b)):
            g = r[b, t].item() + gamma * g
            ref_ret[b][t] = g
    close(ret, ref_ret)
    close(adv, np_whiten(ref_ret))


def test_reinforce_pp_baseline():
    ids, scores = make_groups()
    n = len(ids)
    m = group_mask(n)
    groups = ref_group_stats(ids, scores)
    centered = [float(Fraction(s) - sum(map(Fraction, groups[g])) / len(groups[g])) for g, s in zip(ids, scores)]
    vals = [centered[b] for b in range(n) for t in range(GT) if m[b, t]]
    mu = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / (len(vals) - 1) + 1e-8)
    ref = np.array([[(centered[b] - mu) / sd if m[b, t] else 0.0 for t in range(GT)] for b in range(n)])
    close(reinforce_pp_baseline(torch.tensor(scores, dtype=F64), ids, m), ref)


def test_remax():
    s, g = rand(B, seed=8), rand(B, seed=9)
    close(remax(s, g, mask_t()), broadcast_ref([s[b].item() - g[b].item() for b in range(B)]))


# -------------------------------------------------------------------------------------- KL


def test_kl_estimators_exact():
    logp, ref = rand(B, T, seed=10), rand(B, T, seed=11)
    for kind in KL_ESTIMATORS:
        out = kl_estimate(logp, ref, kind)
        exp = np.zeros((B, T))
        for b in range(B):
            for t in range(T):
                lp, rp = logp[b, t].item(), ref[b, t].item()
                d = rp - lp
                exp[b][t] = {
                    "k1": lp - rp,
                    "abs": abs(lp - rp),
                    "k2": 0.5 * (lp - rp) ** 2,
                    "k3": math.exp(d) - d - 1,
                    "low_var_kl": min(max(math.exp(d) - d - 1, -10), 10),
                }[kind]
        close(out, exp, atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k4")


def test_k3_nonnegative_and_low_var_clamped():
    lp = rand(4000, seed=12, scale=8.0)
    rp = rand(4000, seed=13, scale=8.0)
    assert (kl_estimate(lp, rp, "k3") >= 0).all()
    lv = kl_estimate(lp, rp, "low_var_kl")
    assert (lv >= 0).all() and (lv <= 10).all() and (lv == 10).any()
    assert kl_estimate(lp, rp, "low_var_kl", clamp=None).max() > 10
    # exact zero when the policies agree
    assert (kl_estimate(lp, lp, "k3") == 0).all()
    # extreme log-ratio stays finite for low_var_kl
    big = torch.tensor([0.0], dtype=F64)
    assert torch.isfinite(kl_estimate(big, big + 1000.0, "low_var_kl", clamp=None)).all()


def test_adaptive_kl_controller_trajectory():
    ctl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    kls = [12.0, 3.0, 6.6, 0.0, 6.0]
    # errors: clip(1.0)=0.2, clip(-0.5)=-0.2, 0.1, clip(-1)=-0.2, 0.0 ; n_steps = 256
    expected = 0.1
    hand = [1 + 0.2 * 256 / 10000, 1 - 0.2 * 256 / 10000, 1 + 0.1 * 256 / 10000, 1 - 0.2 * 256 / 10000, 1.0]
    for kl, mult in zip(kls, hand):
        expected *= mult
        assert ctl.update(kl, 256) == pytest.approx(expected, rel=1e-12)
    assert ctl.value == pytest.approx(0.1 * 1.00512 * 0.99488 * 1.00256 * 0.99488, rel=1e-12)
    state = ctl.state_dict()
    other = AdaptiveKLController(1.0, 1.0, 1.0)
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert other.update(12.0, 256) == pytest.approx(ctl.update(12.0, 256), rel=0)
    fixed = FixedKLController(0.05)
    assert fixed.update(100.0, 256) == 0.05
    f2 = FixedKLController(0.0)
    f2.load_state_dict(fixed.state_dict())
    assert f2.value == 0.05


@pytest.mark.parametrize("kind", ["k1", "k3", "low_var_kl"])
def test_apply_kl_penalty(kind):
    logp, ref = rand(B, T, seed=14), rand(B, T, seed=15)
    coef = 0.3
    outcome = rand(B, seed=16)

    def kl(lp, rp):
        d = rp - lp
        return {"k1": lp - rp, "k3": math.exp(d) - d - 1, "low_var_kl": min(max(math.exp(d) - d - 1, -10), 10)}[kind]

    exp = np.zeros((B, T))
    for b in range(B):
        for t in valid(b):
            s = outcome[b].item() if t == valid(b)[-1] else 0.0
            exp[b][t] = s - coef * kl(logp[b, t].item(), ref[b, t].item())
    close(apply_kl_penalty(outcome, logp, ref, mask_t(), coef, kind), exp)
    token_scores = rand(B, T, seed=17)
    exp_tok = np.zeros((B, T))
    for b in range(B):
        for t in valid(b):
            exp_tok[b][t] = token_scores[b, t].item() - coef * kl(logp[b, t].item(), ref[b, t].item())
    close(apply_kl_penalty(token_scores, logp, ref, mask_t(), coef, kind), exp_tok)


# ------------------------------------------------------------------------- dtype, registry


def test_float32_dtype_preserved():
    f = torch.float32
    m = mask_t()
    x, y, z = rand(B, T, seed=32).to(f), rand(B, T, seed=33).to(f), rand(B, T, seed=34).to(f)
    s, g = rand(B, seed=35).to(f), [0, 0, 1, 1, 1, 2]
    outs = [
        masked_mean(x, m), masked_var(x, m), masked_whiten(x, m), *gae(x, y, m, 0.99, 0.95),
        grpo_outcome(s, g, m), rloo(s, g, m), *reinforce_pp(x, m), reinforce_pp_baseline(s, g, m),
        remax(s, s, m), apply_kl_penalty(s, x, y, m, 0.1, "k3"),
        vanilla_policy_loss(x, y, z, m, clip_ratio_low=0.2, clip_ratio_c=3.0)[0], value_token_loss(x, y, z, m, 0.2)[0],
        dpo_loss(s, s, s, s)[0], kto_loss(s, s, s > 0, torch.tensor(0.1)),
        *[kl_estimate(x, y, k) for k in KL_ESTIMATORS],
        *[aggregate_loss(x, m, mode, NORM) for mode in LOSS_AGG_MODES],
    ]
    for o in outs:
        assert o.dtype == f and torch.isfinite(o).all()


def test_registries():
    assert set(ADV_ESTIMATORS) >= {"gae", "grpo", "dr_grpo", "grpo_passk", "rloo", "reinforce_plus_plus",
                                   "reinforce_plus_plus_baseline", "remax"}
    assert all(callable(f) for f in ADV_ESTIMATORS.values())
    assert ADV_ESTIMATORS["gae"] is gae and ADV_ESTIMATORS["grpo"] is grpo_outcome
    assert LOSS_AGG_MODES == ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3", "abs", "low_var_kl"}
    assert all(hasattr(alg, name) for name in alg.__all__)
