"""GSPO, CISPO, rollout correction, mismatch metrics, DAPO pieces, GRPO pass@k and the
per-rank aggregation weights, each against an independent float64 reference.

References are written from the papers' formulas with Python loops (values) or as float64
autograd of the papers' *sequence / token objectives* (gradients); none calls the function
under test. "Two ranks" are simulated by splitting the rows of a batch: statistics summed over
the halves must equal the statistics of the whole batch.
"""
from __future__ import annotations

import math

import pytest
import torch

from hyflow.algorithms import (
    CORRECTION_MODES,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    aggregation_weights,
    cispo_policy_loss,
    get_policy_loss,
    groups_with_signal,
    grpo_passk,
    gspo_policy_loss,
    mismatch_metrics,
    mismatch_row_stats,
    overlong_penalty,
    pack_row_stats,
    rollout_correction,
    rollout_correction_metrics,
    unpack_row_stats,
)
from hyflow.testing.references import aggregate_loss

from algorithms_reference import B, F64, NORM, T, mask_t, rand, valid, with_garbage


def seq_adv(seed=5) -> torch.Tensor:
    """One advantage per sequence, broadcast over its tokens (as outcome estimators give)."""
    a = rand(B, seed=seed)
    return a.unsqueeze(1).expand(B, T).clone()


# ------------------------------------------------------------------------------------ GSPO


def test_gspo_value_is_the_clipped_sequence_ratio():
    old = rand(B, T, seed=1, scale=0.5)
    logp = old + rand(B, T, seed=2, scale=0.3)
    adv = seq_adv()
    loss, stats = gspo_policy_loss(with_garbage(logp), old, adv, mask_t(), clip_ratio_low=0.05, clip_ratio_high=0.08)
    clipped = 0
    for b in range(B):
        ts = valid(b)
        if not ts:
            assert loss[b].abs().sum() == 0
            continue
        s = math.exp(sum(logp[b, t].item() - old[b, t].item() for t in ts) / len(ts))
        a = adv[b, 0].item()
        expected = max(-a * s, -a * min(max(s, 0.95), 1.08))
        clipped += (-a * min(max(s, 0.95), 1.08)) > -a * s
        for t in range(T):
            want = expected if t in ts else 0.0
            assert loss[b, t].item() == pytest.approx(want, rel=1e-12, abs=1e-15)
            assert stats["ratio"][b, t].item() == pytest.approx(s if t in ts else 0.0, rel=1e-12)
    assert 0 < clipped < B - 1  # both branches exercised


def test_gspo_gradient_equals_the_papers_sequence_objective():
    """GSPO's objective: J = 1/G sum_i min(s_i A_i, clip(s_i) A_i) with s_i the geometric mean of
    the token ratios, differentiated through s_i (no stop-gradient anywhere). The GSPO-token
    construction, aggregated seq-mean-token-mean, must have exactly that gradient."""
    old = rand(B, T, seed=3, scale=0.5)
    delta = rand(B, T, seed=4, scale=0.2)
    adv = seq_adv(seed=6)
    lo, hi = 0.04, 0.06

    logp = (old + delta).requires_grad_(True)
    loss_mat, _ = gspo_policy_loss(with_garbage(logp), old, adv, mask_t(), clip_ratio_low=lo, clip_ratio_high=hi)
    aggregate_loss(loss_mat, mask_t(), "seq-mean-token-mean").backward()

    ref_logp = (old + delta).requires_grad_(True)
    terms = []
    for b in range(B):
        ts = valid(b)
        if not ts:
            continue
        s = torch.exp(sum(ref_logp[b, t] - old[b, t] for t in ts) / len(ts))
        a = adv[b, 0]
        terms.append(torch.minimum(s * a, torch.clamp(s, 1 - lo, 1 + hi) * a))
    (-torch.stack(terms).mean()).backward()
    torch.testing.assert_close(logp.grad, ref_logp.grad, rtol=1e-12, atol=1e-15)
    assert torch.isfinite(logp.grad).all()
    # some sequences are clipped (zero gradient), some are not
    per_row = logp.grad.abs().sum(dim=1)
    assert (per_row == 0).sum() > 1 and (per_row > 0).sum() >= 2


# ----------------------------------------------------------------------------------- CISPO


def test_cispo_value_and_gradient_keep_clipped_tokens():
    old = rand(B, T, seed=7, scale=0.5)
    logp0 = old + rand(B, T, seed=8, scale=0.6)
    adv = rand(B, T, seed=9)
    lo, hi = 0.2, 0.3
    logp = logp0.clone().requires_grad_(True)
    loss_mat, stats = cispo_policy_loss(with_garbage(logp), old, adv, mask_t(), clip_ratio_low=lo, clip_ratio_high=hi)
    aggregate_loss(loss_mat, mask_t(), "token-mean").backward()
    n = sum(len(valid(b)) for b in range(B))
    n_clipped = 0
    # the paper's objective J = 1/N sum sg(r_hat) A log pi, as float64 autograd with the weight a
    # Python float (a constant by construction)
    ref = logp0.clone().requires_grad_(True)
    total = 0
    for b in range(B):
        for t in valid(b):
            r = math.exp(logp0[b, t].item() - old[b, t].item())
            r_hat = min(max(r, 1 - lo), 1 + hi)
            n_clipped += r_hat != r
            a = adv[b, t].item()
            assert loss_mat[b, t].item() == pytest.approx(-r_hat * a * logp0[b, t].item(), rel=1e-12)
            total = total + r_hat * a * ref[b, t]
    (-total / n).backward()
    torch.testing.assert_close(logp.grad, ref.grad, rtol=1e-12, atol=1e-15)
    assert n_clipped >= 3
    # clipped tokens keep a non-zero gradient (PPO would zero it)
    clipped = (stats["clip_frac"] == 1) & mask_t()
    assert bool((logp.grad[clipped] != 0).all())
    assert stats["clip_frac"].sum().item() == n_clipped


# ------------------------------------------------------------------- registry, IS weights


def test_registry_common_signature_and_is_weights():
    assert set(POLICY_LOSSES) == {"vanilla", "gspo", "cispo"}
    assert get_policy_loss("cispo") is cispo_policy_loss
    with pytest.raises(ValueError, match="gspo"):
        get_policy_loss("grpo")
    old = rand(B, T, seed=10, scale=0.5)
    logp = old + rand(B, T, seed=11, scale=0.1)
    adv = seq_adv(seed=12)
    w = torch.rand(B, T, generator=torch.Generator().manual_seed(13), dtype=F64) + 0.5
    for name, fn in POLICY_LOSSES.items():
        kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None)
        plain, stats = fn(with_garbage(logp), old, adv, mask_t(), **kw)
        weighted, _ = fn(with_garbage(logp), old, adv, mask_t(), is_weights=with_garbage(w), **kw)
        assert torch.isfinite(weighted).all() and torch.isfinite(plain).all(), name
        torch.testing.assert_close(weighted, torch.where(mask_t(), plain * w, torch.zeros_like(w)))
        assert set(stats) == {"clip_frac", "clip_frac_lower", "approx_kl", "ratio"}, name
        assert all(bool((v[~mask_t()] == 0).all()) for v in stats.values()), name
    for name in ("gspo", "cispo"):
        with pytest.raises(ValueError, match="dual clip"):
            POLICY_LOSSES[name](logp, old, adv, mask_t(), clip_ratio_c=3.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregation_weights_give_the_batch_loss_over_split_ranks(mode):
    x = rand(B, T, seed=14)
    whole = aggregate_loss(x, mask_t(), mode, NORM).item()
    w, d = aggregation_weights(mask_t(F64), mode, NORM)
    assert ((w * x.nan_to_num()).sum() / d).item() == pytest.approx(whole, rel=1e-12)
    # two "data-parallel ranks" with rows 0..2 and 3..5: sum numerators and denominators
    num = den = 0.0
    for rows in (slice(0, 3), slice(3, 6)):
        w, d = aggregation_weights(mask_t(F64)[rows], mode, NORM)
        num += (w * x[rows]).sum().item()
        den += d.item()
    assert num / den == pytest.approx(whole, rel=1e-12)
    # each rank's own aggregate_loss, averaged, is not the batch loss (why weights exist)
    if mode != "seq-mean-token-sum-norm":
        halves = [aggregate_loss(x[r], mask_t()[r], mode, NORM).item() for r in (slice(0, 3), slice(3, 6))]
        assert sum(halves) / 2 != pytest.approx(whole, rel=1e-6)


# ------------------------------------------------------------------------ rollout correction


def ref_correction(old, rollout, mode, cap, low, high):
    """Per-token (weight, kept) from the definitions, float64 loops."""
    weights, kept = torch.zeros(B, T, dtype=F64), torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        ts = valid(b)
        seq = math.exp(max(min(sum(old[b, t].item() - rollout[b, t].item() for t in ts), 20), -20))
        for t in ts:
            tok = math.exp(old[b, t].item() - rollout[b, t].item())
            if mode == "off":
                w, k = 1.0, True
            elif mode == "token_tis":
                w, k = min(tok, cap), True
            elif mode == "seq_tis":
                w, k = min(seq, cap), True
            elif mode == "seq_mis":
                w, k = seq, low <= seq <= high
            else:  # icepop
                w, k = tok, low <= tok <= high
            weights[b, t], kept[b, t] = (w if k else 0.0), k
    return weights, kept


@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_rollout_correction_matches_definitions_and_splits_over_ranks(mode):
    rollout = rand(B, T, seed=15, scale=0.5) - 1.0
    old = rollout + rand(B, T, seed=16, scale=0.5)
    cap, low, high = 1.5, 0.6, 1.8
    out = rollout_correction(with_garbage(old), with_garbage(rollout), mask_t(torch.float32), mode, cap, low, high)
    w_ref, kept_ref = ref_correction(old, rollout, mode, cap, low, high)
    torch.testing.assert_close(out.weights, w_ref, rtol=1e-12, atol=1e-15)
    assert torch.equal(out.mask != 0, kept_ref) and out.mask.dtype == torch.float32
    assert not out.weights.requires_grad
    n_tok = int(mask_t().sum())
    n_kept = int(kept_ref.sum())
    if mode in ("seq_mis", "icepop"):
        assert 0 < n_kept < n_tok  # the band drops something and keeps something here
    whole = rollout_correction_metrics(unpack_row_stats(out.stats, *pack_row_stats(out.stats)))
    assert whole["rollout_corr/rollout_is_mean"] == pytest.approx(w_ref.sum().item() / n_kept, rel=1e-12)
    assert whole["rollout_corr/rollout_is_max"] == pytest.approx(w_ref.max().item(), rel=1e-12)
    assert whole["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx((n_tok - n_kept) / n_tok)
    dropped_seqs = sum(1 for b in range(B) if valid(b) and not all(kept_ref[b, t] for t in valid(b)))
    assert whole["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(dropped_seqs / 5)
    # two ranks: SUM / MAX all-reduce of each half's packed vectors gives the same metrics
    parts = [rollout_correction(old[r], rollout[r], mask_t(torch.float32)[r], mode, cap, low, high).stats
             for r in (slice(0, 2), slice(2, 6))]
    packed = [pack_row_stats(p) for p in parts]
    sums = packed[0][0] + packed[1][0]
    maxima = torch.maximum(packed[0][1], packed[1][1])
    split = rollout_correction_metrics(unpack_row_stats(parts[0], sums, maxima))
    assert split == pytest.approx(whole, rel=1e-12)


def test_rollout_correction_rejects_bad_arguments():
    x = rand(2, 3)
    with pytest.raises(ValueError, match="mode"):
        rollout_correction(x, x, torch.ones(2, 3), "tis")
    with pytest.raises(ValueError, match="low < high"):
        rollout_correction(x, x, torch.ones(2, 3), "icepop", low=2.0, high=1.0)
    with pytest.raises(ValueError, match="shape"):
        rollout_correction(x, x[:, :2], torch.ones(2, 3))


# ---------------------------------------------------------------------------- mismatch


def test_mismatch_metrics_match_a_loop_and_split_over_ranks():
    rollout = rand(B, T, seed=17, scale=0.5) - 1.0
    train = rollout + rand(B, T, seed=18, scale=2e-3)
    rows = mismatch_row_stats(with_garbage(train).float(), with_garbage(rollout).float(), mask_t())
    metrics = mismatch_metrics(unpack_row_stats(rows, *pack_row_stats(rows)))
    d = [train[b, t].item() - rollout[b, t].item() for b in range(B) for t in valid(b)]
    # the inputs are float32 (as log-probs are): compare with the float32-rounded differences
    t32, r32 = train.float().double(), rollout.float().double()
    d32 = [t32[b, t].item() - r32[b, t].item() for b in range(B) for t in valid(b)]
    seqs = [sum(t32[b, t].item() - r32[b, t].item() for t in valid(b)) for b in range(B) if valid(b)]
    mean = sum(seqs) / len(seqs)
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(max(abs(x) for x in d32), rel=1e-12)
    assert metrics["rollout/logprob_diff_mean"] == pytest.approx(sum(abs(x) for x in d32) / len(d32), rel=1e-12)
    above = sum(abs(x) > 1e-3 for x in d32) / len(d32)
    assert metrics["rollout/logprob_diff_frac_above"] == above and 0 < above < 1
    assert metrics["rollout_corr/kl"] == pytest.approx(-sum(d32) / len(d32), rel=1e-9)
    assert metrics["rollout_corr/k3_kl"] == pytest.approx(sum(math.expm1(x) - x for x in d32) / len(d32), rel=1e-6)
    assert metrics["rollout_corr/seq_log_ratio_mean"] == pytest.approx(mean, rel=1e-9)
    assert metrics["rollout_corr/seq_log_ratio_abs_max"] == pytest.approx(max(abs(s) for s in seqs), rel=1e-12)
    std = math.sqrt(sum((s - mean) ** 2 for s in seqs) / (len(seqs) - 1))
    assert metrics["rollout_corr/seq_log_ratio_std"] == pytest.approx(std, rel=1e-6)
    assert abs(metrics["rollout/logprob_diff_max"] - max(abs(x) for x in d)) < 1e-6
    parts = [mismatch_row_stats(train[r].float(), rollout[r].float(), mask_t()[r]) for r in (slice(0, 4), slice(4, 6))]
    packed = [pack_row_stats(p) for p in parts]
    split = mismatch_metrics(unpack_row_stats(parts[0], packed[0][0] + packed[1][0],
                                              torch.maximum(packed[0][1], packed[1][1])))
    assert split == pytest.approx(metrics, rel=1e-12)
    # equal log-probs: every metric is exactly zero
    same = mismatch_metrics(unpack_row_stats(rows, *pack_row_stats(mismatch_row_stats(rollout, rollout, mask_t()))))
    assert all(v == 0.0 for v in same.values())


# -------------------------------------------------------------------------- DAPO, pass@k


def test_groups_with_signal_keeps_groups_with_reward_variance():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0, 1e-9, 0.0])
    groups = ["a", "a", "a", "b", "b", "c", "c", "d", "e", "e"]
    keep = groups_with_signal(scores, groups)
    assert keep.tolist() == [False] * 3 + [True] * 2 + [False] * 2 + [False] + [True] * 2
    # and every kept group has variance > 0, every dropped one has none
    for g in set(groups):
        rows = [i for i, x in enumerate(groups) if x == g]
        var = torch.var(scores[rows], unbiased=False).item() if len(rows) > 1 else 0.0
        assert all(keep[i] == (var > 0) for i in rows)


def test_overlong_penalty_is_dapos_piecewise_ramp():
    lengths = torch.tensor([0, 10, 12, 13, 14, 16, 17])
    got = overlong_penalty(lengths, max_length=16, buffer=4, penalty_factor=0.5).tolist()
    assert got == pytest.approx([0.0, 0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError):
        overlong_penalty(lengths, max_length=16, buffer=20)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_credits_only_the_best_response(norm):
    scores = torch.tensor([0.0, 3.0, 1.0, 3.0, 2.0, 5.0, 7.0, 1.0, 1.0], dtype=F64)
    groups = [0, 0, 0, 0, 1, 2, 1, 3, 3]
    mask = torch.ones(9, 4)
    mask[2, 3] = 0
    adv = grpo_passk(scores, groups, mask, norm_by_std=norm, eps=1e-6)
    want = [0.0] * 9
    # group 0: max 3 at rows 1 and 3 (first wins), second best 3 -> margin 0
    # group 1: rows 4, 6 -> row 6 gets 7 - 2 = 5; group 2 is a singleton; group 3 ties -> 0
    std1 = math.sqrt(((2 - 4.5) ** 2 + (7 - 4.5) ** 2) / 1)
    want[6] = 5.0 / (std1 + 1e-6) if norm else 5.0
    assert adv[:, 0].tolist() == pytest.approx(want, rel=1e-12)
    assert adv[2, 3].item() == 0.0 and adv[6].tolist() == pytest.approx([want[6]] * 4)
    scores2 = torch.tensor([1.0, 4.0, 2.0], dtype=F64)
    adv2 = grpo_passk(scores2, [0, 0, 0], torch.ones(3, 1), norm_by_std=False)
    assert adv2[:, 0].tolist() == [0.0, 2.0, 0.0]


# --------------------------------------------------------------------------- the config


@pytest.mark.parametrize("overrides, needle", [
    (["actor.policy_loss=gspo"], "seq-mean-token-mean"),
    (["actor.policy_loss=cispo", "actor.clip_ratio_c=3"], "clip_ratio_c"),
    (["actor.rollout_correction.mode=token_tis", "actor.old_logprobs=rollout"], "recompute"),
    (["actor.rollout_correction.mode=icepop", "actor.rollout_correction.low=3"], "low < high"),
    (["actor.rollout_correction.cap=0"], "cap"),
    (["actor.rollout_correction.mode=tis"], "token_tis"),
    (["actor.loss_scale_factor=0"], "loss_scale_factor"),
    (["algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.length=7"], "max_new_tokens"),
    (["actor.policy_loss=gspo", "actor.loss_agg_mode=seq-mean-token-mean", "actor.pack_sequences=true"],
     "pack_sequences=false"),
    (["algorithm.adv_estimator=grpo_passk", "rollout.n=1", "actor.mini_batch_size=32",
      "actor.micro_batch_size=16"], "rollout.n"),
])
def test_config_errors_name_the_key(overrides, needle):
    import os

    from hyflow.jobs.registry import load_job_config
    from hyflow.config import ConfigError

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_job_config(os.path.join(repo, "configs", "quickstart.yaml"), overrides)


def test_config_loss_norm_length_defaults_to_the_response_budget():
    import os

    from hyflow.jobs.registry import load_job_config

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "quickstart.yaml")
    cfg = load_job_config(path, ["actor.policy_loss=gspo", "actor.loss_agg_mode=seq-mean-token-mean",
                                 "actor.rollout_correction.mode=icepop"])
    assert cfg.loss_norm_length == cfg.rollout.max_new_tokens == 6
    assert cfg.actor.rollout_correction.mode == "icepop"
    assert load_job_config(path, ["actor.loss_scale_factor=100"]).loss_norm_length == 100
