"""Parity tests for hyflow.algorithms against independent float64 references.

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
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    apply_kl_penalty,
    dpo_loss,
    entropy_bonus,
    entropy_from_logits,
    gae,
    grpo_outcome,
    kl_estimate,
    kto_loss,
    last_token_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    ppo_policy_loss,
    reinforce_pp,
    reinforce_pp_baseline,
    remax,
    rloo,
    scatter_to_last_token,
    value_loss,
)

F64 = torch.float64

# Rows: full, right-padded, empty, length 1, left-padded, interior hole after an "EOS".
MASK_ROWS = [
    [1, 1, 1, 1, 1, 1, 1],
    [1, 1, 1, 1, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0],
    [1, 0, 0, 0, 0, 0, 0],
    [0, 0, 1, 1, 1, 1, 1],
    [1, 1, 0, 1, 1, 0, 0],
]
B, T = len(MASK_ROWS), len(MASK_ROWS[0])
NORM = 16  # the constant normaliser of seq-mean-token-sum-norm (a response budget)


def mask_t(dtype=torch.bool) -> torch.Tensor:
    return torch.tensor(MASK_ROWS).to(dtype)


def rand(*shape, seed=0, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64) * scale


def with_garbage(x: torch.Tensor) -> torch.Tensor:
    """Fill padding positions with NaN: results must not depend on them."""
    return torch.where(mask_t(), x, torch.full_like(x, float("nan")))


def valid(b):
    return [t for t in range(T) if MASK_ROWS[b][t]]


def np_whiten(mat: np.ndarray, eps=1e-8) -> np.ndarray:
    """Whiten over valid entries (unbiased var); padding -> 0."""
    vals = [mat[b][t] for b in range(B) for t in valid(b)]
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / (n - 1)
    out = np.zeros((B, T))
    for b in range(B):
        for t in valid(b):
            out[b][t] = (mat[b][t] - mean) / math.sqrt(var + eps)
    return out


def broadcast_ref(per_seq) -> np.ndarray:
    out = np.zeros((B, T))
    for b in range(B):
        for t in valid(b):
            out[b][t] = per_seq[b]
    return out


def close(actual: torch.Tensor, expected, atol=1e-10, rtol=1e-10):
    exp = torch.as_tensor(np.asarray(expected, dtype=np.float64))
    torch.testing.assert_close(actual.detach().to(F64), exp, atol=atol, rtol=rtol)


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
    for i, g in enumerate(ids):
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
    with pytest.raises(ValueError, match="max_new_tokens"):
        aggregate_loss(lm, mask_t(), "seq-mean-token-sum-norm")
    # extra padding columns (a longer sequence elsewhere in the step) change nothing
    wide = torch.cat([lm, rand(B, 5, seed=99)], dim=1)
    wide_mask = torch.cat([mask_t(), torch.zeros(B, 5, dtype=torch.bool)], dim=1)
    assert aggregate_loss(wide, wide_mask, "seq-mean-token-sum-norm", 64).item() == \
        aggregate_loss(lm, mask_t(), "seq-mean-token-sum-norm", 64).item()


def test_aggregate_loss_rejects_unknown_mode():
    with pytest.raises(ValueError):
        aggregate_loss(rand(2, 3), torch.ones(2, 3), "seq-sum")


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


def test_entropy_from_logits():
    logits = rand(3, 4, 11, seed=25, scale=3.0)
    logits[0, 0] += 1e4  # shift invariance / stability
    logits[1, 1, :5] = float("-inf")
    ref = np.zeros((3, 4))
    for i in range(3):
        for j in range(4):
            z = [x for x in logits[i, j].tolist() if x != float("-inf")]
            mx = max(z)
            p = [math.exp(x - mx) for x in z]
            s = sum(p)
            ref[i][j] = -sum((q / s) * math.log(q / s) for q in p if q > 0)
    lg = logits.clone().requires_grad_(True)
    h = entropy_from_logits(lg)
    close(h, ref, atol=1e-9, rtol=1e-9)
    h.sum().backward()
    assert torch.isfinite(lg.grad).all()
    uniform = torch.zeros(2, 8, dtype=F64)
    close(entropy_from_logits(uniform), [math.log(8)] * 2)
    m = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    exp = 0.01 * (ref[0][0] + ref[0][1] + ref[1][0]) / 3
    close(entropy_bonus(h, m, coef=0.01), exp, atol=1e-9, rtol=1e-9)


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
        ppo_policy_loss(x, y, z, m, 0.2, clip_ratio_c=3.0)[0], value_loss(x, y, z, m, 0.2)[0],
        entropy_from_logits(x), dpo_loss(s, s, s, s)[0], kto_loss(s, s, s > 0, torch.tensor(0.1)),
        *[kl_estimate(x, y, k) for k in KL_ESTIMATORS],
        *[aggregate_loss(x, m, mode, NORM) for mode in LOSS_AGG_MODES],
    ]
    for o in outs:
        assert o.dtype == f and torch.isfinite(o).all()
    assert entropy_from_logits(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_registries():
    assert set(ADV_ESTIMATORS) >= {"gae", "grpo", "dr_grpo", "grpo_passk", "rloo", "reinforce_plus_plus",
                                   "reinforce_plus_plus_baseline", "remax"}
    assert all(callable(f) for f in ADV_ESTIMATORS.values())
    assert ADV_ESTIMATORS["gae"] is gae and ADV_ESTIMATORS["grpo"] is grpo_outcome
    assert LOSS_AGG_MODES == ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3", "abs", "low_var_kl"}
    assert all(hasattr(alg, name) for name in alg.__all__)
