"""The RL job (``job: rl``): PPO / GRPO / RLOO / REINFORCE++ as one readable dataflow.

Per step::

    prompts ──► [reshard train→gen] ──► generate (micro-DP replicas) ──► [reshard gen→train]
            ──► reward ──► old / reference log-probs, values ──► advantages
            ──► actor update (mini-batches × PPO epochs) ──► critic update ──► metrics

ReMax adds one greedy response per prompt to the generate phase; its reward (same scorer)
is the baseline of that prompt's samples, and it is never trained on.

Every rank holds the whole rollout batch (token ids are small); forward-only scoring
runs on all rows, updates split mini-batches over data-parallel ranks.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

from hyflow.config import dump_yaml, format_config
from hyflow.jobs.rl_config import RLJobConfig
from hyflow.algorithms.advantages import compute_advantages
from hyflow.algorithms.kl import make_kl_controller
from hyflow.rl.batch import build_rollout_batch, micro_batches, position_ids
from hyflow.checkpoint.checkpointer import Checkpointer, TrainedModel, resume_path
from hyflow.training.supervisor import StepOutcome, StepSupervisor
from hyflow.rl.losses import forward_score, logprob_scorer, policy_loss_fn, value_loss_fn, value_scorer
from hyflow.rl.models import Roles, build_roles, check_actor_checkpoint
from hyflow.training.step import train_step


def run(cfg: RLJobConfig) -> list[dict]:
    """Train; rank 0 writes metrics.jsonl, TensorBoard, the resolved config and a plot."""
    from hyflow.data.dataset import PromptLoader, build_dataset
    from hyflow.data.tasks import load_data_tokenizer, tokenizer_spec_for
    from hyflow.monitor.metrics import MetricsWriter
    from hyflow.monitor.progress import Progress
    from hyflow.monitor.timers import PhaseTimers
    from hyflow.rewards.manager import RewardManager

    rank = dist.get_rank()
    if cfg.actor.checkpoint:  # before the tokenizer, which usually lives in the checkpoint's folder
        check_actor_checkpoint(cfg.actor.checkpoint)
    tokenizer = load_data_tokenizer(cfg.data)
    dataset = build_dataset(cfg.data, cfg.rollout, tokenizer)
    loader = PromptLoader(dataset, cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    roles = build_roles(cfg, tokenizer)
    reward = RewardManager.from_config(cfg.reward, model_fn=roles.reward_model)  # model_fn: None without one
    reward.check_records(list(dataset))
    kl_ctrl = make_kl_controller(cfg.algorithm)
    # SIGTERM / SIGUSR1 flags and NaN/inf guards, installed before the long set-up so no signal is lost
    supervisor = StepSupervisor(cfg.trainer.max_bad_steps, [roles.actor_optimizer, roles.critic_optimizer],
                                protect=[kl_ctrl]).install()
    ckpt = Checkpointer(cfg.trainer.output_dir, roles.groups, roles.desc, cfg.trainer.keep_last,
                        tokenizer=tokenizer_spec_for(cfg.data))
    start = _resume(cfg, ckpt, roles, loader, kl_ctrl, supervisor)  # the checkpoint's step; 0: fresh run
    if rank == 0:
        os.makedirs(cfg.trainer.output_dir, exist_ok=True)
        dump_yaml(cfg, os.path.join(cfg.trainer.output_dir, "config.resolved.yaml"))
        print(format_config(cfg), flush=True)
        print(f"[hyflow] actor training {roles.groups.layout.describe()} -> generation tp={cfg.rollout.layout.tp} "
              f"pp={cfg.rollout.layout.pp} with {roles.hybrid.plan.micro_dp_size} micro-DP replicas per "
              f"model copy; {len(dataset)} prompts", flush=True)
    writer = MetricsWriter.from_config(cfg.trainer, resume_step=start or None) if rank == 0 else None
    if cfg.actor.sft_warmup_steps and not start:
        sft_warmup(cfg, roles, loader, tokenizer)
    progress = Progress.from_config(cfg.trainer, initial=start, enabled=rank == 0)
    timers = PhaseTimers()
    history = []
    try:
        for step in range(start + 1, cfg.trainer.total_steps + 1):
            records = loader.next_batch()
            supervisor.begin_step()
            metrics, _ = rl_step(cfg, roles, records, tokenizer, reward, kl_ctrl, timers)
            outcome = supervisor.end_step(metrics, step)  # collective: agrees on stop signals and NaN/inf
            metrics.update(timers.step_summary())
            metrics["step"] = step
            history.append(metrics)
            if writer is not None:
                writer.log(step, metrics)
            progress.update(step, metrics)
            saved = _maybe_save(cfg, ckpt, roles, loader, kl_ctrl, supervisor, step, outcome)
            if outcome.diverged:
                ckpt.wait()
                raise supervisor.divergence_error(saved)
            if outcome.preempted:
                ckpt.log(f"[hyflow] stopped after step {step} on a stop signal; resume with the same command "
                         "(trainer.resume=auto)")
                break
        ckpt.wait()
    finally:
        supervisor.uninstall()
        ckpt.close(abort=True)  # no-op unless an error left a background save unfinished
    progress.close()
    if writer is not None:
        writer.close()
        _finish(cfg, writer.path)
    return history


def rl_step(cfg: RLJobConfig, roles: Roles, records, tokenizer, reward, kl_ctrl, timers) -> tuple[dict, dict]:
    """One RL step; returns its metrics (identical on every rank) and the step's tensors
    (rollout batch, scores, old / reference log-probs, values, advantages, returns)."""
    n = cfg.rollout.n
    prompts = [r.prompt_ids for r in records]
    remax = cfg.algorithm.adv_estimator == "remax"
    # 1. generate with the actor in its generation layout
    with timers.phase("reshard"):
        gen_model = roles.hybrid.to_generation()
    with timers.phase("generate"):
        result = roles.generate(gen_model, prompts, n)
        # ReMax: one greedy response per prompt, a baseline only (scored, never trained on)
        greedy = roles.generate(gen_model, prompts, 1, greedy=True) if remax else None
    with timers.phase("reshard"):
        roles.hybrid.to_training()
    samples = result.samples  # request order, n per prompt
    batch = build_rollout_batch([s.prompt_ids for s in samples], [s.token_ids for s in samples],
                                [s.request_index for s in samples], [s.logprobs for s in samples],
                                pad_id=tokenizer.pad_token_id or 0)
    # 2. score responses
    with timers.phase("reward"):
        scored = score_samples(reward, records, samples, tokenizer)
        scores = torch.tensor(scored.scores, dtype=torch.float32)
    # 2b. ReMax: each sample's baseline is the score of its prompt's greedy response
    greedy_scored, greedy_scores = None, None
    if greedy is not None:
        with timers.phase("reward"):
            greedy_scored = score_samples(reward, records, greedy.samples, tokenizer)
        greedy_scores = torch.tensor(greedy_scored.scores, dtype=torch.float32)[batch.group_ids]
    # 3. old / reference log-probs and values, forward-only over all rows
    tensors = {"tokens": batch.tokens, "position_ids": position_ids(batch.tokens),
               "response_mask": batch.response_mask}
    rows = list(range(batch.size))
    mb = cfg.actor.micro_batch_size
    pad_rows = (-len(rows)) % mb
    score_rows = rows + rows[:pad_rows]  # pad to whole micro-batches; the extra rows are dropped
    scoring = micro_batches(tensors, score_rows, mb)
    tp_group = roles.groups.pgs.tp
    vocab = roles.sample_vocab  # score over exactly the ids the sampler can draw
    temp = cfg.rollout.temperature  # score the distribution the rollout sampled from
    logprob_diff = None
    with timers.phase("ref"):
        if cfg.actor.old_logprobs == "rollout":  # the weights that sampled are the ones about to be updated
            old_logp = batch.rollout_logprobs
        else:
            old_logp = forward_score(roles.actor_chunks, scoring, logprob_scorer(vocab, tp_group, temp), roles.groups.pgs)[:batch.size]
            logprob_diff = float(((old_logp - batch.rollout_logprobs).abs() * batch.response_mask).max())
        ref_logp = None
        if roles.reference is not None:
            ref_logp = forward_score([roles.reference], scoring, logprob_scorer(vocab, tp_group, temp), roles.groups.pgs)[:batch.size]
    values = None
    if roles.critic_chunks is not None:
        with timers.phase("critic"):
            values = forward_score(roles.critic_chunks, scoring, value_scorer(), roles.groups.pgs)[:batch.size]
    # 4. advantages
    adv = compute_advantages(cfg.algorithm, scores, batch.group_ids, batch.response_mask, old_logp, ref_logp,
                             values, kl_ctrl, greedy_scores=greedy_scores)
    # 5. updates
    train = dict(tensors, old_logp=old_logp, advantages=adv.advantages)
    if ref_logp is not None:
        train["ref_logp"] = ref_logp
    with timers.phase("update"):
        actor_stats = _update(cfg, roles.actor_chunks, roles.actor_optimizer, roles.actor_scheduler, train,
                              policy_loss_fn(cfg.actor, vocab, tp_group, temp, cfg.loss_norm_length), roles,
                              cfg.actor.micro_batch_size)
        critic_stats = {}
        if roles.critic_chunks is not None:
            critic_train = dict(tensors, old_values=values, returns=adv.returns)
            critic_stats = _update(cfg, roles.critic_chunks, roles.critic_optimizer, roles.critic_scheduler,
                                   critic_train,
                                   value_loss_fn(cfg.critic, cfg.actor.loss_agg_mode, cfg.loss_norm_length),
                                   roles, cfg.critic.micro_batch_size)
    if cfg.algorithm.use_kl_in_reward:
        kl_ctrl.update(adv.kl, batch.size)  # the horizon counts responses (n per prompt), not prompts
    resp_len = batch.response_lengths.float()
    gen_seconds = timers.step_times.get("generate", 0.0)
    gen_tokens = float(batch.response_lengths.sum()) + (
        sum(len(s.token_ids) for s in greedy.samples) if greedy is not None else 0)
    out = dict(scored.metrics())
    if greedy_scored is not None:
        out["reward/greedy_mean"] = sum(greedy_scored.scores) / len(greedy_scored.scores)
    out.update(actor_stats)
    out.update(critic_stats)
    out.update({
        "kl": adv.kl, "kl_coef": kl_ctrl.value,
        "response_length/mean": float(resp_len.mean()), "response_length/max": float(resp_len.max()),
        "response/clip_frac": float(sum(s.finish_reason == "length" for s in samples) / len(samples)),
        "tokens_per_s": gen_tokens / max(gen_seconds, 1e-9),
        "reshard/bytes_received": roles.hybrid.stats.bytes_received,
        "reshard/seconds": roles.hybrid.stats.seconds,
    })
    if logprob_diff is not None:  # generation-layout sampler vs training-layout forward, same weights
        out["rollout/logprob_diff_max"] = logprob_diff
    data = dict(train, scores=scores, values=values, returns=adv.returns, greedy_scores=greedy_scores)
    return out, data


def score_samples(reward, records, samples, tokenizer):
    """Rewards of generated ``samples`` to ``records`` (one score each, in order); a reward
    model reads their ``prompt + response`` token ids."""
    texts = tokenizer.batch_decode([s.token_ids for s in samples])
    return reward.score_records([records[s.request_index] for s in samples], texts,
                                sequences=[list(s.prompt_ids) + list(s.token_ids) for s in samples])


def _update(cfg, chunks, optimizer, scheduler, tensors: dict, loss_fn, roles: Roles, micro_size: int) -> dict:
    """PPO epochs over shuffled mini-batches; each DP rank takes its slice of a mini-batch."""
    B = tensors["tokens"].shape[0]
    dp, dp_rank = roles.groups.layout.dp, roles.groups.dp_rank
    mini = cfg.actor.mini_batch_size
    gen = torch.Generator().manual_seed(cfg.trainer.seed + roles.step_counter)
    roles.step_counter += 1
    sums: dict[str, float] = {}
    count = 0
    for _ in range(cfg.actor.ppo_epochs):
        order = torch.randperm(B, generator=gen).tolist()
        for start in range(0, B - mini + 1, mini):
            rows = order[start:start + mini]
            mine = rows[dp_rank * (mini // dp):(dp_rank + 1) * (mini // dp)]
            stats = train_step(chunks, optimizer, scheduler, micro_batches(tensors, mine, micro_size),
                               with_labels=False, loss_fn=loss_fn, pp_group=roles.groups.pgs.pp)
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v
            count += 1
    out = {k: v / max(count, 1) for k, v in sums.items()}
    # Each DP rank saw its slice of every mini-batch: report the mean over DP ranks, so the
    # metrics describe the whole batch and are identical on every rank (grad norm and lr
    # already are).
    local = sorted(k for k in out if k not in ("grad_norm", "lr", "update_ok"))
    if dp > 1 and local:
        vec = torch.tensor([out[k] for k in local], dtype=torch.float64)
        dist.all_reduce(vec, group=roles.groups.pgs.dp)
        out.update(zip(local, (vec / dp).tolist()))
    prefix = "critic" if any(k.startswith("critic/") for k in out) else "actor"
    out[f"{prefix}/grad_norm"] = out.pop("grad_norm", float("nan"))
    out[f"{prefix}/lr"] = out.pop("lr", 0.0)
    out.pop("update_ok", None)
    return out


def sft_warmup(cfg: RLJobConfig, roles: Roles, loader, tokenizer) -> None:
    """Supervised steps on the reference answers (``extra_info.answer``) before RL."""
    from hyflow.training.step import lm_loss

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    rank = dist.get_rank()
    eos = (tokenizer.stop_token_ids() or [0])[0]
    # Megatron's scheduler reads each param group's max_lr/min_lr: point them at the SFT rate.
    lr = cfg.actor.sft_lr
    saved = [(g.get("max_lr"), g.get("min_lr")) for g in roles.actor_optimizer.param_groups]
    for g in roles.actor_optimizer.param_groups:
        g["max_lr"], g["min_lr"] = lr, lr
    sft_scheduler = OptimizerParamScheduler(
        roles.actor_optimizer, init_lr=lr, max_lr=lr, min_lr=lr, lr_warmup_steps=0,
        lr_decay_steps=cfg.actor.sft_warmup_steps, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
        wd_incr_steps=cfg.actor.sft_warmup_steps, wd_incr_style="constant")
    for step in range(1, cfg.actor.sft_warmup_steps + 1):
        records = loader.next_batch()
        seqs, masks = [], []
        for r in records:
            if r.reference is None:
                raise ValueError(f"SFT warm-up needs a reference answer (extra_info.answer) in {r.where}")
            answer = tokenizer.encode(r.reference) + [eos]
            seqs.append(r.prompt_ids + answer)
            masks.append([0] * len(r.prompt_ids) + [1] * len(answer))
        S = max(len(s) for s in seqs) + 1
        tokens = torch.zeros(len(seqs), S, dtype=torch.long)
        loss_mask = torch.zeros(len(seqs), S)
        for i, (s, m) in enumerate(zip(seqs, masks)):
            tokens[i, :len(s)] = torch.tensor(s)
            loss_mask[i, :len(m)] = torch.tensor(m, dtype=torch.float)
        data = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": loss_mask[:, 1:],
                "position_ids": position_ids(tokens[:, :-1])}
        B = len(seqs)
        dp, dp_rank = roles.groups.layout.dp, roles.groups.dp_rank
        mine = list(range(B))[dp_rank * (B // dp):(dp_rank + 1) * (B // dp)]
        mb = min(cfg.actor.micro_batch_size, len(mine))
        stats = train_step(roles.actor_chunks, roles.actor_optimizer, sft_scheduler,
                           micro_batches(data, mine, mb), loss_fn=lm_loss, pp_group=roles.groups.pgs.pp)
        if rank == 0 and (step % 10 == 0 or step == cfg.actor.sft_warmup_steps):
            print(f"[hyflow] sft warm-up {step}/{cfg.actor.sft_warmup_steps} loss {stats['lm_loss']:.4f}", flush=True)
    for g, (max_lr, min_lr) in zip(roles.actor_optimizer.param_groups, saved):
        g["max_lr"], g["min_lr"] = max_lr, min_lr
    roles.actor_scheduler.step(0)  # back to the RL learning rate
    roles.reset_reference()


# --------------------------------------------------------------------------- checkpoints


def _trained_models(roles: Roles) -> dict[str, TrainedModel]:
    """The models every checkpoint holds, with their optimizers and LR schedulers."""
    models = {"actor": TrainedModel(roles.actor_chunks, roles.actor_optimizer, roles.actor_scheduler)}
    if roles.critic_chunks is not None:
        models["critic"] = TrainedModel(roles.critic_chunks, roles.critic_optimizer, roles.critic_scheduler)
    return models


def _frozen_models(cfg: RLJobConfig, roles: Roles) -> Optional[dict]:
    """The reference, when the config cannot rebuild it (it is the actor after the SFT warm-up)."""
    if roles.reference is not None and cfg.actor.sft_warmup_steps:
        return {"reference": roles.reference}
    return None


def _maybe_save(cfg: RLJobConfig, ckpt: Checkpointer, roles: Roles, loader, kl_ctrl, supervisor: StepSupervisor,
                step: int, outcome: StepOutcome) -> Optional[str]:
    """Checkpoint every ``trainer.save_every`` steps, at the last step and before stopping;
    returns the checkpoint's directory when one was written."""
    ckpt.poll()  # finalize background saves that finished (collective)
    every = cfg.trainer.save_every
    if not (outcome.stop or step == cfg.trainer.total_steps or (every and step % every == 0)):
        return None
    job = {"data": loader.state_dict(), "kl_ctrl": kl_ctrl.state_dict(), "step_counter": roles.step_counter,
           "supervisor": supervisor.state_dict()}
    return ckpt.save(step, _trained_models(roles), job, frozen=_frozen_models(cfg, roles),
                     config_text=format_config(cfg))


def _resume(cfg: RLJobConfig, ckpt: Checkpointer, roles: Roles, loader, kl_ctrl,
            supervisor: StepSupervisor) -> int:
    """Load the checkpoint ``trainer.resume`` names (rank 0 decides which); returns its step, 0
    when the run starts fresh. Restores the random streams, so it runs last in the set-up."""
    def warn(message: str) -> None:
        print(f"[hyflow] warning: {message}", file=sys.stderr, flush=True)

    choice = [resume_path(cfg.trainer.resume, cfg.trainer.output_dir, warn) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return 0
    state = ckpt.load(choice[0], _trained_models(roles), frozen=_frozen_models(cfg, roles))
    job = state["job"]
    loader.load_state_dict(job["data"])
    kl_ctrl.load_state_dict(job["kl_ctrl"])
    roles.step_counter = int(job["step_counter"])
    supervisor.load_state_dict(job["supervisor"])
    step = int(state["step"])
    if step >= cfg.trainer.total_steps:
        ckpt.log(f"[hyflow] the checkpoint is at step {step}: trainer.total_steps={cfg.trainer.total_steps} "
                 "is reached already, nothing to train")
    return step


def _finish(cfg: RLJobConfig, metrics_path: str) -> None:
    """Rank 0: plot the whole run's metrics (resumed parts included) and print a summary."""
    from hyflow.monitor.metrics import read_metrics
    from hyflow.monitor.plot import plot_metrics

    rows = read_metrics(metrics_path)
    if not rows:
        return
    plot_metrics(rows, os.path.join(cfg.trainer.output_dir, "reward_kl.png"))
    first, last = rows[0].get("reward/mean"), rows[-1].get("reward/mean")
    fmt = lambda v: "nan" if v is None else f"{v:.3f}"  # noqa: E731 - NaN rows are written as null
    print(f"[hyflow] done: reward {fmt(first)} -> {fmt(last)}; run directory {cfg.trainer.output_dir}", flush=True)
