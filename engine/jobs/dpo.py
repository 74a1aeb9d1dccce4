"""The preference jobs (``job: dpo`` and ``job: kto``): offline preference optimisation of the
Megatron actor against a frozen copy of itself, as one readable dataflow per step.

DPO, per step::

    pairs ──► this DP rank's pairs as rows c0 r0 c1 r1 ... ──► reference log-probs
          ──► update (chosen + rejected of a pair in one forward, DPO / IPO / hinge loss)
          ──► metrics over the global batch

KTO, per step::

    examples ──► this DP rank's completions and KL pairs (prompt + another example's completion)
             ──► reference log-probs of both ──► KL reference point z0 (policy, forward only)
             ──► update (KTO loss) ──► metrics over the global batch

Every rank holds the step's whole batch of records (token ids are small); each data-parallel
rank scores and trains on its own slice of whole pairs, and metrics are sums all-reduced over
the data-parallel group. Checkpoints, resume, preemption, the NaN guard, metrics and the plot
are the RL job's (:class:`~hyflow.checkpoint.checkpointer.Checkpointer`,
:class:`~hyflow.training.supervisor.StepSupervisor`, :mod:`hyflow.monitor`).
"""

from __future__ import annotations

import functools
import math
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

from hyflow.algorithms import dpo_loss, kto_loss
from hyflow.checkpoint.checkpointer import Checkpointer, TrainedModel
from hyflow.config import format_config
from hyflow.data.loader import PromptLoader
from hyflow.data.preference import build_preference_dataset, sequence_tensors
from hyflow.data.tasks import load_data_tokenizer, tokenizer_spec_for
from hyflow.jobs.preference_config import DPOJobConfig, KTOJobConfig, PreferenceJobConfig
from hyflow.jobs.preference_losses import (chosen_nll, completion_tokens, dpo_loss_fn, from_last_stage, kto_loss_fn,
                                          loss_scale, score_sequences)
from hyflow.jobs.preference_models import CACHE_FILE, Policy, ReferenceLogps, build_policy, micro_batches
from hyflow.jobs.preference_validation import PreferenceValidation
from hyflow.jobs.loop import Run, open_run, run_job
from hyflow.monitor.metrics import read_metrics
from hyflow.monitor.plot import plot_metrics
from hyflow.monitor.timers import PhaseTimers
from hyflow.rl.batch import pad_multiple
from hyflow.rl.models import check_actor_checkpoint
from hyflow.training.step import train_step
from hyflow.training.supervisor import StepSupervisor

#: Right padding never reaches a real token's prediction (causal attention, completion mask),
#: so any id works as the pad.
PAD_ID = 0
DPO_KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
            "logps/chosen", "logps/rejected", "nll_loss")
KTO_KEYS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
            "logps/rejected", "count/chosen", "count/rejected")
PLOT_FILE = "rewards.png"


def run(cfg: PreferenceJobConfig) -> list[dict]:
    """Train; rank 0 writes metrics.jsonl, TensorBoard, the resolved config and a plot."""
    rank = dist.get_rank()
    if cfg.actor.checkpoint:  # before the tokenizer, which usually lives in the checkpoint's folder
        check_actor_checkpoint(cfg.actor.checkpoint)
    tokenizer = load_data_tokenizer(cfg.data)
    dataset = build_preference_dataset(cfg.data, tokenizer, cfg.job)
    loader = PromptLoader(dataset, cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    policy = build_policy(cfg, tokenizer)
    # SIGTERM / SIGUSR1 flags and the NaN/inf guard, before the long set-up so no signal is lost
    supervisor = StepSupervisor(cfg.trainer.max_bad_steps, [policy.optimizer], device=policy.groups.device).install()
    ckpt = Checkpointer(cfg.trainer.output_dir, policy.groups, policy.desc, cfg.trainer.keep_last,
                        tokenizer=tokenizer_spec_for(cfg.data))
    if rank == 0:
        print(f"[hyflow] {cfg.job}: actor {policy.groups.layout.describe()}; {dataset.describe()}", flush=True)
        if cfg.job == "kto":
            _check_kto_balance(cfg, dataset)
    reference = ReferenceLogps.build(cfg, policy, dataset, ckpt.root, ckpt.log)
    validation = PreferenceValidation.build(cfg, policy, tokenizer, reference, ckpt.log)
    steps = PreferenceSteps(cfg, policy, reference, validation, loader, supervisor, ckpt)
    keys = DPO_KEYS if cfg.job == "dpo" else KTO_KEYS
    shown = (("loss", "loss"), ("rewards/accuracies", "acc"), ("rewards/margins", "margin")) if cfg.job == "dpo" \
        else (("loss", "loss"), ("kl", "kl"), ("rewards/margins", "margin"))
    run = open_run(cfg, ckpt, supervisor, steps.resume, lead=rank == 0,
                   required_keys=("step", "grad_norm", "learning_rate", "tokens_per_s") + keys, progress_keys=shown)
    steps.before_train(run)
    return run_job(run, steps)


class PreferenceSteps:
    """The DPO / KTO job's steps as :func:`~hyflow.jobs.loop.run_job` calls them: one update on the
    loader's next batch of records, its timers and throughput, validation when due; checkpoints of
    the policy, the data position and the supervisor."""

    def __init__(self, cfg: PreferenceJobConfig, policy: Policy, reference: ReferenceLogps,
                 validation: Optional[PreferenceValidation], loader: PromptLoader, supervisor: StepSupervisor,
                 ckpt: Checkpointer) -> None:
        self.cfg, self.policy, self.reference, self.validation = cfg, policy, reference, validation
        self.loader, self.supervisor, self.ckpt = loader, supervisor, ckpt
        self.timers = PhaseTimers(phases=("ref", "update") if cfg.job == "dpo" else ("ref", "kl", "update"))
        self.step_fn = dpo_step if cfg.job == "dpo" else kto_step
        self.val_metrics = functools.partial(validation_metrics, cfg, policy)
        self.records: list = []
        self.progress = None

    def resume(self) -> int:
        """Load the checkpoint ``trainer.resume`` names (the newest that verifies, for ``auto``); returns its
        step, 0 when the run starts fresh. Restores the random streams, so it runs last in the set-up."""
        def warn(message: str) -> None:
            print(f"[hyflow] warning: {message}", file=sys.stderr, flush=True)

        path = self.ckpt.find_resume(self.cfg.trainer.resume, warn)  # verified; falls back past damaged ones
        if path is None:
            return 0
        state = self.ckpt.load(path, self._trained_models())
        self.loader.load_state_dict(state["job"]["data"])
        self.supervisor.load_state_dict(state["job"]["supervisor"])
        step = int(state["step"])
        if step >= self.cfg.trainer.total_steps:
            self.ckpt.log(f"[hyflow] the checkpoint is at step {step}: trainer.total_steps="
                          f"{self.cfg.trainer.total_steps} is reached already, nothing to train")
        return step

    def before_train(self, run: Run) -> None:
        """Validation of the starting weights on a fresh run (logged as step 0)."""
        self.progress = run.progress
        if self.validation is not None and self.validation.before_train and not run.start:
            before = self.validation.run(self.cfg, self.policy, self.val_metrics)
            if dist.get_rank() == 0:
                run.progress.write(self.validation.summary(0, before))
            if run.writer is not None:
                run.writer.log(0, before, check_required=False)

    def step(self, step: int) -> dict:
        self.records = self.loader.next_batch()
        return self.step_fn(self.cfg, self.policy, self.reference, self.records, self.timers)

    def report(self, step: int, metrics: dict, outcome) -> bool:
        cfg, loader = self.cfg, self.loader
        metrics.update({k.replace("timing_s/", "time/"): v for k, v in self.timers.step_summary().items()})
        metrics["tokens_per_s"] = batch_tokens(self.records, cfg.job) / max(metrics["time/step"], 1e-9)
        metrics["epoch"] = loader.sampler.epoch + loader.sampler.index / len(loader.dataset)
        if self.validation is not None and not outcome.stop and self.validation.due(step, cfg.trainer.total_steps):
            metrics.update(self.validation.run(cfg, self.policy, self.val_metrics))
            if dist.get_rank() == 0:
                self.progress.write(self.validation.summary(step, metrics))
        return True

    def save(self, step: int) -> str:
        """Checkpoint step ``step``; returns the checkpoint's directory."""
        # The reference is rebuilt from the config (actor.checkpoint / the seeded init); a precomputed
        # table is cached beside the checkpoints, found again by its fingerprint.
        job = {"data": self.loader.state_dict(), "supervisor": self.supervisor.state_dict(),
               "reference_logps": os.path.join("..", CACHE_FILE) if self.reference.table is not None else None}
        return self.ckpt.save(step, self._trained_models(), job, config_text=format_config(self.cfg))

    def summary(self, metrics_path: str) -> None:
        """Rank 0: plot the whole run's metrics (resumed parts included) and print a summary."""
        cfg = self.cfg
        rows = read_metrics(metrics_path)
        if not rows:
            return
        keys = ("rewards/accuracies", "rewards/margins", "loss") if cfg.job == "dpo" else \
            ("rewards/margins", "kl", "loss")
        held_out = ("eval_rewards/accuracies",) if cfg.job == "dpo" else ("eval_rewards/margins",)
        plot = keys + (held_out if any(held_out[0] in row for row in rows) else ())
        plot_metrics(rows, os.path.join(cfg.trainer.output_dir, PLOT_FILE), keys=plot, title=f"hyflow {cfg.job}")
        fmt = lambda v: "nan" if v is None else f"{v:.3f}"  # noqa: E731 - NaN rows are written as null
        trained = [row for row in rows if "loss" in row] or rows  # not the validation row of step 0
        summary = ", ".join(f"{k} {fmt(trained[0].get(k))} -> {fmt(trained[-1].get(k))}" for k in keys)
        print(f"[hyflow] done: {summary}; run directory {cfg.trainer.output_dir}", flush=True)

    def _trained_models(self) -> dict[str, TrainedModel]:
        return {"actor": TrainedModel(self.policy.chunks, self.policy.optimizer, self.policy.scheduler)}


# --------------------------------------------------------------------------- steps


def _my_slice(records: list, policy: Policy) -> list:
    """This data-parallel rank's records of the global batch: whole pairs / examples."""
    g = policy.groups
    per = len(records) // g.layout.dp
    return records[g.dp_rank * per:(g.dp_rank + 1) * per]


def dpo_step(cfg: DPOJobConfig, policy: Policy, reference: ReferenceLogps, pairs: list, timers) -> dict:
    """One DPO step on the global batch ``pairs`` (the same on every rank); returns its metrics,
    identical on every rank."""
    g, mb = policy.groups, cfg.actor.micro_batch_size
    mine = _my_slice(pairs, policy)
    # 1. this rank's pairs as rows c0 r0 c1 r1 ..., padded to the global batch's longest sequence
    length = max(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) for p in pairs)
    batch = sequence_tensors([s for p in mine for s in p.sequences()], PAD_ID, g.device, length, pad_multiple(g))
    rows = list(range(2 * len(mine)))
    # 2. reference log-probs of every row (zeros when reference-free)
    with timers.phase("ref"):
        batch["ref_logps"] = reference.for_rows(mine, micro_batches(batch, rows, 2 * mb), None, policy, len(rows))
    # 3. update: a pair's chosen and rejected rows in one forward; the mean loss over all pairs
    with timers.phase("update"):
        scale = loss_scale(len(pairs))
        loss_fn, captured = dpo_loss_fn(cfg.algorithm, policy.vocab_size, g.pgs.tp, scale)
        stats = train_step(policy.chunks, policy.optimizer, policy.scheduler, micro_batches(batch, rows, 2 * mb),
                           with_labels=False, loss_fn=loss_fn, groups=g)
    # 4. metrics over the global batch, from the log-probs the update saw
    logps = from_last_stage(captured, len(rows), g).view(-1, 2)
    chosen_tokens = completion_tokens(batch).view(-1, 2)[:, 0]
    out = dpo_metrics(logps, batch["ref_logps"].view(-1, 2), chosen_tokens, cfg.algorithm, g, len(pairs))
    out.update(_update_stats(stats))
    return out


def kto_step(cfg: KTOJobConfig, policy: Policy, reference: ReferenceLogps, examples: list, timers) -> dict:
    """One KTO step on the global batch ``examples``; returns its metrics, identical on every rank."""
    g, mb, algo = policy.groups, cfg.actor.micro_batch_size, cfg.algorithm
    mine = _my_slice(examples, policy)
    # 1. this rank's completions, and its KL pairs (each prompt with another example's completion)
    length = max(len(e.prompt_ids) + max(len(e.completion_ids), len(e.kl_completion_ids)) for e in examples)
    batch = sequence_tensors([(e.prompt_ids, e.completion_ids) for e in mine], PAD_ID, g.device, length,
                             pad_multiple(g))
    batch["label"] = torch.tensor([float(e.label) for e in mine], dtype=torch.float32, device=g.device)
    kl_batch = sequence_tensors([(e.prompt_ids, e.kl_completion_ids) for e in mine], PAD_ID, g.device, length,
                                pad_multiple(g))
    rows = list(range(len(mine)))
    # 2. reference log-probs of both
    with timers.phase("ref"):
        batch["ref_logps"] = reference.for_rows(mine, micro_batches(batch, rows, mb), 0, policy, len(rows))
        kl_ref = reference.for_rows(mine, micro_batches(kl_batch, rows, mb), 1, policy, len(rows))
    # 3. the KL reference point z0 = max(0, mean over the global batch's KL pairs), no gradient
    with timers.phase("kl"):
        kl_policy = score_sequences(policy.chunks, micro_batches(kl_batch, rows, mb), policy.vocab_size, g)
        kl_sum = (kl_policy - kl_ref).double().sum().reshape(1)
        if g.layout.dp > 1:
            dist.all_reduce(kl_sum, group=g.pgs.dp)
        z0 = torch.clamp(kl_sum / len(examples), min=0.0).float()
    # 4. update: the mean KTO loss over all examples
    with timers.phase("update"):
        scale = loss_scale(len(examples))
        loss_fn, captured = kto_loss_fn(algo, policy.vocab_size, g.pgs.tp, scale, z0)
        stats = train_step(policy.chunks, policy.optimizer, policy.scheduler, micro_batches(batch, rows, mb),
                           with_labels=False, loss_fn=loss_fn, groups=g)
    # 5. metrics over the global batch
    logps = from_last_stage(captured, len(rows), g)
    out = kto_metrics(logps, batch["ref_logps"], batch["label"] > 0, z0, algo, g, len(examples))
    out.update(_update_stats(stats))
    return out


# --------------------------------------------------------------------------- metrics


def _dp_sum(values: list, groups) -> list[float]:
    """Sums over the data-parallel group (float64)."""
    vec = torch.stack([v.double().sum() for v in values])
    if groups.layout.dp > 1:
        dist.all_reduce(vec, group=groups.pgs.dp)
    return vec.tolist()


def dpo_metrics(policy: torch.Tensor, ref: torch.Tensor, chosen_tokens: torch.Tensor, algo, groups,
                global_pairs: int) -> dict:
    """TRL's DPO metrics, means over the global batch: ``policy`` / ``ref`` are this rank's [n, 2]
    (chosen, rejected) sequence log-probs, ``chosen_tokens`` [n] the chosen responses' lengths.
    ``nll_loss`` (logged whatever rpo_alpha is) is the chosen responses' mean token NLL; ``loss``
    includes rpo_alpha times it."""
    losses, chosen, rejected = dpo_loss(policy[:, 0], policy[:, 1], ref[:, 0], ref[:, 1], beta=algo.beta,
                                        label_smoothing=algo.label_smoothing, kind=algo.loss_type, reduction="none")
    nll = chosen_nll(policy[:, 0], chosen_tokens)
    sums = _dp_sum([losses + algo.rpo_alpha * nll, chosen, rejected, (chosen > rejected).float(), chosen - rejected,
                    policy[:, 0], policy[:, 1], nll], groups)
    return {key: value / global_pairs for key, value in zip(DPO_KEYS, sums)}


def kto_metrics(policy: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor, z0: torch.Tensor, algo, groups,
                global_count: int) -> dict:
    """TRL's KTO metrics: the mean loss over the global batch, ``kl`` (z0), and per class (chosen:
    desirable, rejected: undesirable) the mean reward and log-prob (NaN for a class the batch lacks)."""
    losses = kto_loss(policy, ref, desirable, z0, beta=algo.beta, desirable_weight=algo.desirable_weight,
                      undesirable_weight=algo.undesirable_weight, reduction="none")
    rewards = algo.beta * (policy - ref)
    d, u = desirable.float(), (~desirable).float()
    loss, r_d, r_u, lp_d, lp_u, n_d, n_u = _dp_sum(
        [losses, rewards * d, rewards * u, policy * d, policy * u, d, u], groups)
    mean = lambda total, n: total / n if n else math.nan  # noqa: E731
    out = {"loss": loss / global_count, "kl": float(z0), "rewards/chosen": mean(r_d, n_d),
           "rewards/rejected": mean(r_u, n_u), "logps/chosen": mean(lp_d, n_d), "logps/rejected": mean(lp_u, n_u),
           "count/chosen": n_d, "count/rejected": n_u}
    out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


def validation_metrics(cfg: PreferenceJobConfig, policy: Policy, records: list, logps: torch.Tensor,
                       ref: torch.Tensor, total: int) -> dict:
    """The step's metrics on held-out rows: this DP rank's ``records`` with their [n, 2] policy and
    reference log-probs (DPO: chosen, rejected; KTO: completion, KL pair) of a set of ``total``."""
    g = policy.groups
    if cfg.job == "dpo":
        tokens = torch.tensor([len(r.chosen_ids) for r in records], dtype=torch.float32, device=g.device)
        return dpo_metrics(logps, ref, tokens, cfg.algorithm, g, total)
    kl = _dp_sum([logps[:, 1] - ref[:, 1]], g)[0]  # the KL reference point over the whole set
    z0 = torch.clamp(torch.tensor(kl / total, device=g.device), min=0.0).float()
    desirable = torch.tensor([bool(r.label) for r in records], dtype=torch.bool, device=g.device)
    return kto_metrics(logps[:, 0], ref[:, 0], desirable, z0, cfg.algorithm, g, total)


def _update_stats(stats: dict) -> dict:
    return {"grad_norm": stats.get("grad_norm", math.nan), "learning_rate": stats.get("lr", 0.0)}


def batch_tokens(records: list, kind: str) -> int:
    """Tokens the update's forward reads for a global batch (prompt + completion of every row)."""
    if kind == "dpo":
        return sum(2 * len(r.prompt_ids) + len(r.chosen_ids) + len(r.rejected_ids) for r in records)
    return sum(len(r.prompt_ids) + len(r.completion_ids) for r in records)


def _check_kto_balance(cfg: KTOJobConfig, dataset) -> None:
    """The KTO paper's advice: lambda_D n_D / (lambda_U n_U) in [1, 4/3]."""
    s, a = dataset.stats, cfg.algorithm
    ratio = a.desirable_weight * s.desirable / (a.undesirable_weight * s.undesirable) if s.undesirable else math.inf
    if not 1.0 <= ratio <= 4 / 3:
        print(f"[hyflow] warning: desirable_weight * desirable / (undesirable_weight * undesirable) = "
              f"{a.desirable_weight} * {s.desirable} / ({a.undesirable_weight} * {s.undesirable}) = {ratio:.3g}; "
              "the KTO paper recommends a value in [1, 4/3] (adjust algorithm.desirable_weight / "
              "undesirable_weight)", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- checkpoints
