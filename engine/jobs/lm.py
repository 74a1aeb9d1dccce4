"""A language-model training job: the tiny Megatron run behind ``make train``.

Until the GRPO trainer lands this is the README's main job: a Llama-style
model trained with the real Megatron-Core stack (GPTModel, the pipeline
schedule, DDP, Megatron's optimizer) in whatever layout the config asks for, on
a synthetic next-token task generated locally (arithmetic progressions modulo
the vocabulary, learnable by a small model in a minute on CPU).

Read top to bottom: config -> groups -> model -> optimizer -> loop.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from hyflow.jobs.run_config import record_config
from hyflow.jobs.lm_config import LMJobConfig
from hyflow.models.builder import build_model_chunks, recompute_overrides
from hyflow.models.context_parallel import split_for_cp
from hyflow.models.weights import random_full_state_dict, load_full_state_dict
from hyflow.parallel.groups import init_training_groups
from hyflow.training.optimizer import build_optimizer, wrap_ddp
from hyflow.training.step import position_ids, train_step


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
    """Train; rank 0 writes ``metrics.jsonl`` and the resolved config. Returns the metrics."""
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = cfg.actor.layout.with_dp_for(world)
    groups = init_training_groups(layout, seed=cfg.trainer.seed)
    out_dir = cfg.trainer.output_dir
    if rank == 0:
        record_config(cfg, 0)
        print(f"[hyflow] layout {layout.describe()}", flush=True)

    models = build_model_chunks(cfg.model, groups, dtype=cfg.actor.dtype, spec=cfg.actor.spec,
                                config_overrides=recompute_overrides(cfg.actor.recompute))
    initial = random_full_state_dict(cfg.model, cfg.trainer.seed)
    for vp_stage, model in enumerate(models):
        load_full_state_dict(model, initial, cfg.model, groups, vp_stage=vp_stage if layout.vpp else None)
    chunks = wrap_ddp(models, groups, cfg.actor.optim.distributed_optimizer)
    optimizer, scheduler = build_optimizer(chunks, cfg.actor.optim, cfg.trainer.total_steps,
                                           models[0].config.params_dtype)

    d = cfg.data
    n_micro = d.global_batch_size // (d.micro_batch_size * layout.dp)
    gen = torch.Generator().manual_seed(cfg.trainer.seed)  # same stream on every rank
    metrics: list[dict] = []
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    start = time.perf_counter()
    for step in range(1, cfg.trainer.total_steps + 1):
        t0 = time.perf_counter()
        global_mbs = [arith_batch(cfg.model.vocab_size, d.micro_batch_size, d.seq_length,
                                  d.max_step_size, gen, groups.device) for _ in range(n_micro * layout.dp)]
        mine = global_mbs[groups.dp_rank * n_micro:(groups.dp_rank + 1) * n_micro]
        if layout.cp > 1:  # each CP rank trains on its share of every sequence
            mine = [split_for_cp(mb, groups.pgs.cp) for mb in mine]
        stats = train_step(chunks, optimizer, scheduler, mine, groups=groups)
        loss = stats["lm_loss"]  # the token mean over every data-parallel (and CP) rank's micro-batches
        dt = time.perf_counter() - t0
        row = {"step": step, "loss": loss, "grad_norm": stats["grad_norm"], "lr": stats["lr"],
               "tokens_per_s": d.global_batch_size * d.seq_length / dt, "time/step": dt}
        metrics.append(row)
        if rank == 0:
            with open(metrics_path, "a" if step > 1 else "w") as f:
                f.write(json.dumps(row) + "\n")
            if step % cfg.trainer.log_every == 0 or step == cfg.trainer.total_steps:
                print(f"[hyflow] step {step:4d}/{cfg.trainer.total_steps}  loss {loss:.4f}  "
                      f"grad_norm {row['grad_norm']:.3f}  lr {row['lr']:.2e}  "
                      f"{row['tokens_per_s']:.0f} tok/s  elapsed {time.perf_counter() - start:.1f}s",
                      flush=True)
    if rank == 0:
        print(f"[hyflow] done: loss {metrics[0]['loss']:.4f} -> {metrics[-1]['loss']:.4f}; "
              f"metrics in {metrics_path}", flush=True)
    return metrics
