"""Measure a rank's memory for an ``lm`` job on CPU and compare it with the planner's estimate.

Two measurements around model + optimizer build and train steps:

* **tensor bytes** (:class:`TensorMemoryTracker`): a ``TorchDispatchMode`` that records every
  storage an op allocates (outputs that alias an input - views, in-place ops - are not new)
  and drops it when the storage is freed; its peak is the CPU analogue of
  ``torch.cuda.max_memory_allocated`` and counts exactly what the estimator counts;
* **RSS growth**: resident set size above the level after imports and process-group init
  (sampled every millisecond, and the kernel's high-water mark). It adds what the estimator
  does not count: the full-size random initial state dict the ``lm`` job builds on every rank,
  allocator caching, autograd / Python objects, thread stacks.

:func:`measure_lm` builds an ``lm`` job step by step (build and step peaks apart, the estimate
of the rank's own pipeline stage); :func:`measure_rl_startup` builds an ``rl`` job's models as the
job does and compares with the plan's start-up phase (:func:`device_buffer_accounting` counts the
hybrid engine's generation buffer as the CUDA path holds it); :func:`measure_job` runs any job's ``run(cfg)`` whole and
compares with the plan's worst phase. Run the latter as ``torchrun --nproc-per-node N -m
hyflow.plan.measure CONFIG [overrides]``: every rank prints one JSON line.
"""

from __future__ import annotations

import contextlib
import gc
import json
import resource
import sys
import threading
import time
import weakref
from typing import Any, Iterator, Optional, Sequence

import psutil
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hyflow.data.tasks import load_data_tokenizer
from hyflow.hybrid.generation_buffer import GenerationBuffer
from hyflow.jobs.lm import arith_batch
from hyflow.jobs.registry import JOBS, load_job_config, resolve
from hyflow.models.builder import build_model_chunks, recompute_overrides
from hyflow.models.weights import load_full_state_dict, random_full_state_dict
from hyflow.parallel.distributed import init_distributed, shutdown
from hyflow.parallel.groups import init_training_groups
from hyflow.plan import memory_estimate as mem
from hyflow.plan.core import PlanOptions, build_plan
from hyflow.rl.models import build_rl_models
from hyflow.training.optimizer import build_optimizer, wrap_ddp
from hyflow.training.step import train_step


class TensorMemoryTracker(TorchDispatchMode):
    """Live and peak bytes of the tensor storages created while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = self.current

    def hold(self, nbytes: int) -> None:
        """Count ``nbytes`` held (negative: given back) outside tensor ops."""
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def _release(self, key: int) -> None:
        nbytes = self.live.pop(key, None)
        if nbytes is not None:
            self.current -= nbytes

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        if t.is_meta:  # shapes without storage (a model built on "meta")
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in inputs or key in self.live or storage.nbytes() == 0:
            return
        self.live[key] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._release, key)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return out


@contextlib.contextmanager
def device_buffer_accounting(tracker: TensorMemoryTracker) -> Iterator[None]:
    """Count the hybrid engine's generation buffer as the CUDA path holds it: allocator memory
    from ``acquire`` to ``release`` (on CPU it is a mapping whose pages arrive with the first
    write, which no tensor op shows)."""
    acquire, release = GenerationBuffer.acquire, GenerationBuffer.release

    def counted_acquire(self):
        if not self.held:
            tracker.hold(self.nbytes)
        return acquire(self)

    def counted_release(self):
        if self.held:
            tracker.hold(-self.nbytes)
        return release(self)

    GenerationBuffer.acquire, GenerationBuffer.release = counted_acquire, counted_release
    try:
        yield
    finally:
        GenerationBuffer.acquire, GenerationBuffer.release = acquire, release


class RssSampler:
    """Peak resident set size, sampled in a background thread (and ``ru_maxrss``)."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self._proc = psutil.Process()
        self.interval_s = interval_s
        self.baseline = self._proc.memory_info().rss
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self.interval_s)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.peak = max(self.peak, self._proc.memory_info().rss, maxrss)

    @property
    def growth(self) -> int:
        return self.peak - self.baseline


def measure_lm(config: str, overrides: Sequence[str] = (), steps: int = 2) -> dict[str, Any]:
    """Build the ``lm`` job's model and optimizer and run ``steps`` train steps on this rank
    (inside an initialised process group); returns measurements and the plan's estimate."""
    world = dist.get_world_size()
    cfg = load_job_config(config, list(overrides) + [f"trainer.nproc={world}"])
    layout = cfg.actor.layout.with_dp_for(world)
    groups = init_training_groups(layout, seed=cfg.trainer.seed)
    d = cfg.data
    n_micro = d.global_batch_size // (d.micro_batch_size * layout.dp)
    gen = torch.Generator().manual_seed(cfg.trainer.seed)
    batches = [[arith_batch(cfg.model.vocab_size, d.micro_batch_size, d.seq_length,
                            d.max_step_size, gen) for _ in range(n_micro)] for _ in range(steps)]
    gc.collect()
    tracker = TensorMemoryTracker()
    with RssSampler() as rss, tracker:
        models = build_model_chunks(cfg.model, groups, dtype=cfg.actor.dtype, spec=cfg.actor.spec,
                                    config_overrides=recompute_overrides(cfg.actor.recompute))
        initial = random_full_state_dict(cfg.model, cfg.trainer.seed)
        for vp, model in enumerate(models):
            load_full_state_dict(model, initial, cfg.model, groups, vp_stage=vp if layout.vpp else None)
        del initial
        chunks = wrap_ddp(models, groups, cfg.actor.optim.distributed_optimizer)
        optimizer, scheduler = build_optimizer(chunks, cfg.actor.optim, cfg.trainer.total_steps,
                                               models[0].config.params_dtype)
        built = tracker.current
        build_peak = tracker.peak
        tracker.reset_peak()
        step_peak, transient = 0, 0
        for mbs in batches:
            before = tracker.current  # Adam's moments appear during the first step
            tracker.reset_peak()
            train_step(chunks, optimizer, scheduler, mbs, groups=groups)
            step_peak = max(step_peak, tracker.peak)
            transient = tracker.peak - before  # the last step's: activations and temporaries only
    est = mem.training_estimates(
        cfg.model, layout, dtype=cfg.actor.dtype, seq=d.seq_length,
        micro_batch_size=d.micro_batch_size, n_micro=n_micro, attention="local",
        recompute=cfg.actor.recompute, distributed_optimizer=cfg.actor.optim.distributed_optimizer)
    mine = est[groups.pp_rank]
    return {
        "rank": dist.get_rank(), "stage": groups.pp_rank, "layout": layout.describe(),
        "estimate_bytes": mine.total, "estimate_items": {i.name: i.bytes for i in mine.items},
        "estimate_static_bytes": mine.get("weights") + mine.get("grads") + mine.get("optimizer"),
        "tensor_peak_bytes": step_peak, "tensor_after_build_bytes": built,
        "tensor_step_transient_bytes": transient,
        "estimate_transient_bytes": sum(mine.get(k) for k in ("activations", "logits", "backward transient")),
        "tensor_build_peak_bytes": build_peak, "rss_growth_bytes": rss.growth,
        "rss_baseline_bytes": rss.baseline,
    }


def measure_rl_startup(config: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Build an ``rl`` job's models as the job does (:func:`hyflow.rl.models.build_rl_models`:
    actor, DDP, optimizer, hybrid engine, reference, critic) on this rank under the tensor tracker;
    returns the peak with the plan's CPU start-up estimate (the tracker sees the CPU reshard's
    shared-memory staging too: ``torch.from_file`` segments)."""
    world = dist.get_world_size()
    overrides = list(overrides) + [f"trainer.nproc={world}"]
    cfg = load_job_config(config, overrides)
    plan = build_plan(config, overrides, PlanOptions(world_size=world, device="cpu", megatron_ranks=()))
    tokenizer = load_data_tokenizer(cfg.data)
    gc.collect()
    tracker = TensorMemoryTracker()
    with tracker:
        models = build_rl_models(cfg, tokenizer)
    startup = [e for e in plan.phases if e.phase.startswith("start-up")]
    est = max(startup, key=lambda e: e.total) if startup else None
    del models
    return {"rank": dist.get_rank(), "stage": None if est is None else est.stage,
            "estimate_phase": None if est is None else est.phase,
            "estimate_bytes": None if est is None else est.total,
            "estimate_items": {} if est is None else {i.name: i.bytes for i in est.items},
            "tensor_peak_bytes": tracker.peak, "tensor_after_bytes": tracker.current, "errors": plan.errors}


def measure_job(config: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Run a whole job (its ``run(cfg)``) on this rank under both measurements; returns them
    with the plan's CPU estimate (its worst phase)."""
    world = dist.get_world_size()
    overrides = list(overrides) + [f"trainer.nproc={world}"]
    cfg = load_job_config(config, overrides)
    plan = build_plan(config, overrides, PlanOptions(world_size=world, device="cpu", megatron_ranks=()))
    run = resolve(JOBS[cfg.job][1])
    gc.collect()
    tracker = TensorMemoryTracker()
    with RssSampler() as rss, tracker:
        run(cfg)
    peak = plan.peak
    return {"rank": dist.get_rank(), "job": cfg.job, "estimate_bytes": peak.total if peak else None,
            "estimate_phase": peak.phase if peak else None,
            "estimate_phases": {e.phase: e.total for e in plan.phases}, "errors": plan.errors,
            "tensor_peak_bytes": tracker.peak, "rss_growth_bytes": rss.growth}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point under torchrun: ``-m hyflow.plan.measure CONFIG [overrides]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: torchrun --nproc-per-node N -m hyflow.plan.measure CONFIG [overrides]",
              file=sys.stderr)
        return 2
    init_distributed()
    try:
        print(json.dumps(measure_job(argv[0], argv[1:])), flush=True)
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
