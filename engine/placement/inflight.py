"""Checkpoints of ``trainer.mode: one_step_off`` that keep the in-flight batch.

When the training pool saves after update ``t``, the generation pool holds batch ``t+1``
(sampled with ``w_{t-1}``, not yet sent). A resumed run must train step ``t+1`` on exactly that
batch, so the checkpoint is written by both pools at once:

* the training pool's lead says "save" in its per-step control message (:func:`control`: three
  int64 broadcast to the other pools' ranks; no pickling collective on the step path);
* the training ranks write the models, optimizers and the job's state as the ``sync`` job does
  (:class:`~hyflow.checkpoint.checkpointer.Checkpointer`);
* every generation rank joins the same save with *absent* models (Megatron's dist_checkpointing
  and the manifest run their collectives over the world) and writes its own
  ``inflight/rank_<rank>.pt``: the batch's rows as tensors, its step, the weight version that
  sampled it, and the rank's prompt-loader position, as plain data (``torch.load(weights_only=True)``
  reads it; nothing in it runs code). The manifest hashes it with the rest, and the ``COMPLETE``
  marker is written when both pools are done: a checkpoint holds both pools' state or does not count.

On resume both pools verify and load the checkpoint together; the generation ranks restore their
random streams (``rng/rank_<rank>.pt``) and loader position and send the saved batch as step
``t+1`` instead of generating it, then sample ``t+2`` with ``w_t`` as the straight run does. The
checkpoint loads only into the layout and placement it was written with.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from hyflow.checkpoint.checkpointer import Checkpointer, TrainedModel
from hyflow.checkpoint.errors import CheckpointError
from hyflow.checkpoint.trust import unpickling_detail
from hyflow.parallel import group_registry
from hyflow.rollout.dp import SampleTensors

INFLIGHT_DIR = "inflight"
INFLIGHT_FORMAT = "hyflow-inflight"
INFLIGHT_VERSION = 1
#: The models a checkpoint may hold, in the order of the control message's bits (the reference
#: is frozen: saved once per run, after an SFT warm-up).
MODEL_NAMES = ("actor", "critic", "reference")
FROZEN = ("reference",)

GO, SAVE = 1, 2  # control flags: another weight sync follows; a checkpoint of this step is written now


@dataclass(frozen=True)
class Control:
    """The training lead's message after each update."""

    go: bool
    save: bool = False
    step: int = 0
    models: tuple[str, ...] = ()  # the models a save writes (trained and frozen)


def control_group(placement):
    """The group :func:`control` broadcasts over: the training pool's first rank and every rank of
    the other pools (collective: every rank calls it, in the same order)."""
    train = placement.roles["actor"].pool
    return group_registry.group([train.start] + [r for r in range(placement.world) if r not in train],
                                purpose="control")


def control(msg: Control, placement, rank: int, device: torch.device, group) -> Control:
    """The training pool's first rank tells every rank of the other pools (generation, and a
    critic's pool of its own) ``msg``: one broadcast of three int64 over ``group``
    (:func:`control_group`; NCCL runs it as a tree, not one rank's point-to-point send to each of
    the world's ranks), entered by all its members at the same point of every step. Returns what
    this rank knows (the message, on every pool)."""
    train = placement.roles["actor"].pool
    if rank in train and rank != train.start:
        return msg
    mask = sum(1 << i for i, name in enumerate(MODEL_NAMES) if name in msg.models)
    t = torch.tensor([GO * msg.go + SAVE * msg.save, msg.step, mask], dtype=torch.long, device=device)
    dist.broadcast(t, src=train.start, group=group)
    flags, step, mask = (int(x) for x in t.tolist())
    return Control(go=bool(flags & GO), save=bool(flags & SAVE), step=step,
                   models=tuple(n for i, n in enumerate(MODEL_NAMES) if mask >> i & 1))


@dataclass
class InFlight:
    """A generation rank's state between two steps: the batch it will send next and its data position."""

    step: int  # the step the batch is for
    samples: Any  # SampleTensors, or None (the run's last step: nothing left to generate)
    version: int  # weight updates applied before it was sampled
    gen_seconds: float
    loader: dict  # the prompt loader's state_dict after drawing the batch's prompts


def inflight_file(path: str, rank: int) -> str:
    return os.path.join(path, INFLIGHT_DIR, f"rank_{rank:05d}.pt")


def write_inflight(path: str, rank: int, state: InFlight, pool: Any, layout: Any) -> None:
    """This generation rank's ``inflight/rank_<rank>.pt`` in checkpoint ``path``: tensors and plain data only."""
    data: dict[str, Any] = {
        "format": INFLIGHT_FORMAT, "version": INFLIGHT_VERSION, "step": int(state.step),
        "weight_version": int(state.version), "gen_seconds": float(state.gen_seconds),
        "loader": {str(k): v for k, v in state.loader.items()},
        "pool": [int(pool.start), int(pool.stop)], "layout": [int(layout.tp), int(layout.pp), int(layout.dp)],
        "has_batch": state.samples is not None}
    if state.samples is not None:
        s = state.samples
        data.update(meta=s.meta.detach().cpu(), tokens=s.tokens.detach().cpu(), logprobs=s.logprobs.detach().cpu())
        for name in ("mask", "stats"):  # multi-turn trajectories: the loss mask over observations, the counters
            if getattr(s, name) is not None:
                data[name] = getattr(s, name).detach().cpu()
    os.makedirs(os.path.join(path, INFLIGHT_DIR), exist_ok=True)
    torch.save(data, inflight_file(path, rank))


def read_inflight(path: str, rank: int, pool: Any, layout: Any, device: torch.device) -> InFlight:
    """The in-flight state this rank wrote into checkpoint ``path`` (read with ``weights_only=True``;
    a wrong structure, another placement or layout raises :class:`CheckpointError`)."""
    data = load_inflight_data(path, rank, pool, layout, INFLIGHT_FORMAT, INFLIGHT_VERSION)
    try:
        samples = None
        if data["has_batch"]:
            optional = {k: data[k].to(device) for k in ("mask", "stats") if k in data}
            samples = SampleTensors(meta=data["meta"].to(device), tokens=data["tokens"].to(device),
                                    logprobs=data["logprobs"].to(device), **optional)
        return InFlight(step=int(data["step"]), samples=samples, version=int(data["weight_version"]),
                        gen_seconds=float(data["gen_seconds"]), loader=dict(data["loader"]))
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{inflight_file(path, rank)} is not an in-flight batch file this hyflow reads "
                              f"({type(e).__name__}: {e})") from None


def load_inflight_data(path: str, rank: int, pool: Any, layout: Any, fmt: str, version: int) -> dict:
    """The plain data of this rank's in-flight file in checkpoint ``path`` (``fmt`` at most ``version``),
    checked to come from this placement and layout: one :class:`CheckpointError` naming the cause else."""
    source = inflight_file(path, rank)
    if not os.path.exists(source):
        raise CheckpointError(f"{source} is missing: checkpoint {path} was not written by this placement's "
                              f"generation rank {rank} (placement pools resume only with the placement and "
                              "trainer.mode they saved with)")
    try:
        data = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - UnpicklingError for anything but plain data
        raise CheckpointError(f"{source} holds Python objects other than tensors and plain data "
                              f"({unpickling_detail(e)}): refused, hyflow never runs code from a checkpoint") from None
    try:
        if data.get("format") != fmt or int(data.get("version", 0)) > version:
            raise ValueError(f"format {data.get('format')!r} version {data.get('version')} (this run reads "
                             f"{fmt!r} up to version {version}: resume with the trainer.mode it saved with)")
        here = ([pool.start, pool.stop], [layout.tp, layout.pp, layout.dp])
        if (list(data["pool"]), list(data["layout"])) != here:
            raise CheckpointError(
                f"checkpoint {path} was written by a generation pool on ranks {data['pool']} with (tp, pp, dp)="
                f"{tuple(data['layout'])}; this run's is on ranks {here[0]} with {tuple(here[1])}: resume "
                "with the placement it saved with")
        return data
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{source} is not an in-flight file this hyflow reads "
                              f"({type(e).__name__}: {e})") from None


def absent_models(names) -> tuple[dict[str, TrainedModel], dict[str, None]]:
    """Stand-ins for the trained and the frozen models this rank does not hold (it joins their
    saves and loads with nothing to write or read)."""
    return ({name: TrainedModel(chunks=[]) for name in names if name not in FROZEN},
            {name: None for name in names if name in FROZEN})


class GenerationCheckpoints:
    """The generation ranks' side of a one_step_off checkpoint (every call is collective with the
    training ranks' :class:`Checkpointer` calls at the same point of the run)."""

    def __init__(self, cfg, placement, groups, desc) -> None:
        self.placement, self.groups = placement, groups
        self.pool, self.layout = placement.roles["rollout"].pool, placement.roles["rollout"].layout
        self.ckpt = Checkpointer(cfg.trainer.output_dir, groups, desc, cfg.trainer.keep_last, async_save=False,
                                 layout=placement.roles["actor"].layout, reshard=False)

    def save(self, msg: Control, state: Any, write: Callable = write_inflight) -> str:
        """Join the training pool's save of step ``msg.step``, writing ``state`` with ``write(path, rank,
        state, pool, layout)`` (:func:`write_inflight`; ``trainer.mode: async`` has its own)."""
        rank = dist.get_rank()
        trained, frozen = absent_models(msg.models)
        return self.ckpt.save(msg.step, trained, {}, frozen=frozen or None,
                              own_files=lambda path: write(path, rank, state, self.pool, self.layout))

    def resume(self, resume: str, read: Callable = read_inflight) -> Optional[Any]:
        """The in-flight state of the checkpoint ``trainer.resume`` names (None: a fresh run)."""
        path = self.ckpt.find_resume(resume)
        if path is None:
            return None
        written = self.ckpt._read_state(path)
        trained, frozen = absent_models((*written["models"], *written.get("frozen", {})))
        saved = self.ckpt.load(path, trained, frozen=frozen or None)
        state = read(path, dist.get_rank(), self.pool, self.layout, self.groups.device)
        if state.step != int(saved["step"]) + 1:
            raise CheckpointError(f"{inflight_file(path, dist.get_rank())} holds the batch of step {state.step}, "
                                  f"but the checkpoint is at step {saved['step']}")
        return state

    def close(self, abort: bool = False) -> None:
        self.ckpt.close(abort=abort)
