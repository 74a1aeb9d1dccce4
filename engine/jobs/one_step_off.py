"""``trainer.mode: one_step_off``: generation overlaps the update, one update behind.

Two pools (``placement.pools``; without them the first half of the ranks trains and the second
half generates). With ``w_k`` the actor after ``k`` updates and batch ``t`` the rollouts trained on
at step ``t``::

    generation pool:  recv w_0 | gen 1 (w_0) | send 1, gen 2 (w_0) | recv w_1 | send 2, gen 3 (w_1) | recv w_2 ...
    training pool:    send w_0 |             | recv 1, update 1    | send w_1 | recv 2, update 2    | send w_2 ...

While the training pool updates on batch ``t`` the generation pool samples batch ``t+1`` with
``w_{t-1}``: batch ``t`` is ``staleness = (t-1) - version`` updates old (0 for the first batch, 1
after). The update is :func:`hyflow.jobs.rl.rl_step` unchanged: its phase 1 receives this rank's
rows (:class:`~hyflow.placement.pool_models.RemoteRollouts`; rows go only to the training DP rank
that owns them) and its phase 5 corrects with ``actor.rollout_correction`` (``token_tis`` unless
set: the sampler's log-probs are the behaviour policy). Seeds are the colocated job's (keyed by
step and global prompt index), so step 1 equals a ``sync`` run's step 1.

After each update the training pool's first rank tells every generation rank whether to go on
(one int64 per rank), then the weight sync moves the actor's shards
(:mod:`hyflow.placement.weight_sync`). Checkpoints are not written or resumed in this mode yet
(:func:`check_supported` says so before any rank starts).

``trainer.mode: sync`` with ``placement.pools`` runs these loops without the overlap: the
generation pool samples batch ``t+1`` after receiving ``w_t`` (staleness 0 every step, no
rollout correction unless set), so its metrics equal the colocated run's. A critic on a pool of
its own answers the training pool step by step (:mod:`hyflow.placement.remote_critic`).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from hyflow.config import ConfigError, dump_yaml, format_config
from hyflow.jobs.rl_config import RLJobConfig


def check_supported(cfg: RLJobConfig) -> None:
    """What this mode does not run yet, named before any rank starts (called by the preflight)."""
    placement = cfg.resolved_placement()
    if placement.colocated:
        return
    from hyflow.placement.remote_critic import check_remote_roles

    check_remote_roles(cfg, placement)  # roles on a pool apart from the actor's: the critic only
    if cfg.algorithm.adv_estimator == "remax":
        raise ConfigError("the generation pool does not generate ReMax's greedy baselines: run ReMax colocated "
                          "(trainer.mode=sync, placement.pools empty)", key="algorithm.adv_estimator")
    if cfg.trainer.save_every:
        raise ConfigError("trainer.mode=one_step_off does not write checkpoints yet (the in-flight batch would be "
                          "lost): set trainer.save_every=0", key="trainer.save_every")
    if cfg.trainer.resume not in ("auto", "never"):
        raise ConfigError("trainer.mode=one_step_off does not resume from checkpoints yet: set trainer.resume=never "
                          "or trainer.mode=sync", key="trainer.resume")
    if cfg.trainer.resume == "auto":
        from hyflow.checkpoint.discovery import checkpoints_root, latest_checkpoint

        found = latest_checkpoint(checkpoints_root(cfg.trainer.output_dir), lambda _: None)
        if found is not None:
            raise ConfigError(f"{cfg.trainer.output_dir} holds checkpoint {found.path}, and trainer.mode=one_step_off "
                              "does not resume yet: use another trainer.output_dir, trainer.resume=never, or "
                              "trainer.mode=sync to continue it", key="trainer.resume")


def _setup_data(cfg: RLJobConfig):
    from hyflow.data.dataset import build_dataset
    from hyflow.data.loader import PromptLoader
    from hyflow.data.tasks import load_data_tokenizer

    tokenizer = load_data_tokenizer(cfg.data)
    dataset = build_dataset(cfg.data, cfg.rollout, tokenizer)
    loader = PromptLoader(dataset, cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    return tokenizer, dataset, loader


def _control(go: bool, placement, rank: int, device: torch.device) -> bool:
    """The training pool's first rank tells every other rank (generation, critic pool) whether another step follows."""
    train = placement.roles["actor"].pool
    others = [r for r in range(placement.world) if r not in train]  # generation (and critic) pools
    flag = torch.tensor([int(go)], dtype=torch.long, device=device)
    if rank == train.start:
        ops = [dist.P2POp(dist.isend, flag, r) for r in others]
    elif rank not in train:
        ops = [dist.P2POp(dist.irecv, flag, train.start)]
    else:
        return go
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return bool(flag.item())


def run(cfg: RLJobConfig) -> list[dict]:
    """Both pools' loops; the training pool's rank 0 writes the metrics."""
    from hyflow.placement.groups import build_pool_groups, build_sync_group

    check_supported(cfg)
    placement = cfg.resolved_placement(dist.get_world_size())
    rank = dist.get_rank()
    groups = build_pool_groups(placement)
    actor, gen = placement.roles["actor"], placement.roles["rollout"]
    sync_group = build_sync_group(actor.pool, gen.pool)
    train_group = dist.new_group(ranks=list(actor.pool.ranks))  # the supervisor's flags, set-up agreements
    critic_group = _critic_pool_group(placement)
    if critic_group is not None and rank in placement.roles["critic"].pool:
        from hyflow.placement.remote_critic import serve_critic

        serve_critic(cfg, placement, groups, critic_group, lambda: _control(False, placement, rank, groups.device))
        return []
    if rank in gen.pool:
        _generation_loop(cfg, placement, groups, sync_group)
        return []
    return _training_loop(cfg, placement, groups, sync_group, train_group)


def _critic_pool_group(placement):
    """The critic pool's group when the critic has a pool of its own (collective: every rank calls it)."""
    from hyflow.placement.remote_critic import has_remote_critic

    if not has_remote_critic(placement):
        return None
    return dist.new_group(ranks=list(placement.roles["critic"].pool.ranks))


def _generation_loop(cfg: RLJobConfig, placement, groups, sync_group) -> None:
    from hyflow.placement.pool_models import GenerationSide
    from hyflow.placement.rows import row_routes, send_rows

    tokenizer, _, loader = _setup_data(cfg)
    side = GenerationSide(cfg, tokenizer, placement, groups, sync_group)
    rank, n = dist.get_rank(), cfg.rollout.n
    routes = row_routes(cfg.data.train_batch_size, placement.roles["rollout"], placement.roles["actor"])
    for _ in range(cfg.actor.sft_warmup_steps):  # the training pool's warm-up draws these batches
        loader.next_batch()
    if not _control(True, placement, rank, groups.device):
        return
    side.sync.run()  # w_0
    version, step = 0, 1  # the weights held (updates applied), the next batch to send

    def generate(step: int):
        start = time.perf_counter()
        out = side.generate(loader.next_batch(), step, n)
        return out.samples, time.perf_counter() - start, version

    overlap = cfg.trainer.mode == "one_step_off"  # sync: batch t+1 waits for w_t
    samples, seconds, made_with = generate(step)
    while True:
        send_rows(samples, routes, rank, made_with, seconds)
        if overlap and step < cfg.trainer.total_steps:
            samples, seconds, made_with = generate(step + 1)  # overlaps the update on batch `step`
        if not _control(False, placement, rank, groups.device):
            return
        side.sync.run()
        version, step = step, step + 1
        if not overlap:
            samples, seconds, made_with = generate(step)


def _training_loop(cfg: RLJobConfig, placement, groups, sync_group, train_group) -> list[dict]:
    from hyflow.algorithms.kl import make_kl_controller
    from hyflow.jobs.rl import StepJob, _finish, rl_step, sft_warmup
    from hyflow.monitor import comm
    from hyflow.monitor.memory import memory_summary
    from hyflow.monitor.metrics import MetricsWriter
    from hyflow.monitor.progress import Progress
    from hyflow.monitor.timers import PhaseTimers
    from hyflow.placement.pool_models import build_training_models
    from hyflow.rewards.manager import RewardManager
    from hyflow.rl.state import RLState
    from hyflow.training.supervisor import StepSupervisor

    rank = dist.get_rank()
    tokenizer, dataset, loader = _setup_data(cfg)
    models = build_training_models(cfg, tokenizer, placement, groups, sync_group, pool_group=train_group)
    reward = RewardManager.from_config(cfg.reward, model_fn=models.reward_model)
    reward.check_records(list(dataset))
    kl_ctrl = make_kl_controller(cfg.algorithm)
    optimizers = [m.optimizer for m in models.trained().values()]
    supervisor = StepSupervisor(cfg.trainer.max_bad_steps, optimizers, protect=[kl_ctrl], group=train_group,
                                device=groups.device)
    state = RLState(models=models, loader=loader, kl_ctrl=kl_ctrl, supervisor=supervisor)
    job = StepJob(tokenizer, reward, sorted({r.data_source for r in dataset}), len(dataset))
    supervisor.install()
    lead = rank == placement.roles["actor"].pool.start
    if lead:
        os.makedirs(cfg.trainer.output_dir, exist_ok=True)
        dump_yaml(cfg, os.path.join(cfg.trainer.output_dir, "config.resolved.yaml"))
        print(format_config(cfg), flush=True)
        print(f"[hyflow] trainer.mode={cfg.trainer.mode} on pools: {placement.describe()}; {job.dataset_size} prompts; "
              f"{models.hybrid.sync.plan.summary()}", flush=True)
    writer = MetricsWriter.from_config(cfg.trainer) if lead else None
    if cfg.actor.sft_warmup_steps:
        sft_warmup(cfg, state, tokenizer)
    progress = Progress.from_config(cfg.trainer, initial=0, enabled=lead)
    timers = PhaseTimers(sync=torch.cuda.synchronize if groups.device.type == "cuda" else None)
    history = []
    _control(True, placement, rank, groups.device)
    models.hybrid.send()  # w_0
    comm.install()
    try:
        for step in range(1, cfg.trainer.total_steps + 1):
            t0 = time.perf_counter()
            records = loader.next_batch()
            supervisor.begin_step()
            metrics, _ = rl_step(cfg, state, records, job, timers)
            outcome = supervisor.end_step(metrics, step)
            state.step = step
            rows = models.dispatcher.last
            go = not outcome.stop and step < cfg.trainer.total_steps
            t1 = time.perf_counter()
            _control(go, placement, rank, groups.device)
            sent = models.hybrid.send() if go else None
            step_seconds = time.perf_counter() - t0
            metrics.update(timers.step_summary())
            metrics.update(comm.step_summary(), **memory_summary(groups.device, train_group))
            wait = metrics.get("timing_s/gen", 0.0)  # phase 1 here is waiting for the rows
            metrics.update({
                "staleness": float(step - 1 - rows.version),
                "timing_s/gen_pool": rows.gen_seconds,  # the batch's generation on the generation pool
                "timing_s/update_pool": t1 - t0 - wait,  # phases 2-6 on the training pool
                "timing_s/wait_rows": wait,
                "timing_s/weight_sync": sent.seconds if sent else 0.0,
                "weight_sync/bytes_sent": float(sent.bytes_sent if sent else 0),
                "data_plane/bytes_received": float(rows.nbytes),
            })
            metrics["timing_s/step"] = step_seconds
            metrics["perf/time_per_step"] = step_seconds
            metrics["perf/overlap_ratio"] = step_seconds / max(rows.gen_seconds, t1 - t0 - wait, 1e-9)
            metrics["perf/throughput"] = metrics["perf/total_num_tokens"] / (step_seconds * dist.get_world_size())
            metrics["step"] = step
            history.append(metrics)
            if writer is not None:
                writer.log(step, metrics)
            progress.update(step, metrics)
            if outcome.diverged:
                raise supervisor.divergence_error(None)
            if outcome.stop:
                break
    finally:
        comm.uninstall()
        supervisor.uninstall()
    progress.close()
    if writer is not None:
        writer.close()
        print(f"[hyflow] trainer.mode={cfg.trainer.mode} on placement pools writes no checkpoint yet", flush=True)
        _finish(cfg, writer.path)
    return history
