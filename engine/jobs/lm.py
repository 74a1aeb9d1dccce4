"""The language-model job (``job: lm``, ``configs/lm_tiny.yaml``): the training stack alone.

A Llama-style model trained with the real Megatron-Core stack (GPTModel, the
pipeline schedule, DDP, Megatron's optimizer) in whatever layout the config asks
for, on a synthetic next-token task generated locally (arithmetic progressions
modulo the vocabulary, learnable by a small model in a minute on CPU): the
smallest check of the training stack. Checkpoints, resume, the NaN/inf guard and
the metrics are every job's (:mod:`hyflow.jobs.loop`).

Read top to bottom: config -> groups -> model -> optimizer -> loop.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hyflow.checkpoint.checkpointer import Checkpointer, TrainedModel
from hyflow.config import format_config
from hyflow.jobs.lm_config import LMJobConfig
from hyflow.jobs.loop import open_run, run_job
from hyflow.models.builder import build_model_chunks, recompute_overrides
from hyflow.models.context_parallel import split_for_cp
from hyflow.models.weights import random_full_state_dict, load_full_state_dict
from hyflow.parallel.groups import init_training_groups
from hyflow.monitor.metrics import read_metrics
from hyflow.training.optimizer import build_optimizer, wrap_ddp
from hyflow.training.step import position_ids, train_step
from hyflow.training.supervisor import StepSupervisor


def arith_batch(vocab: int, batch: int, seq: int, max_step: int, gen: torch.Generator,
                device: torch.device = torch.device("cpu")) -> dict:
    """Rows x_t = (a + t*d) mod vocab; the model must infer d from the prefix. Drawn from the
    host generator ``gen`` (the same stream on every rank), then moved to ``device``."""
    host = torch.device("cpu")
    a = torch.randint(0, vocab, (batch, 1), generator=gen, device=host)
    d = torch.randint(1, max_step + 1, (batch, 1), generator=gen, device=host)
    rows = ((a + d * torch.arange(seq + 1, device=host)) % vocab).to(device)
    tokens, labels = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    mask = torch.ones(batch, seq, device=device)
    mask[:, :2] = 0  # the first two targets are not determined by the prefix
    return dict(tokens=tokens, labels=labels, loss_mask=mask, position_ids=position_ids(tokens))


def run(cfg: LMJobConfig) -> list[dict]:
    """Train; rank 0 writes metrics.jsonl, TensorBoard and the resolved config. Returns the metrics."""
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = cfg.actor.layout.with_dp_for(world)
    groups = init_training_groups(layout, seed=cfg.trainer.seed)
    models = build_model_chunks(cfg.model, groups, dtype=cfg.actor.dtype, spec=cfg.actor.spec,
                                config_overrides=recompute_overrides(cfg.actor.recompute))
    initial = random_full_state_dict(cfg.model, cfg.trainer.seed)
    for vp_stage, model in enumerate(models):
        load_full_state_dict(model, initial, cfg.model, groups, vp_stage=vp_stage if layout.vpp else None)
    chunks = wrap_ddp(models, groups, cfg.actor.optim.distributed_optimizer)
    optimizer, scheduler = build_optimizer(chunks, cfg.actor.optim, cfg.trainer.total_steps,
                                           models[0].config.params_dtype)
    # SIGTERM / SIGUSR1 flags and the NaN/inf guard
    supervisor = StepSupervisor(cfg.trainer.max_bad_steps, [optimizer], device=groups.device).install()
    ckpt = Checkpointer(cfg.trainer.output_dir, groups, cfg.model, cfg.trainer.keep_last)
    steps = LMSteps(cfg, groups, TrainedModel(chunks, optimizer, scheduler), supervisor, ckpt)
    run = open_run(cfg, ckpt, supervisor, steps.resume, lead=rank == 0, required_keys=KEYS,
                   progress_keys=(("loss", "loss"), ("grad_norm", "gnorm")))
    if rank == 0:
        print(f"[hyflow] layout {layout.describe()}", flush=True)
    return run_job(run, steps)


#: what every metrics row holds
KEYS = ("step", "loss", "grad_norm", "lr", "tokens_per_s", "time/step")


class LMSteps:
    """The LM job's steps as :func:`~hyflow.jobs.loop.run_job` calls them. Step ``t``'s batch is drawn
    from a generator seeded by ``(trainer.seed, t)``, so a resumed run draws the data the
    uninterrupted one would without saving a data position."""

    def __init__(self, cfg: LMJobConfig, groups, model: TrainedModel, supervisor: StepSupervisor,
                 ckpt: Checkpointer) -> None:
        self.cfg, self.groups, self.model, self.supervisor, self.ckpt = cfg, groups, model, supervisor, ckpt
        self.t0 = 0.0

    def resume(self) -> int:
        """Load the checkpoint ``trainer.resume`` names (the newest that verifies, for ``auto``); its
        step, 0 for a fresh run."""
        path = self.ckpt.find_resume(self.cfg.trainer.resume)
        if path is None:
            return 0
        state = self.ckpt.load(path, {"model": self.model})
        self.supervisor.load_state_dict(state["job"]["supervisor"])
        return int(state["step"])

    def step(self, step: int) -> dict:
        cfg, groups, d = self.cfg, self.groups, self.cfg.data
        layout = groups.layout
        self.t0 = time.perf_counter()
        n_micro = d.global_batch_size // (d.micro_batch_size * layout.dp)
        gen = torch.Generator().manual_seed(cfg.trainer.seed * 1_000_003 + step)  # the same on every rank
        global_mbs = [arith_batch(cfg.model.vocab_size, d.micro_batch_size, d.seq_length,
                                  d.max_step_size, gen, groups.device) for _ in range(n_micro * layout.dp)]
        mine = global_mbs[groups.dp_rank * n_micro:(groups.dp_rank + 1) * n_micro]
        if layout.cp > 1:  # each CP rank trains on its share of every sequence
            mine = [split_for_cp(mb, groups.pgs.cp) for mb in mine]
        stats = train_step(self.model.chunks, self.model.optimizer, self.model.scheduler, mine, groups=groups)
        # loss: the token mean over every data-parallel (and CP) rank's micro-batches
        return {"loss": stats["lm_loss"], "grad_norm": stats["grad_norm"], "lr": stats["lr"]}

    def report(self, step: int, metrics: dict, outcome) -> bool:
        d = self.cfg.data
        metrics["time/step"] = time.perf_counter() - self.t0
        metrics["tokens_per_s"] = d.global_batch_size * d.seq_length / metrics["time/step"]
        return True

    def save(self, step: int) -> str:
        return self.ckpt.save(step, {"model": self.model}, {"supervisor": self.supervisor.state_dict()},
                              config_text=format_config(self.cfg))

    def summary(self, metrics_path: str) -> None:
        rows = [row for row in read_metrics(metrics_path) if "loss" in row]
        if rows:
            print(f"[hyflow] done: loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}; metrics in {metrics_path}",
                  flush=True)
