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

With ``rollout.multi_turn`` each generation replica runs the agent's multi-turn loop instead of
one call of its engine (:meth:`~hyflow.placement.pool_models.GenerationSide.trajectories`: the
tools and environments on the replica's leader, seeds as colocated) and sends the trajectories'
rows with their loss masks and counters; the training pool scores and trains on them as the
colocated job does, and a checkpoint's in-flight batch holds them whole (ids, masks, counters:
nothing of an environment is needed to train on a finished trajectory).

``trainer.mode: sync`` with ``placement.pools`` runs these loops without the overlap: the
generation pool samples batch ``t+1`` after receiving ``w_t`` (staleness 0 every step, no
rollout correction unless set), so its metrics equal the colocated run's. A critic on a pool of
its own answers the training pool step by step (:mod:`hyflow.placement.remote_critic`); such a run
writes no checkpoint yet.

``trainer.mode: async`` runs the same training loop; its generation pool runs the loop of
:mod:`hyflow.jobs.fully_async` (up to ``trainer.max_staleness`` batches ahead, new weights at a
token boundary) and its checkpoints hold that loop's in-flight state; with ``rollout.multi_turn`` the loop
of :mod:`hyflow.jobs.async_trajectories` (turns fed to the scheduler, trajectories resumed by replaying
their turns into re-created environments).
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch.distributed as dist

from hyflow.agent.agent import MultiTurnAgent
from hyflow.algorithms.kl import make_kl_controller
from hyflow.checkpoint.checkpointer import Checkpointer
from hyflow.data.dataset import build_dataset
from hyflow.data.loader import PromptLoader
from hyflow.data.tasks import load_data_tokenizer, tokenizer_spec_for
from hyflow.jobs.async_filter import filter_metrics, group_filter
from hyflow.jobs.async_trajectories import AsyncTrajectories
from hyflow.jobs.fully_async import AsyncGeneration, read_async_inflight, version_metrics
from hyflow.jobs.loop import open_run, run_job
from hyflow.jobs.rl import RLSteps, StepJob, frozen_models, rl_step, sft_warmup
from hyflow.jobs.rl_config import RLJobConfig
from hyflow.jobs.step_end import save_due
from hyflow.monitor import comm
from hyflow.monitor.memory import memory_summary
from hyflow.placement.groups import build_pool_groups, build_sync_group, pool_enumerations
from hyflow.placement.inflight import Control, GenerationCheckpoints, InFlight, control, control_group, read_inflight
from hyflow.placement.pool_models import GenerationSide, RemoteRollouts, WeightSender, build_training_models
from hyflow.placement.remote_critic import has_remote_critic, serve_critic
from hyflow.placement.rows import row_routes, send_rows
from hyflow.rewards.manager import RewardManager
from hyflow.rl.state import RLState
from hyflow.training.supervisor import StepSupervisor
from hyflow.vllm_backend.groups import init_vllm_groups, local_rank


def _setup_data(cfg: RLJobConfig):
    tokenizer = load_data_tokenizer(cfg.data)
    dataset = build_dataset(cfg.data, cfg.rollout, tokenizer)
    loader = PromptLoader(dataset, cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    return tokenizer, dataset, loader


def run(cfg: RLJobConfig) -> list[dict]:
    """Both pools' loops; the training pool's rank 0 writes the metrics."""
    placement = cfg.resolved_placement(dist.get_world_size())
    rank = dist.get_rank()
    groups = build_pool_groups(placement)
    actor, gen = placement.roles["actor"], placement.roles["rollout"]
    sync_group = build_sync_group(actor.pool, gen.pool)
    # this rank's pool: the supervisor's flags, set-up agreements, the distributed optimizer's instance
    pool_group = groups.pool_group
    if cfg.rollout.backend == "vllm":  # vLLM's groups: every rank creates them, the generation pool uses them
        init_vllm_groups(pool_enumerations(placement)["tp"], local_rank(groups.device))
    ctl = control_group(placement)  # the lead's per-step message to the other pools
    if has_remote_critic(placement) and rank in placement.roles["critic"].pool:
        serve_critic(cfg, placement, groups, pool_group,
                     lambda: control(Control(go=False), placement, rank, groups.device, ctl).go)
        return []
    if rank in gen.pool:
        _generation_loop(cfg, placement, groups, sync_group, ctl)
        return []
    return _training_loop(cfg, placement, groups, sync_group, pool_group, ctl)


def checkpointing(placement) -> bool:
    """Whether this pooled run writes and resumes checkpoints: not with a critic on a pool of its own
    (its pool does not join the checkpoint yet; :func:`~hyflow.placement.remote_critic.check_remote_roles`
    refuses saving and resuming such a run before launch)."""
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


def _generation_loop(cfg: RLJobConfig, placement, groups, sync_group, ctl) -> None:
    tokenizer, dataset, loader = _setup_data(cfg)
    side = GenerationSide(cfg, tokenizer, placement, groups, sync_group)
    rank, n = dist.get_rank(), cfg.rollout.n
    routes = row_routes(cfg.data.train_batch_size, placement.roles["rollout"], placement.roles["actor"])
    # A stop signal must not end a generation rank: the training pool (signalled as well) agrees on
    # the stop, and this pool joins its last save before leaving.
    held = StepSupervisor(1, device=groups.device).install()
    ckpts = GenerationCheckpoints(cfg, placement, groups, side.desc) if checkpointing(placement) else None
    overlap = cfg.trainer.mode == "one_step_off"  # sync: batch t+1 waits for w_t
    try:
        fully_async = cfg.trainer.mode == "async"
        read = read_async_inflight if fully_async else read_inflight
        resumed = ckpts.resume(cfg.trainer.resume, read=read) if ckpts else None  # collective with the training pool's
        if resumed is None:
            for _ in range(cfg.actor.sft_warmup_steps):  # the training pool's warm-up draws these batches
                loader.next_batch()
        else:
            loader.load_state_dict(resumed.loader)
        if not control(Control(go=False), placement, rank, groups.device, ctl).go:
            return
        side.receive_weights()  # w_0, or w_t after a resume from step t
        if fully_async:  # its own loop (hyflow.jobs.fully_async), DAPO's filter when on (hyflow.jobs.async_filter)
            args = (cfg, side, loader, routes, lambda: control(Control(go=False), placement, rank, groups.device, ctl),
                    ckpts)
            with group_filter(cfg, tokenizer, dataset, side) or nullcontext() as kept:
                # multi-turn: turns fed to the scheduler (with dynamic sampling refused: RLJobConfig._check_async)
                loop = AsyncTrajectories(*args) if side.agent else AsyncGeneration(*args, group_filter=kept)
                loop.run(resumed)
            return
        version = 0 if resumed is None else resumed.step - 1  # the weights held (updates applied)

        def generate(step: int):
            start = time.perf_counter()
            records = loader.next_batch()
            # multi-turn: the agent's loop on this replica (tools and environments on its leader)
            samples = side.trajectories(records, step, n) if side.agent else side.generate(records, step, n).samples
            return samples, time.perf_counter() - start, version

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
            msg = control(Control(go=False), placement, rank, groups.device, ctl)
            if msg.go:
                side.receive_weights()
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


def _training_loop(cfg: RLJobConfig, placement, groups, sync_group, train_group, ctl) -> list[dict]:
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
    # multi-turn: the rows are trajectories the generation pool ran; the agent scores them here (and
    # gives the SFT warm-up its demonstrations); its tools and environments run on the generation pool
    agent = MultiTurnAgent(cfg.rollout.multi_turn, tokenizer) if cfg.rollout.multi_turn.enable else None
    # async: the generation pool's filter already did DAPO's dynamic sampling (hyflow.jobs.async_filter)
    job = StepJob(tokenizer, reward, sorted({r.data_source for r in dataset}), len(dataset), agent,
                  refill=cfg.trainer.mode != "async")
    supervisor.install()
    # Synchronous saves: a background save's completion is agreed over the world at step ends,
    # which would tie the generation pool's loop to the training pool's.
    lead = rank == placement.roles["actor"].pool.start
    saves = checkpointing(placement)
    ckpt = Checkpointer(cfg.trainer.output_dir, groups, models.desc, cfg.trainer.keep_last, async_save=False,
                        tokenizer=tokenizer_spec_for(cfg.data), reshard=False) if saves else _NoCheckpoints(lead)
    steps = PooledSteps(cfg, state, job, ckpt, placement, train_group, ctl, saves, dataset)
    try:
        run = open_run(cfg, ckpt, supervisor, steps.resume, lead)  # the resume is collective with the generation pool
        if lead:
            print(f"[hyflow] trainer.mode={cfg.trainer.mode} on pools: {placement.describe()}; "
                  f"{job.dataset_size} prompts; {models.weights.describe()}", flush=True)
        steps.before_train(run)
        return run_job(run, steps)
    finally:
        reward.close()  # the reward function's worker processes


class PooledSteps(RLSteps):
    """The training pool's steps: :class:`~hyflow.jobs.rl.RLSteps` whose rows come from the
    generation pool, followed by the control message and the weight send; metrics of both pools."""

    def __init__(self, cfg: RLJobConfig, state, job, ckpt, placement, train_group, ctl, saves: bool,
                 dataset=None) -> None:
        super().__init__(cfg, state, job, ckpt)
        # async: a batch's rows answer prompts of several loader batches, named by their dataset index
        self.dataset = dataset if cfg.trainer.mode == "async" else None
        # this loop drives the pooled roles' own parts: the weight send and the received rows' record
        self.sender, self.received = state.models.weights, state.models.rollouts
        assert isinstance(self.sender, WeightSender) and isinstance(self.received, RemoteRollouts)
        self.placement, self.train_group, self.ctl, self.saves = placement, train_group, ctl, saves
        self.saved_models = (*state.models.trained(), *(frozen_models(cfg, state.models) or {}))
        self.t0 = 0.0

    def resume(self) -> int:
        return super().resume() if self.saves else 0

    def before_train(self, run) -> None:
        """The warm-up, then tell the generation pool whether to go on and send w_0 (w_start after a resume)."""
        cfg, self.run = self.cfg, run
        if cfg.actor.sft_warmup_steps and not run.start:
            sft_warmup(cfg, self.state, self.job.tokenizer, self.job.agent)
        go = run.start < cfg.trainer.total_steps
        control(Control(go=go), self.placement, dist.get_rank(), self._device, self.ctl)
        if go:
            self.sender.send()
        comm.install()
        run.hooks = (comm,)

    @property
    def _device(self):
        return self.state.models.groups.device

    def step(self, step: int) -> dict:
        self.t0 = time.perf_counter()
        if self.dataset is None:
            return super().step(step)
        # async: receive the rows first; they say which prompts they answer (hyflow.jobs.fully_async).
        # The loader still draws the step's batch, so its checkpointed position is the sync run's.
        records = self.state.loader.next_batch()
        with self.timers.phase("gen"):
            rows = self.received.receive(len(records))
        request = rows.samples.column("request").tolist()
        for j, uid in zip(request, rows.origins[:, 2].tolist()):  # rl_step scores each row against these
            records[j] = self.dataset[uid]
        self.records = records
        metrics, self.data = rl_step(self.cfg, self.state, records, self.job, self.timers)
        return metrics

    def report(self, step: int, metrics: dict, outcome) -> bool:
        self.state.step = step
        rows = self.received.last
        go = not outcome.stop and step < self.cfg.trainer.total_steps
        t1 = time.perf_counter()
        due = self.saves and save_due(self.cfg.trainer, step, outcome)
        # the generation pool joins the save (its batch in flight)
        control(Control(go=go, save=due, step=step, models=self.saved_models if due else ()), self.placement,
                dist.get_rank(), self._device, self.ctl)
        sent = self.sender.send() if go else None
        step_seconds = time.perf_counter() - self.t0
        metrics.update(self.timers.step_summary())
        metrics.update(comm.step_summary(), **memory_summary(self._device, self.train_group))
        wait = metrics.get("timing_s/gen", 0.0)  # phase 1 here is waiting for the rows
        update = t1 - self.t0 - wait
        metrics.update({
            "staleness": float(step - 1 - rows.version),
            "timing_s/gen_pool": rows.gen_seconds,  # the batch's generation on the generation pool
            "timing_s/update_pool": update,  # phases 2-6 on the training pool
            "timing_s/wait_rows": wait,
            "timing_s/weight_sync": sent.seconds if sent else 0.0,
            "weight_sync/bytes_sent": float(sent.bytes_sent if sent else 0),
            "data_plane/bytes_received": float(rows.nbytes),
            "timing_s/step": step_seconds,
            "perf/time_per_step": step_seconds,
            "perf/overlap_ratio": step_seconds / max(rows.gen_seconds, update, 1e-9),
        })
        metrics["perf/throughput"] = metrics["perf/total_num_tokens"] / (step_seconds * dist.get_world_size())
        metrics["perf/train_pool_utilization"] = update / max(step_seconds, 1e-9)
        # one batch per step: the generation pool's busy share of the step (async: at the steady state)
        metrics["perf/gen_pool_utilization"] = min(1.0, rows.gen_seconds / max(step_seconds, 1e-9))
        metrics["timing_s/gen_wait"] = rows.wait_seconds  # the generation pool's waits for this pool
        if rows.samples.versions is not None:  # tokens tagged with the weight version that sampled them
            # verl's name: the generation pool's share of time waiting for this pool since its previous send
            metrics["fully_async/rollouter/idle_ratio"] = rows.wait_seconds / max(
                rows.wait_seconds + rows.gen_seconds, 1e-9)
            metrics.update(version_metrics(rows.samples, step, self.cfg.trainer.max_staleness,
                                           self.state.models.groups.pgs.dp, self._device, dropped=rows.dropped))
            dropped = int(metrics["fully_async/count/dropped_stale_samples"])
            lead = dist.get_rank() == self.placement.roles["actor"].pool.start
            if dropped and lead:
                print(f"[hyflow] step {step}: the generation pool dropped {dropped} samples more than "
                      f"trainer.max_staleness={self.cfg.trainer.max_staleness} weight versions old "
                      "(fully_async/count/dropped_stale_samples)", flush=True)
            if self.cfg.algorithm.dynamic_sampling.enable:  # the groups the generation pool filtered
                metrics.update(filter_metrics(self.data["scores"], self.cfg.rollout.n, rows.filtered,
                                              self.state.models.groups.pgs.dp, self._device))
                if metrics["dynamic_sampling/gave_up"] and lead:
                    print(f"[hyflow] warning: step {step} trains on groups without reward variance: the generation "
                          "pool reached algorithm.dynamic_sampling.max_rounds (dynamic_sampling/gave_up)", flush=True)
        return go

    def save(self, step: int):
        return super().save(step) if self.saves else None
