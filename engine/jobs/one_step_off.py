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
and whether a checkpoint is written now (:func:`hyflow.placement.inflight.control`), then the
weight sync moves the actor's shards (:mod:`hyflow.placement.weight_sync`). Checkpoints hold both
pools' state, the batch in flight included, so a resumed run equals an uninterrupted one
(:mod:`hyflow.placement.inflight`).

``trainer.mode: sync`` with ``placement.pools`` runs these loops without the overlap: the
generation pool samples batch ``t+1`` after receiving ``w_t`` (staleness 0 every step, no
rollout correction unless set), so its metrics equal the colocated run's. A critic on a pool of
its own answers the training pool step by step (:mod:`hyflow.placement.remote_critic`); such a run
writes no checkpoint yet.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from hyflow.config import ConfigError
from hyflow.jobs.run_config import record_config
from hyflow.jobs.rl_config import RLJobConfig


def check_supported(cfg: RLJobConfig) -> None:
    """What this mode does not run yet, named before any rank starts (called by the preflight; what
    the pooled roles cannot do is their declared capabilities':
    :func:`hyflow.jobs.rl_preflight.check_role_capabilities`)."""
    placement = cfg.resolved_placement()
    if placement.colocated:
        return
    from hyflow.placement.remote_critic import check_remote_roles

    check_remote_roles(cfg, placement)  # roles on a pool apart from the actor's: the critic only
    if cfg.data.val_files:
        raise ConfigError("validation (data.val_files) runs colocated only for now: drop data.val_files with "
                          "placement pools, or validate the checkpoints with `hyflow eval`", key="data.val_files")
    actor = placement.roles["actor"].pool
    if actor.start != 0:  # Megatron's dist_checkpointing writes the models' common part from rank 0
        raise ConfigError(f"checkpoints of placement pools need the actor's pool to start at rank 0 (it is "
                          f"{actor.describe()}): list the training pool first in placement.pools",
                          key="placement.pools")


def _setup_data(cfg: RLJobConfig):
    from hyflow.data.dataset import build_dataset
    from hyflow.data.loader import PromptLoader
    from hyflow.data.tasks import load_data_tokenizer

    tokenizer = load_data_tokenizer(cfg.data)
    dataset = build_dataset(cfg.data, cfg.rollout, tokenizer)
    loader = PromptLoader(dataset, cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    return tokenizer, dataset, loader


def run(cfg: RLJobConfig) -> list[dict]:
    """Both pools' loops; the training pool's rank 0 writes the metrics."""
    from hyflow.placement.groups import build_pool_groups, build_sync_group
    from hyflow.placement.remote_critic import has_remote_critic

    check_supported(cfg)
    placement = cfg.resolved_placement(dist.get_world_size())
    rank = dist.get_rank()
    groups = build_pool_groups(placement)
    actor, gen = placement.roles["actor"], placement.roles["rollout"]
    sync_group = build_sync_group(actor.pool, gen.pool)
    # this rank's pool: the supervisor's flags, set-up agreements, the distributed optimizer's instance
    pool_group = groups.pool_group
    if has_remote_critic(placement) and rank in placement.roles["critic"].pool:
        from hyflow.placement.inflight import Control, control
        from hyflow.placement.remote_critic import serve_critic

        serve_critic(cfg, placement, groups, pool_group,
                     lambda: control(Control(go=False), placement, rank, groups.device).go)
        return []
    if rank in gen.pool:
        _generation_loop(cfg, placement, groups, sync_group)
        return []
    return _training_loop(cfg, placement, groups, sync_group, pool_group)


def checkpointing(placement) -> bool:
    """Whether this pooled run writes and resumes checkpoints: not with a critic on a pool of its own
    (its pool does not join the checkpoint yet; :func:`~hyflow.placement.remote_critic.check_remote_roles`
    refuses saving and resuming such a run before launch)."""
    from hyflow.placement.remote_critic import has_remote_critic

    return not has_remote_critic(placement)


class _NoCheckpoints:
    """Stands for the :class:`~hyflow.checkpoint.checkpointer.Checkpointer` of a run that writes none
    (:func:`checkpointing`): a stop signal ends the run after its step without a save."""

    def __init__(self, lead: bool) -> None:
        self.lead = lead

    def log(self, message: str) -> None:  # StepEnd's word on a stop: there is nothing to resume from
        if self.lead:
            print("[hyflow] stopped on a stop signal; no checkpoint is written (the critic's pool is not "
                  "checkpointed yet)", flush=True)

    def poll(self) -> None:
        pass

    def wait(self) -> None:
        pass

    def close(self, abort: bool = False) -> None:
        pass


def _generation_loop(cfg: RLJobConfig, placement, groups, sync_group) -> None:
    from hyflow.placement.inflight import Control, GenerationCheckpoints, InFlight, control
    from hyflow.placement.pool_models import GenerationSide
    from hyflow.placement.rows import row_routes, send_rows
    from hyflow.training.supervisor import StepSupervisor

    tokenizer, _, loader = _setup_data(cfg)
    side = GenerationSide(cfg, tokenizer, placement, groups, sync_group)
    rank, n = dist.get_rank(), cfg.rollout.n
    routes = row_routes(cfg.data.train_batch_size, placement.roles["rollout"], placement.roles["actor"])
    # A stop signal must not end a generation rank: the training pool (signalled as well) agrees on
    # the stop, and this pool joins its last save before leaving.
    held = StepSupervisor(1, device=groups.device).install()
    ckpts = GenerationCheckpoints(cfg, placement, groups, side.desc) if checkpointing(placement) else None
    overlap = cfg.trainer.mode == "one_step_off"  # sync: batch t+1 waits for w_t
    try:
        resumed = ckpts.resume(cfg.trainer.resume) if ckpts else None  # collective with the training pool's
        if resumed is None:
            for _ in range(cfg.actor.sft_warmup_steps):  # the training pool's warm-up draws these batches
                loader.next_batch()
        else:
            loader.load_state_dict(resumed.loader)
        if not control(Control(go=False), placement, rank, groups.device).go:
            return
        side.sync.run()  # w_0, or w_t after a resume from step t
        version = 0 if resumed is None else resumed.step - 1  # the weights held (updates applied)

        def generate(step: int):
            start = time.perf_counter()
            out = side.generate(loader.next_batch(), step, n)
            return out.samples, time.perf_counter() - start, version

        if resumed is None or resumed.samples is None:
            step = 1 if resumed is None else resumed.step
            batch = generate(step)
        else:  # the batch that was in flight when the checkpoint was written, sampled before it
            step, batch = resumed.step, (resumed.samples, resumed.gen_seconds, resumed.version)
        while True:
            send_rows(batch[0], routes, rank, batch[2], batch[1])
            following = None
            if overlap and step < cfg.trainer.total_steps:
                following = generate(step + 1)  # overlaps the update on batch `step`
            msg = control(Control(go=False), placement, rank, groups.device)
            if msg.go:
                side.sync.run()
            if msg.save:
                samples, seconds, made_with = following or (None, 0.0, version)
                ckpts.save(msg, InFlight(step=step + 1, samples=samples, version=made_with, gen_seconds=seconds,
                                         loader=loader.state_dict()))
            if not msg.go:
                return
            version, step = step, step + 1
            batch = following if overlap else generate(step)  # sync: sampled with the weights just received
    finally:
        if ckpts:
            ckpts.close(abort=True)
        held.uninstall()


def _training_loop(cfg: RLJobConfig, placement, groups, sync_group, train_group) -> list[dict]:
    from hyflow.algorithms.kl import make_kl_controller
    from hyflow.checkpoint.checkpointer import Checkpointer
    from hyflow.data.tasks import tokenizer_spec_for
    from hyflow.jobs.rl import StepJob, _finish, _frozen_models, _resume, _save, rl_step, sft_warmup
    from hyflow.jobs.step_end import StepEnd
    from hyflow.monitor import comm
    from hyflow.monitor.memory import memory_summary
    from hyflow.monitor.metrics import MetricsWriter
    from hyflow.monitor.progress import Progress
    from hyflow.monitor.timers import PhaseTimers
    from hyflow.placement.inflight import Control, control
    from hyflow.placement.pool_models import RemoteRollouts, WeightSender, build_training_models
    from hyflow.rewards.manager import RewardManager
    from hyflow.rl.state import RLState
    from hyflow.training.supervisor import StepSupervisor

    rank = dist.get_rank()
    tokenizer, dataset, loader = _setup_data(cfg)
    models = build_training_models(cfg, tokenizer, placement, groups, sync_group, pool_group=train_group)
    # this loop drives the pooled roles' own parts: the weight send and the received rows' record
    sender, received = models.weights, models.rollouts
    assert isinstance(sender, WeightSender) and isinstance(received, RemoteRollouts)
    reward = RewardManager.from_config(cfg.reward, model_fn=models.reward_model)
    reward.check_records(list(dataset))
    kl_ctrl = make_kl_controller(cfg.algorithm)
    optimizers = [m.optimizer for m in models.trained().values()]
    supervisor = StepSupervisor(cfg.trainer.max_bad_steps, optimizers, protect=[kl_ctrl], group=train_group,
                                device=groups.device)
    state = RLState(models=models, loader=loader, kl_ctrl=kl_ctrl, supervisor=supervisor)
    job = StepJob(tokenizer, reward, sorted({r.data_source for r in dataset}), len(dataset))
    supervisor.install()
    # Synchronous saves: a background save's completion is agreed over the world at step ends,
    # which would tie the generation pool's loop to the training pool's.
    lead = rank == placement.roles["actor"].pool.start
    saves = checkpointing(placement)
    ckpt = Checkpointer(cfg.trainer.output_dir, groups, models.desc, cfg.trainer.keep_last, async_save=False,
                        tokenizer=tokenizer_spec_for(cfg.data), reshard=False) if saves else _NoCheckpoints(lead)
    saved_models = (*models.trained(), *(_frozen_models(cfg, models) or {}))
    start = _resume(cfg, ckpt, state) if saves else 0  # collective with the generation pool's resume
    if lead:
        record_config(cfg, start)
        print(f"[hyflow] trainer.mode={cfg.trainer.mode} on pools: {placement.describe()}; {job.dataset_size} prompts; "
              f"{models.weights.describe()}", flush=True)
    writer = MetricsWriter.from_config(cfg.trainer, resume_step=start or None) if lead else None
    if cfg.actor.sft_warmup_steps and not start:
        sft_warmup(cfg, state, tokenizer)
    progress = Progress.from_config(cfg.trainer, initial=start, enabled=lead)
    timers = PhaseTimers(sync=torch.cuda.synchronize if groups.device.type == "cuda" else None)
    ends = StepEnd(cfg.trainer, ckpt, supervisor, writer, progress)
    go = start < cfg.trainer.total_steps
    control(Control(go=go), placement, rank, groups.device)
    if go:
        sender.send()  # w_0, or w_start after a resume
    comm.install()
    try:
        for step in range(start + 1, cfg.trainer.total_steps + 1):
            t0 = time.perf_counter()
            records = loader.next_batch()
            supervisor.begin_step()
            metrics, _ = rl_step(cfg, state, records, job, timers)
            outcome = supervisor.end_step(metrics, step)
            state.step = step
            rows = received.last
            go = not outcome.stop and step < cfg.trainer.total_steps
            t1 = time.perf_counter()
            due = saves and ends.save_due(step, outcome)  # the generation pool joins the save (in-flight batch)
            control(Control(go=go, save=due, step=step, models=saved_models if due else ()), placement, rank,
                    groups.device)
            sent = sender.send() if go else None
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
            save = (lambda _: _save(cfg, ckpt, state)) if saves else (lambda _: None)
            if ends.finish(step, metrics, outcome, save) or not go:
                break
    finally:
        comm.uninstall()
        supervisor.uninstall()
        ckpt.close(abort=True)
    progress.close()
    if writer is not None:
        writer.close()
        _finish(cfg, writer.path)
    return ends.history
