"""The RL job (``job: rl``): PPO / GRPO / RLOO / REINFORCE++ / ReMax as one readable dataflow.

Per step, on every rank::

    its DP shard of the prompts ──► [reshard train→gen] ──► generate on the micro-DP replicas
        ──► [reshard gen→train] ──► reward ──► old / reference log-probs, values ──► advantages
        ──► actor update (mini-batches × PPO epochs) ──► critic update ──► metrics

Data moves only where the layout needs it (:mod:`hyflow.rl.dispatch`): a training data-parallel
rank and its TP x PP peers generate, score and train only their own prompts; batch-wide quantities
(whitening, loss normalisation, metrics) are all-reductions of a few numbers over the DP group.
ReMax adds one greedy response per prompt to the generate phase; its reward (same scorer) is the
baseline of that prompt's samples, and it is never trained on.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from hyflow.agent.agent import MultiTurnAgent
from hyflow.agent.metrics import trajectory_metrics
from hyflow.agent.trajectory import STATS
from hyflow.algorithms.advantages import compute_advantages
from hyflow.algorithms.dapo import overlong_penalty
from hyflow.algorithms.kl import make_kl_controller
from hyflow.algorithms.mismatch import mismatch_metrics, mismatch_row_stats
from hyflow.algorithms.rollout_correction import rollout_correction, rollout_correction_metrics
from hyflow.checkpoint.checkpointer import Checkpointer
from hyflow.config import format_config
from hyflow.data.dataset import build_dataset, reference_response_ids
from hyflow.data.loader import PromptLoader
from hyflow.data.tasks import load_data_tokenizer, tokenizer_spec_for
from hyflow.jobs.loop import Run, open_run, run_job
from hyflow.jobs.rl_config import RLJobConfig
from hyflow.models.routing_replay import mismatch_counts, reset_mismatch
from hyflow.monitor import comm
from hyflow.monitor.memory import memory_summary
from hyflow.monitor.metrics import PHASE_KEYS, read_metrics
from hyflow.monitor.plot import plot_metrics, rl_plot_keys
from hyflow.monitor.samples import print_samples
from hyflow.monitor.timers import PhaseTimers
from hyflow.rewards.manager import RewardManager
from hyflow.rl.batch import MicroBatching, RolloutBatch, batching_for, build_rollout_batch, pad_multiple
from hyflow.rl.dispatch import sampling_seed
from hyflow.rl.dynamic_sampling import Round, collect_groups
from hyflow.rl.exact_logprobs import rescore_in_training_layout
from hyflow.rl.metrics import BatchStats, all_gather_strings, score_metrics
from hyflow.rl.models import RLModels, build_rl_models, check_actor_checkpoint
from hyflow.rl.staleness import StaleWeights
from hyflow.rl.state import RLState
from hyflow.rl.step_losses import PolicyLoss, forward_score, logprob_scorer
from hyflow.rl.update import update_model
from hyflow.rollout.config import GenerationConfig
from hyflow.rollout.dp import SampleTensors
from hyflow.training.step import data_group, lm_loss, token_mean_weights, train_step
from hyflow.training.supervisor import StepSupervisor
from hyflow.validation.rl import Validation, summary_line, validate_actor


def setup(cfg: RLJobConfig) -> tuple[RLState, "StepJob"]:
    """Everything a run steps with: its state (models, data position, KL controller, supervisor;
    the supervisor's signal handlers are not installed yet) and the step's helpers."""
    if cfg.actor.checkpoint:  # before the tokenizer, which usually lives in the checkpoint's folder
        check_actor_checkpoint(cfg.actor.checkpoint)
    tokenizer = load_data_tokenizer(cfg.data)
    dataset = build_dataset(cfg.data, cfg.rollout, tokenizer)
    loader = PromptLoader(dataset, cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    models = build_rl_models(cfg, tokenizer)
    reward = RewardManager.from_config(cfg.reward, model_fn=models.reward_model)  # model_fn: None without one
    reward.check_records(list(dataset))
    kl_ctrl = make_kl_controller(cfg.algorithm)
    optimizers = [m.optimizer for m in models.trained().values()]
    supervisor = StepSupervisor(cfg.trainer.max_bad_steps, optimizers, protect=[kl_ctrl], device=models.groups.device)
    state = RLState(models=models, loader=loader, kl_ctrl=kl_ctrl, supervisor=supervisor)
    agent = None
    if cfg.rollout.multi_turn.enable:  # tools, environments, chat pieces (hyflow.agent)
        agent = MultiTurnAgent(cfg.rollout.multi_turn, tokenizer)
    return state, StepJob(tokenizer, reward, sorted({r.data_source for r in dataset}), len(dataset), agent)


def run(cfg: RLJobConfig) -> list[dict]:
    """Train; rank 0 writes metrics.jsonl, TensorBoard, the resolved config and a plot."""
    state, job = setup(cfg)
    # SIGTERM / SIGUSR1 flags and NaN/inf guards, installed before the long set-up so no signal is lost
    state.supervisor.install()
    ckpt = Checkpointer(cfg.trainer.output_dir, state.models.groups, state.models.desc, cfg.trainer.keep_last,
                        tokenizer=tokenizer_spec_for(cfg.data))
    steps = RLSteps(cfg, state, job, ckpt)
    try:
        run = open_run(cfg, ckpt, state.supervisor, steps.resume, lead=dist.get_rank() == 0)
        if run.writer is not None:
            print(f"[hyflow] {state.models.weights.describe()}; {job.dataset_size} prompts", flush=True)
        steps.before_train(run)
        return run_job(run, steps)
    finally:
        job.reward.close()  # the reward function's worker processes


class RLSteps:
    """The colocated RL job's steps as :func:`~hyflow.jobs.loop.run_job` calls them: :func:`rl_step`
    on the loader's next batch, then the step's timers, communication and memory figures,
    validation when due, and checkpoints of the whole :class:`~hyflow.rl.state.RLState`."""

    def __init__(self, cfg: RLJobConfig, state: RLState, job: "StepJob", ckpt: Checkpointer) -> None:
        self.cfg, self.state, self.job, self.ckpt = cfg, state, job, ckpt
        device = state.models.groups.device
        # phases charged with the device work they launched
        self.timers = PhaseTimers(sync=torch.cuda.synchronize if device.type == "cuda" else None)
        self.validation: Optional[Validation] = None
        self.run: Optional[Run] = None
        self.records: list = []
        self.data: dict = {}

    def resume(self) -> int:
        """Load the checkpoint ``trainer.resume`` names (the newest that verifies, for ``auto``); returns
        its step, 0 when the run starts fresh. Restores the random streams, so it runs last in the set-up."""
        def warn(message: str) -> None:
            print(f"[hyflow] warning: {message}", file=sys.stderr, flush=True)

        path = self.ckpt.find_resume(self.cfg.trainer.resume, warn)  # verified; falls back past damaged ones
        if path is None:
            return 0
        state = self.state
        saved = self.ckpt.load(path, state.models.trained(), frozen=frozen_models(self.cfg, state.models))
        job = dict(saved["job"])
        job.setdefault("step", saved["step"])
        state.load_state_dict(job)
        if state.step >= self.cfg.trainer.total_steps:
            self.ckpt.log(f"[hyflow] the checkpoint is at step {state.step}: trainer.total_steps="
                          f"{self.cfg.trainer.total_steps} is reached already, nothing to train")
        return state.step

    def before_train(self, run: Run) -> None:
        """Validation of a fresh run's starting weights, its SFT warm-up, communication statistics."""
        cfg, self.run = self.cfg, run
        sampling = GenerationConfig.from_settings(cfg.rollout).sampling  # the rollout's stop tokens and length
        self.validation = Validation.from_config(cfg, self.job.tokenizer, self.job.reward, sampling, self.job.agent)
        if self.validation is not None and self.validation.before_train and not run.start:  # the starting weights
            self._validate(0, run.writer)  # logged as step 0
        if cfg.actor.sft_warmup_steps and not run.start:  # training: after the starting weights' validation
            sft_warmup(cfg, self.state, self.job.tokenizer, self.job.agent)
        comm.install()  # per-step communication statistics (hyflow.monitor.comm)
        run.hooks = (comm,)

    def step(self, step: int) -> dict:
        self.records = self.state.loader.next_batch()
        metrics, self.data = rl_step(self.cfg, self.state, self.records, self.job, self.timers)
        return metrics

    def report(self, step: int, metrics: dict, outcome) -> bool:
        cfg, device, timers = self.cfg, self.state.models.groups.device, self.timers
        self.state.step = step
        metrics.update(timers.cpu_summary())
        metrics.update(cpu_max_over_ranks(metrics, device))
        metrics.update(timers.step_summary())
        metrics.update(comm.step_summary(), **memory_summary(device))
        metrics["perf/time_per_step"] = metrics["timing_s/step"]
        if cfg.trainer.log_samples and dist.get_rank() == 0:  # trainer.log_samples lines every log_every
            print_samples(self.run.progress, cfg.trainer, step, self.run.start, self.records, self.data,
                          self.job.tokenizer, cfg.rollout.n)
        if self.validation is not None and not outcome.stop and self.validation.due(step, cfg.trainer.total_steps):
            metrics.update(self._validate(step, None))
        # verl's definition: prompt + response tokens per second per rank
        metrics["perf/throughput"] = metrics["perf/total_num_tokens"] / (
            metrics["timing_s/step"] * dist.get_world_size())
        return True

    def save(self, step: int) -> str:
        """Checkpoint the state's step; returns the checkpoint's directory."""
        return self.ckpt.save(self.state.step, self.state.models.trained(), self.state.state_dict(),
                              frozen=frozen_models(self.cfg, self.state.models), config_text=format_config(self.cfg))

    def summary(self, metrics_path: str) -> None:
        """Rank 0: plot the whole run's metrics (resumed parts included) and print a summary."""
        rows = read_metrics(metrics_path)
        if not rows:
            return
        plot_metrics(rows, os.path.join(self.cfg.trainer.output_dir, "reward_kl.png"),
                     keys=rl_plot_keys(self.cfg, rows))
        scores = [row["critic/score/mean"] for row in rows if "critic/score/mean" in row] or [None]  # not step 0's
        first, last = scores[0], scores[-1]  # (a validation row)
        fmt = lambda v: "nan" if v is None else f"{v:.3f}"  # noqa: E731 - NaN rows are written as null
        print(f"[hyflow] done: reward {fmt(first)} -> {fmt(last)}; run directory {self.cfg.trainer.output_dir}",
              flush=True)

    def _validate(self, step: int, writer) -> dict:
        """Validate the actor after ``step``; ``writer``: log the metrics as a row of their own."""
        metrics = validate_actor(self.validation, self.state.models)
        if dist.get_rank() == 0:
            self.run.progress.write(summary_line(step, metrics, self.validation.n))
        if writer is not None:
            writer.log(step, metrics, check_required=False)
        return metrics


class StepJob:
    """What a step uses besides the state: the tokenizer, the reward manager, the data sources, and
    for multi-turn rollouts the agent (:class:`hyflow.agent.agent.MultiTurnAgent`; None otherwise)."""

    def __init__(self, tokenizer, reward, sources, dataset_size: int = 0, agent=None, refill: bool = True) -> None:
        self.tokenizer, self.reward, self.sources = tokenizer, reward, list(sources)
        self.dataset_size = dataset_size
        self.agent = agent
        # DAPO dynamic sampling refills the step's batch here; False where the generation pool already
        # filtered its groups (trainer.mode=async: hyflow.jobs.async_filter)
        self.refill = refill

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id or 0


def rl_step(cfg: RLJobConfig, state: RLState, records, job: StepJob, timers) -> tuple[dict, dict]:
    """One RL step on this rank's shard of ``records`` (the step's prompts, the same list on every
    rank); returns the step's metrics (identical on every rank) and this rank's tensors."""
    models, step = state.models, state.step + 1
    groups, n = models.groups, cfg.rollout.n
    dp_group, device = groups.pgs.dp, groups.device
    first, stop = models.rollouts.shard(len(records))
    mine = records[first:stop]
    stats = BatchStats(device)
    # 1-2. generate this shard's samples in the generation layout, then score them
    seed = sampling_seed(cfg.trainer.seed, step)
    rnd = generate_round(cfg, state, job, mine, first, seed, timers)
    dynamic = cfg.algorithm.dynamic_sampling
    refill = {}
    if dynamic.enable and job.refill:  # 2b. DAPO: drop groups with equal rewards, refill from the next prompts
        def next_round(r: int, needed: bool):
            shard = state.loader.next_batch()[first:stop]  # every rank draws: the loader stays in step
            return generate_round(cfg, state, job, shard, first, seed + 7_919 * r, timers) if needed else None

        rnd, refill = collect_groups(rnd, next_round, share=len(mine), first=first, max_rounds=dynamic.max_rounds,
                                     dp_group=dp_group, device=device)
    scored, scores, greedy_scores = rnd.scored, rnd.scores, rnd.greedy_scores
    batch = _rollout_batch(rnd.samples, job.pad_id)
    lengths = batch.row_lengths()
    if greedy_scores is not None:
        stats.distribution("critic/greedy_score", greedy_scores[::n])
    # 3. old / reference log-probs and values, forward-only over this rank's rows
    columns = {"tokens": batch.tokens, "response_mask": batch.response_mask}
    policy_columns = dict(columns, **routing_columns(cfg, batch))  # the actor's forwards: routing replay
    scoring = batching_for(cfg, "reference", groups, job.pad_id).cut(policy_columns, lengths)
    shape = tuple(batch.tokens.shape)
    vocab, tp_group, temp = models.sample_vocab, groups.pgs.tp, cfg.rollout.temperature
    scorer = logprob_scorer(vocab, tp_group, temp, cfg.actor.fused_output_layer)
    with timers.phase("old_log_prob"):
        if cfg.actor.old_logprobs == "rollout":  # the weights that sampled are the ones about to be updated
            old_logp = batch.rollout_logprobs
        else:
            reset_mismatch(models.actor.chunks)  # counted over this forward only
            old_logp = forward_score(models.actor.chunks, scoring, scorer, groups, shape)
            # the sampler's log-probs vs the training layout's, same weights (docs/algorithms.md)
            stats.row_totals("mismatch", mismatch_row_stats(old_logp, batch.rollout_logprobs, batch.response_mask),
                             mismatch_metrics)
            if batch.routing is not None:  # tokens x layers the trainer's routers send elsewhere
                stats.mean("rollout/routing_mismatch", *(torch.tensor(c, dtype=torch.float64, device=device)
                                                         for c in mismatch_counts(models.actor.chunks, groups)))
    ref_logp = None
    if models.reference is not None:
        with timers.phase("ref"):  # the reference routes with its own router weights
            ref_logp = forward_score([models.reference], [_without_routing(mb) for mb in scoring], scorer, groups,
                                     shape)
    values = None
    if models.critic is not None:
        with timers.phase("values"):
            values = models.critic.values(columns, lengths, shape)
    # 4. advantages (batch-wide statistics: sums over the DP group)
    with timers.phase("adv"):
        adv = compute_advantages(cfg.algorithm, scores, batch.group_ids, batch.response_mask, old_logp, ref_logp,
                                 values, state.kl_ctrl.value, greedy_scores=greedy_scores,
                                 reduce=_dp_sum(dp_group))
    # 5. updates (rollout correction: importance weights and a mask for what the trainer would not sample)
    train = dict(columns, old_logp=old_logp, advantages=adv.advantages)
    if cfg.rollout.routing_replay:
        train["routing"] = batch.routing
    correction = cfg.actor.rollout_correction
    if correction.mode != "off":
        corr = rollout_correction(old_logp, batch.rollout_logprobs, batch.response_mask, correction.mode,
                                  correction.cap, correction.low, correction.high)
        train.update(response_mask=corr.mask, is_weights=corr.weights)
        stats.row_totals("rollout_corr", corr.stats, rollout_correction_metrics)
    if ref_logp is not None and cfg.actor.use_kl_loss:
        train["ref_logp"] = ref_logp
    common = dict(seed=cfg.trainer.seed, step=step, row_offset=first * n, agg_mode=cfg.actor.loss_agg_mode,
                  norm_length=float(cfg.loss_norm_length))
    with timers.phase("update_actor"):
        policy_loss = PolicyLoss(cfg.actor, vocab, tp_group, temp, cfg.actor.fused_output_layer)
        actor = update_model(models.actor, groups, train, lengths, policy_loss,
                             batching=batching_for(cfg, "actor", groups, job.pad_id),
                             mini_batch_size=cfg.actor.mini_batch_size,
                             epochs=cfg.actor.ppo_epochs, balance=cfg.actor.balance_batch, **common)
        train.pop("routing", None)
    critic = None
    if models.critic is not None:
        with timers.phase("update_critic"):
            critic_train = dict(columns, old_values=values, returns=adv.returns)
            critic = models.critic.update(critic_train, lengths, **common)
    # 6. the KL controller and the step's metrics over the whole batch
    if cfg.algorithm.use_kl_in_reward:  # the controller's horizon counts responses
        state.kl_ctrl.update(adv.kl, len(records) * n)
    out = _metrics(cfg, stats, job, batch, scored, scores, adv, values, rnd.samples, actor, critic, models, timers)
    if cfg.algorithm.use_kl_in_reward:  # as verl: the penalty's metrics only when it is applied
        out.update({"actor/reward_kl_penalty": adv.kl, "actor/reward_kl_penalty_coeff": state.kl_ctrl.value})
    out.update(refill)
    data = dict(train, ref_logp=ref_logp, scores=scores, values=values, returns=adv.returns,
                greedy_scores=greedy_scores, rows=torch.arange(first * n, stop * n, device=device))
    return out, data


def routing_columns(cfg: RLJobConfig, batch: RolloutBatch) -> dict:
    """The rollout's recorded experts as a column of the actor's forwards: ``routing`` (replayed,
    ``rollout.routing_replay``) or ``recorded_routing`` (only compared, ``rollout.record_routing``)."""
    if batch.routing is None:
        return {}
    return {"routing" if cfg.rollout.routing_replay else "recorded_routing": batch.routing}


def _without_routing(micro_batch: dict) -> dict:
    return {k: v for k, v in micro_batch.items() if k not in ("routing", "recorded_routing")}


def generate_round(cfg: RLJobConfig, state: RLState, job: "StepJob", shard, first: int, seed: int,
                   timers) -> Round:
    """Steps 1-2 of a step for this rank's ``shard`` of prompts (global indices from ``first``):
    the weights to generation, generate (``rollout.n`` samples; ReMax adds its greedy baseline),
    re-score them there in exact mode, the weights back to training, then the rewards. The roles'
    declared capabilities say where exact mode re-scores (:mod:`hyflow.roles`)."""
    models = state.models
    weights, rollouts = models.weights, models.rollouts
    device = models.groups.device
    stale = _stale_weights(cfg, state)
    exact = cfg.rollout.exact_logprobs  # report the training forward's log-probs (hyflow.rl.exact_logprobs)
    scoring = batching_for(cfg, "reference", models.groups, job.pad_id)
    with timers.phase("reshard"):  # the whole train -> generate transition, the backend's weight load too
        weights.to_generation()
        if stale is not None:  # rollout.force_staleness: sample with older weights (tests, benchmarks)
            stale.swap_in(weights)
        rollouts.prepare_for_generation()
    with timers.phase("gen"):
        prompts = [r.prompt_ids for r in shard]
        if job.agent is not None:  # multi-turn trajectories: assistant turns and observations (hyflow.agent)
            samples = rollouts.generate_trajectories(job.agent, shard, cfg.rollout.n, seed=seed, request_offset=first)
        else:
            samples = rollouts.generate(prompts, cfg.rollout.n, seed=seed, request_offset=first).samples
        # ReMax: one greedy response per prompt, a baseline only (scored, never trained on)
        greedy = rollouts.generate(prompts, 1, seed=seed, request_offset=first, greedy=True) \
            if cfg.algorithm.adv_estimator == "remax" else None
        if exact and rollouts.capabilities.exact_rescore:
            samples = _with_logprobs(samples, job.pad_id, lambda batch: rollouts.rescore(
                batch, scoring, temperature=cfg.rollout.temperature, fused=cfg.actor.fused_output_layer,
                train_mode=models.actor.chunks[0].training))
            exact = False
    with timers.phase("reshard"):
        rollouts.finish_generation()
        if stale is not None:
            stale.swap_out(weights)
        weights.to_training()
    if exact:  # sampled with the current weights: the training layout re-scores them exactly
        with timers.phase("gen"):
            samples = _with_logprobs(samples, job.pad_id, lambda batch: rescore_in_training_layout(
                models.actor.chunks, models.groups, batch, scoring, models.sample_vocab, cfg.rollout.temperature,
                fused=cfg.actor.fused_output_layer))
    with timers.phase("reward"):
        scored = score_samples(job, shard, first, samples)
        scores = shaped_scores(cfg, scored, samples, device)
        greedy_scores = None
        if greedy is not None:
            baseline = torch.tensor(score_samples(job, shard, first, greedy.samples).scores, dtype=torch.float32,
                                    device=device)
            greedy_scores = baseline.repeat_interleave(cfg.rollout.n)  # rows are (prompt, sample) ordered
    return Round(samples, scored, scores, cfg.rollout.n, greedy_scores)


def shaped_scores(cfg: RLJobConfig, scored, samples: SampleTensors, device: torch.device) -> torch.Tensor:
    """``[rows]`` float32: the reward the advantages use, ``scored``'s scores plus DAPO's soft overlong
    punishment when ``algorithm.overlong_buffer`` is on (also the score the async group filter reads:
    :mod:`hyflow.jobs.async_filter`)."""
    scores = torch.tensor(scored.scores, dtype=torch.float32, device=device)
    overlong = cfg.algorithm.overlong_buffer
    if overlong.enable:  # DAPO's soft overlong punishment, a reward term
        scores = scores + overlong_penalty(samples.column("response_len"), cfg.rollout.max_new_tokens,
                                           overlong.length, overlong.penalty_factor)
    return scores


def _with_logprobs(samples: SampleTensors, pad_id: int, rescore) -> SampleTensors:
    """``samples`` with the response log-probs ``rescore(batch)`` gives ([B, S], as the batch; 0 on
    a multi-turn trajectory's observation tokens, which are not scored)."""
    batch = _rollout_batch(samples, pad_id)
    return samples.replace_logprobs(rescore(batch)[batch.response_positions()])


def _stale_weights(cfg: RLJobConfig, state: RLState):
    if not cfg.rollout.force_staleness:
        return None
    if state.stale_weights is None:
        state.stale_weights = StaleWeights(cfg.rollout.force_staleness)
    return state.stale_weights


def _rollout_batch(samples: SampleTensors, pad_id: int) -> RolloutBatch:
    return build_rollout_batch(samples.tokens, samples.logprobs, samples.column("prompt_len"),
                               samples.column("response_len"), samples.column("request"), samples.column("sample"),
                               samples.column("finish") == 2, pad_id=pad_id, flat_mask=samples.mask,
                               flat_routing=samples.routing)


def score_samples(job: StepJob, records, first: int, samples: SampleTensors):
    """Rewards of this rank's generated ``samples`` to its ``records`` (global indices from
    ``first``), in sample order; a reward model reads their ``prompt + response`` token ids.
    Multi-turn trajectories are scored by the agent (their final turn, or the environment's rewards)."""
    if job.agent is not None:
        return job.agent.score(job.reward, records, first, samples)[1]
    outputs = samples.to_outputs()
    texts = job.tokenizer.batch_decode([s.token_ids for s in outputs])
    return job.reward.score_records([records[s.request_index - first] for s in outputs], texts,
                                    sequences=[list(s.prompt_ids) + list(s.token_ids) for s in outputs])


def _dp_sum(dp_group):
    if dp_group.size() == 1:
        return None

    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, group=dp_group)
        return t

    return reduce


def _metrics(cfg, stats: BatchStats, job: StepJob, batch: RolloutBatch, scored, scores, adv, values,
             samples: SampleTensors, actor, critic, models: RLModels, timers) -> dict:
    """The step's metrics (verl's names), identical on every rank: three all-reduces over DP."""
    groups = models.groups
    dp_group = groups.pgs.dp
    mask = batch.response_mask
    extras = {k: scored.extras.get(k, []) for k in all_gather_strings(scored.extras, dp_group, groups.device)}
    score_metrics(stats, scores, scored.data_sources, job.sources, extras)
    stats.distribution("critic/rewards", (adv.token_rewards * mask).sum(-1))
    stats.distribution("critic/advantages", adv.advantages, mask)
    if adv.returns is not None:
        stats.distribution("critic/returns", adv.returns, mask)
    if values is not None:
        stats.distribution("critic/values", values, mask)
    stats.distribution("response_length", batch.response_lengths.double())
    stats.mean("response_length/clip_ratio", batch.truncated.double().sum(), float(batch.size))
    stats.distribution("prompt_length", batch.prompt_lengths.double())
    stats.mean("prompt_length/clip_ratio", (samples.column("truncated") > 0).double().sum(), float(batch.size))
    stats.add("reward/timeouts", float(scored.timeouts))  # reward calls stopped at reward.timeout_s
    stats.add("perf/total_num_tokens", batch.lengths.double().sum())
    sampled = batch.response_lengths.double().sum() if samples.stats is None else \
        samples.stats[:, STATS.index("generated_tokens")].sum()  # a trajectory's observations were not sampled
    stats.add("rollout/generated_tokens", sampled)
    stats.add("rollout/gen_seconds_sum", timers.step_times.get("gen", 0.0))
    processed = actor.processed_tokens + (critic.processed_tokens if critic else 0)
    real = actor.real_tokens + (critic.real_tokens if critic else 0)
    stats.mean("perf/padding_ratio", processed - real, processed)
    stats.mean("perf/rows_scored_per_rank", float(batch.size), 1.0)
    if samples.stats is not None:  # multi-turn: turns, tool calls, end reasons, ... (hyflow.agent.metrics)
        trajectory_metrics(stats, samples, cfg.rollout.n)
    out = stats.reduce(dp_group)
    gen_seconds = out.pop("rollout/gen_seconds_sum") / dp_group.size()
    out["rollout/tokens_per_s"] = out["rollout/generated_tokens"] / max(gen_seconds, 1e-9)
    for prefix, update in (("actor", actor), ("critic", critic)):
        if update is None:
            continue
        means = update.means()
        out.update({k: v for k, v in means.items() if k.startswith(prefix + "/")})
        if prefix == "actor":  # a mixture-of-experts actor's router losses
            out.update({k: v for k, v in means.items() if k.startswith("moe/")})
        out[f"{prefix}/grad_norm"] = means.get("grad_norm", float("nan"))
        out[f"{prefix}/lr"] = means.get("lr", 0.0)
    out["reshard/bytes_received"] = models.weights.stats.bytes_received
    out["reshard/seconds"] = models.weights.stats.seconds
    return out


def sft_warmup(cfg: RLJobConfig, state: RLState, tokenizer, agent=None) -> None:
    """Supervised steps on the reference answers (``extra_info.answer``) before RL; each DP rank
    trains on its own prompts, the loss is the token mean over all of them. With multi-turn
    rollouts (``agent``) the targets are the rows' multi-turn demonstrations
    (``extra_info.demonstration``), the loss on their assistant turns only."""
    models = state.models
    groups, actor = models.groups, models.actor
    rank = dist.get_rank()
    # Megatron's scheduler reads each param group's max_lr/min_lr: point them at the SFT rate.
    lr = cfg.actor.sft_lr
    saved = [(g.get("max_lr"), g.get("min_lr")) for g in actor.optimizer.param_groups]
    for g in actor.optimizer.param_groups:
        g["max_lr"], g["min_lr"] = lr, lr
    sft_scheduler = OptimizerParamScheduler(
        actor.optimizer, init_lr=lr, max_lr=lr, min_lr=lr, lr_warmup_steps=0,
        lr_decay_steps=cfg.actor.sft_warmup_steps, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
        wd_incr_steps=cfg.actor.sft_warmup_steps, wd_incr_style="constant")
    for step in range(1, cfg.actor.sft_warmup_steps + 1):
        records = state.loader.next_batch()
        first, stop = models.rollouts.shard(len(records))
        rows = []
        for r in records[first:stop]:
            if agent is not None:
                rows.append(agent.demonstration(r))
                continue
            answer = reference_response_ids(r, tokenizer)
            rows.append((r.prompt_ids + answer, [0] * len(r.prompt_ids) + [1] * len(answer)))
        S = max(len(seq) for seq, _ in rows) + 1
        pad_id = tokenizer.pad_token_id or 0
        tokens = torch.full((len(rows), S), pad_id, dtype=torch.long, device=groups.device)
        loss_mask = torch.zeros(len(rows), S, device=groups.device)
        for i, (seq, mask) in enumerate(rows):
            tokens[i, :len(seq)] = torch.tensor(seq, dtype=torch.long, device=groups.device)
            loss_mask[i, :len(seq)] = torch.tensor(mask, dtype=torch.float32, device=groups.device)
        data = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": loss_mask[:, 1:]}
        lengths = [len(seq) for seq, _ in rows]
        micro = MicroBatching(cfg.actor.micro_batch_size, pad_multiple=pad_multiple(groups), pad_id=pad_id,
                              cp_group=groups.pgs.cp if groups.layout.cp > 1 else None).cut(data, lengths)
        token_mean_weights(micro, "loss_mask", data_group(groups))  # CP ranks hold shares of the masks
        stats = train_step(actor.chunks, actor.optimizer, sft_scheduler, micro, groups=groups, loss_fn=lm_loss)
        if rank == 0 and (step % 10 == 0 or step == cfg.actor.sft_warmup_steps):
            print(f"[hyflow] sft warm-up {step}/{cfg.actor.sft_warmup_steps} loss {stats['lm_loss']:.4f}", flush=True)
    for g, (max_lr, min_lr) in zip(actor.optimizer.param_groups, saved):
        g["max_lr"], g["min_lr"] = max_lr, min_lr
    actor.scheduler.step(0)  # back to the RL learning rate
    models.reset_reference()


# --------------------------------------------------------------------------- checkpoints


def frozen_models(cfg: RLJobConfig, models: RLModels) -> Optional[dict]:
    """The reference, when the config cannot rebuild it (it is the actor after the SFT warm-up)."""
    if models.reference is not None and cfg.actor.sft_warmup_steps:
        return {"reference": models.reference}
    return None


def cpu_max_over_ranks(metrics: dict, device: torch.device) -> dict[str, float]:
    """``cpu_s_max/<phase>``: the largest ``cpu_s/<phase>`` of any rank (one all-reduce of a few
    scalars). Rank 0's CPU seconds miss the busiest pipeline stage; the slowest stage's work is
    what sets a pipelined phase's pace (the stage balance of ``actor.layout.stage_layers``)."""
    values = torch.tensor([float(metrics.get(f"cpu_s/{p}", 0.0)) for p in PHASE_KEYS], dtype=torch.float64,
                          device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return {f"cpu_s_max/{p}": float(v) for p, v in zip(PHASE_KEYS, values.tolist())}
