"""Helpers for tests of the RL job: set it up from the quickstart config, score rows directly."""

from __future__ import annotations

import math
import os
from typing import Callable, Optional, Sequence
from types import SimpleNamespace

import torch

from hyflow.jobs.registry import load_job_config
from hyflow.monitor.timers import PhaseTimers
from hyflow.rl.batch import make_micro_batches, plan_fixed
from hyflow.rl.step_losses import forward_score
from hyflow.rl.step_losses import loss_weights
import hyflow.jobs.rl as rl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICKSTART = os.path.join(REPO, "configs", "quickstart.yaml")


def rl_setup(overrides: Sequence[str], config: str = QUICKSTART):
    """``(cfg, state, job)`` of the RL job for ``config`` with ``overrides`` (call on every rank)."""
    cfg = load_job_config(config, list(overrides))
    state, job = rl.setup(cfg)
    return cfg, state, job


def rl_step(cfg, state, job, records=None):
    """One step of the RL job (the next batch of the loader unless ``records``); returns
    ``(metrics, data)`` and advances ``state.step``."""
    records = state.loader.next_batch() if records is None else records
    metrics, data = rl.rl_step(cfg, state, records, job, PhaseTimers())
    state.step += 1
    return metrics, data


def score_rows(chunks, groups, tokens: torch.Tensor, scorer: Callable,
               lengths: Optional[Sequence[int]] = None) -> torch.Tensor:
    """``scorer(output, micro-batch)`` over all rows of ``tokens`` [B, S] in one micro-batch, as
    [B, S] on every rank of the model's pipeline."""
    B, S = tokens.shape
    lengths = list(lengths) if lengths is not None else [S] * B
    micro = make_micro_batches({"tokens": tokens}, lengths, plan_fixed(B, B))
    return forward_score(chunks, micro, scorer, groups, (B, S))


def random_policy_batch(lengths: Sequence[int], vocab: int, seed: int = 4, prompt: int = 3):
    """``(columns, loss config)`` of a PPO update over rows of ``lengths`` (random tokens below
    ``vocab``, responses after ``prompt`` tokens, random old log-probs and advantages, token-mean
    weights): the columns :func:`hyflow.rl.batch.make_micro_batches` cuts, the config
    :class:`hyflow.rl.step_losses.PolicyLoss` reads."""
    gen = torch.Generator().manual_seed(seed)
    B, S = len(lengths), max(lengths)
    tokens = torch.randint(0, vocab, (B, S), generator=gen)
    mask = torch.zeros(B, S)
    for i, n in enumerate(lengths):
        mask[i, prompt:n] = 1.0
        tokens[i, n:] = 0
    cols = {"tokens": tokens, "response_mask": mask, "old_logp": -torch.rand(B, S, generator=gen) * 3,
            "advantages": torch.randn(B, S, generator=gen)}
    cols["loss_weight"] = loss_weights(mask, "token-mean", mask.sum(), (mask.sum(-1) > 0).sum())
    cols["token_weight"] = cols["loss_weight"]
    cfg = SimpleNamespace(policy_loss="vanilla", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None,
                          entropy_coeff=0.01, use_kl_loss=False, loss_agg_mode="token-mean")
    return cols, cfg


#: the training metrics an async run with ``trainer.max_staleness=0`` must share with the sync run
ASYNC_COMPARED = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl", "response_length/mean",
                  "critic/score/mean", "critic/advantages/mean", "critic/advantages/max")


def assert_async_k0_equals_sync(sync: Sequence[dict], k0: Sequence[dict], steps: int) -> None:
    """``trainer.mode=async`` at k=0 (``k0``'s per-step metrics) equals the ``sync`` run to 1e-5 at every
    step, with no stale token and no sample spanning two weight versions; the sync run trained."""
    assert len(k0) == len(sync) == steps
    for a, b in zip(sync, k0):
        for key in ASYNC_COMPARED:
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-7), (a["step"], key, a[key], b[key])
        assert b["fully_async/staleness/max"] == 0.0 and b["fully_async/partial/max_partial_span"] == 0.0
    assert sync[-1]["actor/grad_norm"] > 0
