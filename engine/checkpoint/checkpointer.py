"""Training checkpoints: save, find, resume and prune them; capture and restore RNG states.

Layout under ``<trainer.output_dir>/checkpoints``::

    step_000006/
        actor/                  model weights: a hyflow model checkpoint (Megatron dist
                                checkpoint + model.json + hyflow_checkpoint.json), loadable under
                                any TP / PP layout and exportable with ``hyflow export``
        actor_optimizer/        Megatron optimizer state (dist checkpoint, fully reshardable)
        critic/, critic_optimizer/   the same for each further trained model
        rng/rank_00000.pt       python / numpy / torch (/ CUDA) / Megatron RNG-tracker states, per rank
        trainer_state.json      step, layout, LR-scheduler states, the job's state (data position, ...)
        config.resolved.yaml    the run's resolved config
        COMPLETE                written last: only a directory holding it counts as a checkpoint
    reference/                  frozen weights the config cannot rebuild (saved once per run)
    latest                      name of the newest complete checkpoint; moved after COMPLETE

Every save is collective. Tensors go through ``dist_checkpointing``: asynchronously on GPU
(the copy to host happens at the call, the writing in a background process, and the
markers are written when every rank has finished), synchronously on CPU. Loading into a
different TP / PP / DP layout reshards the dist checkpoints; RNG states are per rank, so
they are only restored into the layout they were saved from.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from hyflow.checkpoint.model import (CHECKPOINT_INFO_FILE, CheckpointError, CheckpointInfo, check_compatible,
                                      load_model_checkpoint, model_dtype_name, read_checkpoint_info, read_description,
                                      store_tokenizer)
from hyflow.models.description import DESCRIPTION_FILE, ModelDescription
from hyflow.parallel.groups import ParallelGroups
from hyflow.parallel.layout import pad_vocab_size

LOG = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
MARKER_FILE = "COMPLETE"
LATEST_FILE = "latest"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.resolved.yaml"
STATE_FORMAT = "hyflow-trainer-checkpoint"
STATE_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    """``step_000042``: zero-padded so the names sort by step."""
    return f"step_{step:06d}"


def checkpoints_root(output_dir: str) -> str:
    """Where a run keeps its checkpoints."""
    return os.path.join(output_dir, CHECKPOINTS_DIR)


# --------------------------------------------------------------------------- discovery


@dataclass
class CheckpointEntry:
    """One ``step_*`` directory: its step, path, and whether its save finished."""

    step: int
    path: str
    complete: bool
    problem: str = ""


def checkpoint_status(path: str) -> tuple[bool, str]:
    """(complete, why not): a checkpoint is complete when its marker names its step."""
    marker = os.path.join(path, MARKER_FILE)
    if not os.path.exists(marker):
        return False, f"no {MARKER_FILE} marker (its save was interrupted)"
    try:
        with open(marker) as f:
            data = json.load(f)
        int(data["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return False, f"its {MARKER_FILE} marker is unreadable ({type(e).__name__})"
    if not os.path.exists(os.path.join(path, STATE_FILE)):
        return False, f"{STATE_FILE} is missing"
    return True, ""


def list_checkpoints(root: str) -> list[CheckpointEntry]:
    """The ``step_*`` directories under ``root``, oldest first (none when it does not exist)."""
    if not os.path.isdir(root):
        return []
    entries = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if match and os.path.isdir(path):
            complete, problem = checkpoint_status(path)
            entries.append(CheckpointEntry(int(match.group(1)), path, complete, problem))
    return sorted(entries, key=lambda e: e.step)


def latest_checkpoint(root: str, warn: Callable[[str], None] = LOG.warning) -> Optional[CheckpointEntry]:
    """The newest complete checkpoint under ``root``; ``warn`` names each newer incomplete one."""
    for entry in reversed(list_checkpoints(root)):
        if entry.complete:
            return entry
        warn(f"skipping incomplete checkpoint {entry.path}: {entry.problem}")
    return None


def resolve_checkpoint(path: str, warn: Callable[[str], None] = LOG.warning) -> str:
    """A complete step checkpoint from ``path``: a step directory, a checkpoints root, or a run
    directory (its newest complete checkpoint). Raises :class:`CheckpointError` otherwise."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if _STEP_DIR.match(os.path.basename(os.path.normpath(path))):
        complete, problem = checkpoint_status(path)
        if not complete:
            raise CheckpointError(f"checkpoint {path} is incomplete: {problem}")
        return path
    for root in (path, checkpoints_root(path)):
        entry = latest_checkpoint(root, warn)
        if entry is not None:
            return entry.path
    raise CheckpointError(f"no complete checkpoint in {path} (looked for {CHECKPOINTS_DIR}/step_*/{MARKER_FILE})")


def resume_path(resume: str, output_dir: str, warn: Callable[[str], None] = LOG.warning) -> Optional[str]:
    """``trainer.resume``: ``never`` -> None; ``auto`` -> the newest complete checkpoint of
    ``output_dir`` (None for a fresh run); anything else is a checkpoint path that must exist."""
    if resume == "never":
        return None
    if resume == "auto":
        entry = latest_checkpoint(checkpoints_root(output_dir), warn)
        return entry.path if entry else None
    return resolve_checkpoint(resume, warn)


def prune_checkpoints(root: str, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints, and incomplete ones older
    than the newest complete one. Returns the removed paths."""
    entries = list_checkpoints(root)
    complete = [e for e in entries if e.complete]
    if not complete:
        return []
    keep = {e.path for e in complete[-keep_last:]}
    newest = complete[-1].step
    removed = [e.path for e in entries if e.path not in keep and (e.complete or e.step < newest)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


# --------------------------------------------------------------------------- RNG


def capture_rng() -> dict[str, Any]:
    """This rank's random streams: python, numpy, torch (CPU, CUDA) and Megatron's tracker."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from hyflow.compat import cpu

    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and not cpu.is_active():
        state["cuda"] = torch.cuda.get_rng_state()
    tracker = get_cuda_rng_tracker()
    state["tracker"] = {name: s.clone() for name, s in tracker.get_states().items()}
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Undo everything drawn since :func:`capture_rng` returned ``state``."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states({name: s.clone() for name, s in state["tracker"].items()})


# --------------------------------------------------------------------------- files


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` durably, so readers see the old file or the whole new one."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself
    finally:
        os.close(fd)


def _write_json(path: str, data: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def _quiet_deprecations() -> Iterator[None]:
    """dist_checkpointing uses torch APIs that warn about their deprecation; not the user's concern."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.checkpoint.*")
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"megatron\.core\.dist_checkpointing.*")
        yield


# --------------------------------------------------------------------------- save / load


@dataclass
class TrainedModel:
    """A model saved in every checkpoint, with its optimizer and LR scheduler (None: frozen)."""

    chunks: list
    optimizer: Any = None
    scheduler: Any = None

    @property
    def module(self) -> torch.nn.Module:
        """The model inside the DDP wrapper (one chunk: virtual pipeline stages are not supported)."""
        if len(self.chunks) != 1:
            raise CheckpointError(f"checkpointing supports one model chunk per rank, got {len(self.chunks)} "
                                  "(virtual pipeline stages)")
        return _unwrap(self.chunks[0])


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


def optimizer_format() -> str:
    """Megatron's distributed-optimizer checkpoint format: ``fully_reshardable`` (loads under any
    TP / PP / DP layout), or, with torch's own Adam (no Apex / Transformer Engine, e.g. on CPU),
    ``dp_reshardable``: Megatron 0.16's fully reshardable loader drops that Adam's per-parameter
    ``step``, so there the state loads only into the same TP / PP (any DP). The plain
    (non-distributed) optimizer is keyed by the model's parameters and loads anywhere."""
    from megatron.core.optimizer import distrib_optimizer

    return "fully_reshardable" if distrib_optimizer.HAVE_APEX_OR_TE else "dp_reshardable"


def _optimizer_metadata(fmt: str) -> dict[str, Any]:
    return {"distrib_optim_sharding_type": fmt, "chained_optim_avoid_prefix": True}


def _has_tensors(sharded: Any) -> bool:
    """Whether a sharded state dict holds any sharded tensor (an unstepped optimizer's has none)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    return any(isinstance(v, ShardedBase) for v in nested_values(sharded))


def _layout_dict(groups: ParallelGroups) -> dict[str, Any]:
    return dict(asdict(groups.layout), world_size=dist.get_world_size())


def _describe_layout(layout: dict[str, Any]) -> str:
    return (f"tp={layout.get('tp')} pp={layout.get('pp')} dp={layout.get('dp')} "
            f"({layout.get('world_size')} rank{'' if layout.get('world_size') == 1 else 's'})")


class Checkpointer:
    """Saves and loads the step checkpoints of one run (every method is collective).

    Args:
        output_dir: the run directory; checkpoints go to ``<output_dir>/checkpoints``.
        groups: the training layout's process groups.
        desc: the models' description (written as each model's ``model.json``).
        keep_last: complete checkpoints kept; older ones are deleted after each save.
        tokenizer: the run's tokenizer spec; a tokenizer directory is copied next to each saved
            model's ``model.json`` so checkpoints load (``hyflow generate``, ``hyflow export``) on
            their own.
        async_save: write in the background (default: on GPU only; CPU tensors would be
            written while training changes them).
        log: where rank 0's progress lines go.
    """

    def __init__(self, output_dir: str, groups: ParallelGroups, desc: ModelDescription, keep_last: int = 2, *,
                 async_save: Optional[bool] = None, log: Callable[[str], None] = print,
                 tokenizer: Optional[str] = None) -> None:
        from hyflow.compat import cpu

        self.root = checkpoints_root(output_dir)
        self.groups, self.desc, self.keep_last, self.tokenizer = groups, desc, keep_last, tokenizer
        self.async_save = (torch.cuda.is_available() and not cpu.is_active()) if async_save is None else async_save
        self._log = log
        self._queue: Any = None

    def log(self, message: str) -> None:
        """Print ``message`` on rank 0."""
        if dist.get_rank() == 0:
            self._log(message)

    # ----------------------------------------------------------------- save

    def save(self, step: int, models: dict[str, TrainedModel], job_state: dict[str, Any], *,
             frozen: Optional[dict[str, torch.nn.Module]] = None, config_text: Optional[str] = None) -> str:
        """Checkpoint ``step``: ``models`` (weights, optimizer, scheduler), this rank's RNG
        states, ``job_state`` (JSON: data position, controllers, counters) and ``config_text``.

        ``frozen`` models are written once per run to ``<checkpoints>/<name>`` and referenced.
        Random streams are left exactly as they were. Returns the step directory; it counts as
        a checkpoint once :meth:`wait` (or, on CPU, this call) has written its marker.
        """
        self.wait()  # one save in flight at a time: the previous one's marker comes first
        rng = capture_rng()
        path = os.path.join(self.root, step_dir_name(step))
        rank = dist.get_rank()
        if rank == 0:
            if os.path.exists(path):  # an interrupted save of this step, or a re-save
                shutil.rmtree(path)
            os.makedirs(os.path.join(path, "rng"))
        dist.barrier()
        start = time.perf_counter()
        torch.save(rng, os.path.join(path, "rng", f"rank_{rank:05d}.pt"))
        frozen_paths = {name: self._save_frozen(name, model) for name, model in (frozen or {}).items()}
        requests, infos = [], {}
        state: dict[str, Any] = {
            "format": STATE_FORMAT, "version": STATE_VERSION, "step": step, "layout": _layout_dict(self.groups),
            "models": {}, "frozen": frozen_paths, "job": job_state, "time": time.time()}
        for name, model in models.items():
            module = model.module
            requests.append(self._dist_save(module.sharded_state_dict(), os.path.join(path, name)))
            infos[name] = self._model_info(module, step, name)
            entry: dict[str, Any] = {"optimizer": False, "optimizer_format": optimizer_format()}
            if model.optimizer is not None:
                sharded = model.optimizer.sharded_state_dict(
                    module.sharded_state_dict(), metadata=_optimizer_metadata(entry["optimizer_format"]))
                # An optimizer that never stepped has no state; a fresh one equals it on load.
                entry["optimizer"] = _has_tensors(sharded)
                if entry["optimizer"]:
                    requests.append(self._dist_save(sharded, os.path.join(path, f"{name}_optimizer")))
            if model.scheduler is not None:
                entry["scheduler"] = model.scheduler.state_dict()
            state["models"][name] = entry

        def finalize() -> None:
            if dist.get_rank() == 0:
                self._write_metadata(path, state, infos, config_text)
                self._publish(path, step)
            dist.barrier()
            self.log(f"[hyflow] checkpoint step {step} saved to {path} ({time.perf_counter() - start:.1f}s)")

        pending = [r for r in requests if r is not None]
        if pending:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            pending[-1].add_finalize_fn(finalize)
            self._queue = self._queue or AsyncCallsQueue()
            for request in pending:
                self._queue.schedule_async_request(request)
        else:
            finalize()
        restore_rng(rng)
        return path

    def _dist_save(self, sharded: dict, directory: str) -> Any:
        from megatron.core import dist_checkpointing

        os.makedirs(directory, exist_ok=True)
        with _quiet_deprecations():
            return dist_checkpointing.save(sharded, directory, async_sharded_save=self.async_save)

    def _model_info(self, module: torch.nn.Module, step: int, name: str) -> CheckpointInfo:
        from megatron.core import __version__ as mcore_version

        layout = self.groups.layout
        return CheckpointInfo(dtype=model_dtype_name(module), tp=layout.tp, pp=layout.pp,
                              num_layers=self.desc.num_layers, vocab_size=self.desc.vocab_size,
                              padded_vocab_size=pad_vocab_size(self.desc.vocab_size, layout.tp),
                              megatron_core=mcore_version, extra={"writer": "hyflow trainer", "role": name,
                                                                  "step": step})

    def _write_metadata(self, path: str, state: dict[str, Any], infos: dict[str, CheckpointInfo],
                        config_text: Optional[str]) -> None:
        """Rank 0, once every tensor is on disk: the model descriptions and infos, the trainer
        state, the config, and last the marker."""
        for name, info in infos.items():
            _write_json(os.path.join(path, name, DESCRIPTION_FILE), self._description_in(os.path.join(path, name)))
            _write_json(os.path.join(path, name, CHECKPOINT_INFO_FILE), asdict(info))
        _write_json(os.path.join(path, STATE_FILE), state)
        if config_text is not None:
            write_atomic(os.path.join(path, CONFIG_FILE), config_text)
        _write_json(os.path.join(path, MARKER_FILE), {"step": state["step"], "time": time.time()})

    def _publish(self, path: str, step: int) -> None:
        """Rank 0: move ``latest`` to the new checkpoint and prune old ones."""
        write_atomic(os.path.join(self.root, LATEST_FILE), os.path.basename(path) + "\n")
        for removed in prune_checkpoints(self.root, self.keep_last):
            self._log(f"[hyflow] removed old checkpoint {removed} (trainer.keep_last={self.keep_last})")

    def _save_frozen(self, name: str, model: torch.nn.Module) -> str:
        """Write a frozen model once per run (synchronously); returns its path relative to the
        step directories."""
        from hyflow.checkpoint.model import save_model_checkpoint

        target = os.path.join(self.root, name)
        flags = [False]
        if dist.get_rank() == 0:  # rank 0's view decides for everyone
            try:
                read_checkpoint_info(target)
                flags[0] = True
            except CheckpointError:
                pass
        dist.broadcast_object_list(flags, src=0)
        if not flags[0]:
            save_model_checkpoint(model, target, self.groups, self.desc, overwrite=True,
                                  extra={"writer": "hyflow trainer", "role": name})
            if dist.get_rank() == 0:
                _write_json(os.path.join(target, DESCRIPTION_FILE), self._description_in(target))
            dist.barrier()
        return os.path.join("..", name)

    def _description_in(self, model_dir: str) -> dict[str, Any]:
        """``model.json`` for a model saved in ``model_dir``, its tokenizer stored beside it."""
        data = self.desc.to_dict()
        if self.tokenizer:
            data["tokenizer"] = store_tokenizer(self.tokenizer, model_dir)
        return data

    def wait(self) -> None:
        """Block until every save in flight has its marker (collective; no-op on CPU)."""
        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=True)

    def poll(self) -> None:
        """Finalize saves that finished in the background (collective: call at step boundaries)."""
        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=False)

    def close(self, abort: bool = False) -> None:
        """Finish (or, after an error, abandon) saves in flight."""
        if self._queue is not None:
            self._queue.close(abort=abort)
            self._queue = None

    # ----------------------------------------------------------------- load

    def load(self, path: str, models: dict[str, TrainedModel], *,
             frozen: Optional[dict[str, torch.nn.Module]] = None) -> dict[str, Any]:
        """Load checkpoint ``path`` into ``models`` (and ``frozen`` ones it references); restore
        this rank's RNG states when the layout is unchanged. Returns the trainer state (its
        ``job`` entry is what :meth:`save` was given). Call it last before training resumes."""
        with open(os.path.join(path, STATE_FILE)) as f:
            state = json.load(f)
        if state.get("format") != STATE_FORMAT or int(state.get("version", 0)) > STATE_VERSION:
            raise CheckpointError(f"{path}/{STATE_FILE}: not a hyflow trainer checkpoint this version reads "
                                  f"(format {state.get('format')!r}, version {state.get('version')})")
        saved, current = state["layout"], _layout_dict(self.groups)
        same_layout = saved == current
        if same_layout:
            self.log(f"[hyflow] resuming from {path} (step {state['step']})")
        else:
            self.log(f"[hyflow] resuming from {path} (step {state['step']}): written with {_describe_layout(saved)}, "
                     f"loading into {_describe_layout(current)}; resharding the distributed checkpoint "
                     "(random streams are re-seeded: they are saved per rank)")
        missing = sorted(set(models) - set(state["models"]))
        if missing:
            raise CheckpointError(f"checkpoint {path} has no {', '.join(missing)} (the run's config has "
                                  f"{', '.join(sorted(models))}; the checkpoint {', '.join(sorted(state['models']))})")
        for name, model in models.items():
            entry = state["models"][name]
            self._load_model(model.module, os.path.join(path, name), exact=same_layout)
            if model.optimizer is not None and entry.get("optimizer"):  # else: saved before its first step
                fmt = entry.get("optimizer_format", optimizer_format())
                if fmt == "dp_reshardable" and _distributed_parts(model.optimizer) and \
                        (saved["tp"], saved["pp"]) != (current["tp"], current["pp"]):
                    raise CheckpointError(
                        f"{path}: the {name} distributed-optimizer state is in Megatron's dp_reshardable format "
                        f"(torch Adam, no Apex / TE), which loads only into tp={saved['tp']} pp={saved['pp']}")
                self._load_optimizer(model, os.path.join(path, f"{name}_optimizer"), fmt)
            if model.scheduler is not None and "scheduler" in entry:
                model.scheduler.load_state_dict(entry["scheduler"])
        for name, module in (frozen or {}).items():
            if name not in state.get("frozen", {}):
                raise CheckpointError(f"checkpoint {path} does not reference frozen model {name!r}")
            load_model_checkpoint(module, os.path.normpath(os.path.join(path, state["frozen"][name])),
                                  self.groups, self.desc)
        if same_layout:
            rng_file = os.path.join(path, "rng", f"rank_{dist.get_rank():05d}.pt")
            restore_rng(torch.load(rng_file, weights_only=False))
        return state

    def _load_model(self, module: torch.nn.Module, directory: str, exact: bool) -> None:
        """Load weights; ``exact`` keeps the padded vocabulary rows as saved (a resume in the
        same layout must continue bit for bit), otherwise they are zeroed as on any reshard."""
        if not exact:
            load_model_checkpoint(module, directory, self.groups, self.desc)
            return
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.validation import StrictHandling

        read_checkpoint_info(directory)  # complete, files intact
        check_compatible(self.desc, read_description(directory), directory)
        with _quiet_deprecations():
            state = dist_checkpointing.load(module.sharded_state_dict(), directory,
                                            strict=StrictHandling.RAISE_UNEXPECTED)
        module.load_state_dict(state, strict=True)

    def _load_optimizer(self, model: TrainedModel, directory: str, fmt: str) -> None:
        from megatron.core import dist_checkpointing

        module = model.module
        _allocate_distributed_optimizer_state(model.optimizer)
        sharded = model.optimizer.sharded_state_dict(module.sharded_state_dict(), is_loading=True,
                                                     metadata=_optimizer_metadata(fmt))
        with _quiet_deprecations():
            loaded = dist_checkpointing.load(sharded, directory)
        with torch.no_grad():  # Megatron's dp_reshardable loader copies into parameter views
            model.optimizer.load_state_dict(loaded)
        _restore_adam_steps(model.optimizer)


def _distributed_parts(optimizer: Any) -> list:
    """The Megatron ``DistributedOptimizer`` parts of ``optimizer`` (chained or not)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [o for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]
            if isinstance(o, DistributedOptimizer)]


def _torch_adams(optimizer: Any) -> list:
    """The torch ``Adam`` inside each ``DistributedOptimizer`` part (no Apex / TE fused Adam)."""
    return [o.optimizer for o in _distributed_parts(optimizer) if isinstance(o.optimizer, torch.optim.Adam)]


def _restore_adam_steps(optimizer: Any) -> None:
    """Repair a torch Adam's ``step`` after Megatron's ``DistributedOptimizer.load_state_dict``.

    Megatron 0.16 gives every parameter the *same* ``step`` tensor (which Adam would then
    increment once per parameter) and its dp_reshardable loader overwrites it with the loading
    template's value; the true step is the one it saved with the param groups.
    """
    for adam in _torch_adams(optimizer):
        for group in adam.param_groups:
            for param in group["params"]:
                state = adam.state.get(param, {})
                if "step" in state:
                    step = group.get("step", state["step"])
                    state["step"] = torch.tensor(float(step), dtype=torch.float32)


def _allocate_distributed_optimizer_state(optimizer: Any) -> None:
    """Give a fresh Megatron ``DistributedOptimizer`` on torch's Adam (no Apex / TE) its state.

    Its ``state_dict()``, which building the sharded state dict for a load calls, reads the
    common ``step`` of the allocated Adam state; before the first update there is none. Zero
    moments and ``step = 0`` are what the first update would allocate; the load overwrites them.
    """
    for adam in _torch_adams(optimizer):
        for group in adam.param_groups:
            for param in group["params"]:
                state = adam.state[param]
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state.setdefault("exp_avg", torch.zeros_like(param, memory_format=torch.preserve_format))
                    state.setdefault("exp_avg_sq", torch.zeros_like(param, memory_format=torch.preserve_format))
