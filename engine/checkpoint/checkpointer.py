"""Step checkpoints of a run: save (collective; in the background on GPU), verify, load.

One step checkpoint, ``<trainer.output_dir>/checkpoints/step_000006/``::

    actor/                  model weights: a hyflow model checkpoint (Megatron dist checkpoint
                            + model.json + hyflow_checkpoint.json), loadable under any TP / PP
                            layout and exportable with ``hyflow export``
    actor_optimizer/        Megatron optimizer state (dist checkpoint)
    critic/, critic_optimizer/   the same for each further trained model
    rng/rank_00000.pt       this rank's random streams as plain tensors (:mod:`.rng`)
    trainer_state.json      step, layout, LR-scheduler states, the job's state (data position, ...)
    config.resolved.yaml    the run's resolved config
    manifest.json           size and SHA-256 of every file above (:mod:`.manifest`)
    COMPLETE                written last (with the save's duration): only a directory holding
                            it counts as a checkpoint

Finding, pruning and setting aside checkpoints is :mod:`.discovery`. Tensors go through
``dist_checkpointing``: asynchronously on GPU (the copy to host happens at the call, the
writing in a background process, and the manifest and markers are written when every rank
has finished), synchronously on CPU. Loading into a different TP / PP / DP layout reshards
the dist checkpoints; RNG states are per rank, so they are only restored into the layout
they were saved from.

Before anything of a checkpoint is read its files are checked against its manifest (each rank
checks a share) and every pickle in it is checked to hold only tensors and plain data
(:mod:`.trust`); ``trainer.resume=auto`` falls back to the newest checkpoint that passes.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import __version__ as mcore_version, dist_checkpointing
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.validation import StrictHandling

from hyflow.checkpoint.adapters import adapter_info, check_adapter_checkpoint
from hyflow.checkpoint.agree import any_rank, broadcast_json
from hyflow.checkpoint.discovery import (CONFIG_FILE, LATEST_FILE, MARKER_FILE, STATE_FILE, checkpoints_root,
                                         latest_checkpoint, prune_checkpoints, resume_candidates,
                                         resume_path, set_aside, step_dir_name)
from hyflow.checkpoint.errors import CheckpointDamaged, CheckpointError, NonFiniteWeights
from hyflow.checkpoint.finite import check_finite
from hyflow.checkpoint.files import describe_os_error, find_os_error, full_disk_error, read_json, write_atomic, write_json
from hyflow.checkpoint.manifest import write_manifest, verify_manifest
from hyflow.checkpoint.megatron_io import quiet_dist_checkpointing, stop_signal_proof_writer_queue
from hyflow.checkpoint.model import (CHECKPOINT_INFO_FILE, CheckpointInfo, check_compatible, load_model_checkpoint,
                                     model_dtype_name, read_checkpoint_info, read_description, save_model_checkpoint,
                                     store_tokenizer, verify_model_checkpoint)
from hyflow.checkpoint.optimizer_state import (allocate_distributed_optimizer_state, distributed_parts,
                                               has_tensors, optimizer_format, optimizer_metadata,
                                               restore_adam_steps)
from hyflow.checkpoint.rng import capture_rng, load_rng, restore_rng, save_rng
from hyflow.checkpoint.trained_model import TrainedModel
from hyflow.checkpoint.trust import check_dcp_pickles
from hyflow.compat import cpu
from hyflow.models.description import DESCRIPTION_FILE, ModelDescription
from hyflow.monitor import watchdog
from hyflow.parallel.groups import ParallelGroups
from hyflow.parallel.layout import pad_vocab_size
from hyflow.training.optimizer import fuse_torch_adam

STATE_FORMAT = "hyflow-trainer-checkpoint"
#: What to do about a checkpoint that cannot be loaded: resume=auto would pick it again.
_REFUSED_HINT = ("it cannot be resumed from: set trainer.resume to an earlier step_* directory, or move this one "
                 "away (trainer.resume=auto then takes the previous checkpoint)")
STATE_VERSION = 1

__all__ = ["Checkpointer", "TrainedModel", "STATE_FORMAT", "STATE_VERSION", "resume_path", "LATEST_FILE",
           "MARKER_FILE", "STATE_FILE", "CONFIG_FILE"]


def _layout_dict(layout: Any) -> dict[str, Any]:
    # as the trainer state's JSON holds it: a tuple (Layout.stage_layers) reads back as a list
    fields = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(layout).items()}
    if not fields.get("start"):  # a layout from rank 0 reads as checkpoints written before Layout.start
        fields.pop("start", None)
    return dict(fields, world_size=dist.get_world_size())


def _describe_layout(layout: dict[str, Any]) -> str:
    return (f"tp={layout.get('tp')} pp={layout.get('pp')} dp={layout.get('dp')} "
            f"({layout.get('world_size')} rank{'' if layout.get('world_size') == 1 else 's'})")


def _state_problem(state: dict[str, Any]) -> str:
    """What is wrong with a trainer state's fields (empty when nothing is)."""
    if not isinstance(state.get("step"), int) or isinstance(state.get("step"), bool) or state["step"] < 0:
        return f"step is {state.get('step')!r}, not a step number"
    for key in ("layout", "models", "job"):
        if not isinstance(state.get(key), dict):
            return f"{key} is {type(state.get(key)).__name__}, not a mapping"
    if not all(isinstance(v, dict) for v in state["models"].values()):
        return "models holds an entry that is not a mapping"
    if not isinstance(state.get("frozen", {}), dict) or \
            not all(isinstance(v, str) for v in state.get("frozen", {}).values()):
        return "frozen is not a mapping of paths"
    if not all(isinstance(state["layout"].get(k), int) for k in ("tp", "pp")):
        return "layout lacks tp / pp"
    return ""


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
        layout: the layout written into (and compared with) the trainer state (default: the
            groups' own); the ranks of a pool that holds no model pass the training pool's.
        reshard: whether a checkpoint may be loaded into another layout. Pooled runs keep
            per-rank state beside the models (the in-flight batch), so they resume only into
            the layout they were saved from.
    """

    def __init__(self, output_dir: str, groups: ParallelGroups, desc: ModelDescription, keep_last: int = 2, *,
                 async_save: Optional[bool] = None, log: Callable[[str], None] = print,
                 tokenizer: Optional[str] = None, layout: Any = None, reshard: bool = True) -> None:
        self.output_dir = output_dir
        self.root = checkpoints_root(output_dir)
        self.groups, self.desc, self.keep_last, self.tokenizer = groups, desc, keep_last, tokenizer
        self.layout, self.reshard = (layout if layout is not None else groups.layout), reshard
        self.async_save = (torch.cuda.is_available() and not cpu.is_active()) if async_save is None else async_save
        stop_signal_proof_writer_queue()
        self._log = log
        self._queue: Any = None
        self._verified: set[str] = set()
        self._validated: set[str] = set()  # parts whose sharding Megatron validated on a save of this run
        self._doing = ""

    def log(self, message: str) -> None:
        """Print ``message`` on rank 0."""
        if dist.get_rank() == 0:
            self._log(message)

    # ----------------------------------------------------------------- save

    def save(self, step: int, models: dict[str, TrainedModel], job_state: dict[str, Any], *,
             frozen: Optional[dict[str, torch.nn.Module]] = None, config_text: Optional[str] = None,
             own_files: Optional[Callable[[str], None]] = None) -> str:
        """Checkpoint ``step``: ``models`` (weights, optimizer, scheduler), this rank's RNG
        states, ``job_state`` (JSON: data position, controllers, counters) and ``config_text``.

        ``frozen`` models are written once per run to ``<checkpoints>/<name>`` and referenced.
        ``own_files(path)`` writes this rank's own files into the step directory (named
        ``.../rank_<rank>.pt``, so this rank hashes them into the manifest) before the tensors.
        Random streams are left exactly as they were. Returns the step directory; it counts as
        a checkpoint once :meth:`wait` (or, on CPU, this call) has written its marker. A write
        that fails (disk full, ...) raises :class:`CheckpointError` naming the directory and
        what was being written; earlier checkpoints are untouched.
        """
        self.wait()  # one save in flight at a time: the previous one's marker comes first
        watchdog.beat(f"saving checkpoint step {step}")
        rng = capture_rng()
        path = os.path.join(self.root, step_dir_name(step))
        try:
            return self._save(step, path, rng, models, job_state, frozen, config_text, own_files)
        except BaseException as e:  # torch DCP's CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            os_error = find_os_error(e) or full_disk_error(self.root)
            if os_error is None:
                raise
            raise CheckpointError(self._failure(step, path, os_error)) from e
        finally:
            restore_rng(rng)

    def _failure(self, step: int, path: str, e: OSError) -> str:
        return (f"checkpoint step {step} was not saved: {describe_os_error(e, self._doing or f'writing {path}')}; "
                f"{self._previous_note()}")

    def _previous_note(self) -> str:
        previous = latest_checkpoint(self.root, lambda _: None)
        return (f"the previous checkpoint {previous.path} (step {previous.step}) is intact and "
                "`trainer.resume=auto` continues from it" if previous else "there is no earlier checkpoint")

    def _check_finite(self, models: dict[str, Any], what: str, after: str = "") -> None:
        """Every rank's tensors of ``models`` are finite, or every rank raises (collective)."""
        try:
            check_finite(models, what, device=self.groups.device)
        except NonFiniteWeights as e:
            if not after:
                raise
            raise NonFiniteWeights(f"{e}; {after}", tensor=e.tensor, peer=e.peer) from None

    def _save(self, step: int, path: str, rng: dict, models: dict[str, TrainedModel], job_state: dict[str, Any],
              frozen: Optional[dict[str, torch.nn.Module]], config_text: Optional[str],
              own_files: Optional[Callable[[str], None]] = None) -> str:
        rank = dist.get_rank()
        self._check_finite({**{name: m.chunks for name, m in models.items()}, **(frozen or {})},
                           f"saving checkpoint step {step}", after=self._previous_note())
        self._doing = f"creating {path}"
        if rank == 0:
            if os.path.exists(path):  # an interrupted save of this step, or a re-save
                shutil.rmtree(path)
            os.makedirs(os.path.join(path, "rng"))
        dist.barrier()
        start = time.perf_counter()
        self._doing = f"writing the random states to {path}/rng"
        save_rng(os.path.join(path, "rng", f"rank_{rank:05d}.pt"), rng)
        if own_files is not None:
            self._doing = f"writing rank {rank}'s own files to {path}"
            own_files(path)
        frozen_paths = {name: self._save_frozen(name, model) for name, model in (frozen or {}).items()}
        requests, infos = [], {}
        state: dict[str, Any] = {
            "format": STATE_FORMAT, "version": STATE_VERSION, "step": step, "layout": _layout_dict(self.layout),
            "models": {}, "frozen": frozen_paths, "job": job_state, "time": time.time()}
        if rank == 0 and any(m.absent for m in models.values()):
            raise CheckpointError("rank 0 must hold every saved model (the pool holding the actor starts at rank 0)")
        for name, model in models.items():
            self._doing = f"writing the {name} weights to {path}/{name}"
            if model.absent:
                requests.append(self._dist_save({}, os.path.join(path, name)))
            else:
                requests.append(self._dist_save(model.module.sharded_state_dict(), os.path.join(path, name)))
                infos[name] = self._model_info(model.module, step, name)
            entry: dict[str, Any] = {"optimizer": False, "optimizer_format": optimizer_format()}
            sharded = {}
            if model.optimizer is not None:
                sharded = model.optimizer.sharded_state_dict(
                    model.module.sharded_state_dict(), metadata=optimizer_metadata(entry["optimizer_format"]))
            # An optimizer that never stepped has no state; a fresh one equals it on load. Every
            # rank (also those without the model) must agree whether a save follows.
            entry["optimizer"] = self._any_rank(has_tensors(sharded))
            if entry["optimizer"]:
                self._doing = f"writing the {name} optimizer state to {path}/{name}_optimizer"
                requests.append(self._dist_save(sharded, os.path.join(path, f"{name}_optimizer")))
            if model.scheduler is not None:
                entry["scheduler"] = model.scheduler.state_dict()
            state["models"][name] = entry

        def finalize() -> None:
            self._doing = f"writing the metadata of {path}"
            if dist.get_rank() == 0:
                self._write_metadata(path, state, infos, config_text)
            dist.barrier()
            self._doing = f"writing {path}/manifest.json"
            write_manifest(path, exclude=(MARKER_FILE,))  # collective: each rank hashes the files it wrote
            seconds = time.perf_counter() - start
            if dist.get_rank() == 0:
                write_json(os.path.join(path, MARKER_FILE), {"step": step, "time": time.time(),
                                                             "save_seconds": round(seconds, 3)})
                self._publish(path, step)
            dist.barrier()
            self.log(f"[hyflow] checkpoint step {step} saved to {path} ({seconds:.1f}s)")

        pending = [r for r in requests if r is not None]
        if pending:
            pending[-1].add_finalize_fn(finalize)
            self._queue = self._queue or AsyncCallsQueue()
            for request in pending:
                self._queue.schedule_async_request(request)
        else:
            finalize()
        return path

    def _any_rank(self, flag: bool) -> bool:
        """True when ``flag`` is true on some rank (collective)."""
        return any_rank(flag, self.groups.device)

    def _dist_save(self, sharded: dict, directory: str) -> Any:
        os.makedirs(directory, exist_ok=True)
        # Megatron's access-integrity validation all-gathers every rank's shard metadata (pickled,
        # O(world x shards) per rank). It checks that the layout's shards cover each tensor once,
        # which cannot change within a run: validate the first save of each part, then trust it.
        name = os.path.basename(os.path.normpath(directory))
        validate = name not in self._validated
        self._validated.add(name)
        with quiet_dist_checkpointing(holds_nothing=not sharded):
            return dist_checkpointing.save(sharded, directory, async_sharded_save=self.async_save,
                                           validate_access_integrity=validate)

    def _model_info(self, module: torch.nn.Module, step: int, name: str) -> CheckpointInfo:
        layout = self.groups.layout
        return CheckpointInfo(dtype=model_dtype_name(module), tp=layout.tp, pp=layout.pp,
                              num_layers=self.desc.num_layers, vocab_size=self.desc.vocab_size,
                              padded_vocab_size=pad_vocab_size(self.desc.vocab_size, layout.tp),
                              megatron_core=mcore_version, extra={"writer": "hyflow trainer", "role": name,
                                                                  "step": step, **adapter_info(module)})

    def _write_metadata(self, path: str, state: dict[str, Any], infos: dict[str, CheckpointInfo],
                        config_text: Optional[str]) -> None:
        """Rank 0, once every tensor is on disk: the model descriptions and infos, the trainer
        state and the config (the manifest and the marker follow)."""
        for name, info in infos.items():
            write_json(os.path.join(path, name, DESCRIPTION_FILE), self._description_in(os.path.join(path, name)))
            write_json(os.path.join(path, name, CHECKPOINT_INFO_FILE), asdict(info))
        write_json(os.path.join(path, STATE_FILE), state)
        if config_text is not None:
            write_atomic(os.path.join(path, CONFIG_FILE), config_text)

    def _publish(self, path: str, step: int) -> None:
        """Rank 0: move ``latest`` to the new checkpoint and prune old ones."""
        write_atomic(os.path.join(self.root, LATEST_FILE), os.path.basename(path) + "\n")
        for removed in prune_checkpoints(self.root, self.keep_last):
            self._log(f"[hyflow] removed old checkpoint {removed} (trainer.keep_last={self.keep_last})")

    def _save_frozen(self, name: str, model: torch.nn.Module) -> str:
        """Write a frozen model once per run (synchronously); returns its path relative to the
        step directories."""
        target = os.path.join(self.root, name)
        saved = False
        if dist.get_rank() == 0:  # rank 0's view decides for everyone
            try:
                read_checkpoint_info(target)
                saved = True
            except CheckpointError:
                pass
        if not any_rank(saved, self.groups.device):
            self._doing = f"writing the frozen {name} model to {target}"
            save_model_checkpoint(model, target, self.groups, self.desc, overwrite=True,
                                  extra={"writer": "hyflow trainer", "role": name},
                                  write_extra=lambda: write_json(os.path.join(target, DESCRIPTION_FILE),
                                                                     self._description_in(target)))
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

    # ----------------------------------------------------------------- verify / choose

    def find_resume(self, resume: str, warn: Optional[Callable[[str], None]] = None) -> Optional[str]:
        """The checkpoint ``trainer.resume`` names, verified (see :meth:`verify`); None for a
        fresh run. With ``auto`` (or a run directory) a damaged newest checkpoint is set aside
        (renamed ``step_*.corrupt-<reason>``, never deleted), ``warn`` says so on rank 0, and
        the next older one is tried. A step directory named explicitly must verify itself."""
        warn = warn or self.log
        found: list[Any] = [None, True, None]
        if dist.get_rank() == 0:
            try:
                found[:2] = resume_candidates(resume, self.output_dir, warn)
            except CheckpointError as e:
                found[2] = str(e)
        candidates, exact, error = broadcast_json(found, self.groups.device)
        if error:
            raise CheckpointError(error)
        damaged = []
        for path in candidates:
            try:
                self.verify(path)
                return path
            except CheckpointDamaged as e:
                if exact or os.path.normpath(e.path) != os.path.normpath(path):
                    raise
                dist.barrier()  # every rank is done reading it
                if dist.get_rank() == 0:
                    moved = set_aside(path, e.reason)
                    damaged.append(moved)
                    warn(f"checkpoint {path} is damaged and was set aside as {moved}: {e}; trying the "
                         "previous checkpoint")
                dist.barrier()
        if candidates:
            raise CheckpointError(f"no usable checkpoint under {self.root}: every one is damaged (set aside: "
                                  f"{', '.join(damaged) or 'see the warnings'}); to start this run over, set "
                                  "trainer.resume=never")
        return None

    def verify(self, path: str) -> None:
        """Check checkpoint ``path`` before reading it (collective): every file against its
        manifest (each rank checks a share; :class:`CheckpointDamaged` names the first damaged
        file), ``trainer_state.json``, and every pickle in its distributed checkpoints and
        frozen models (:mod:`hyflow.checkpoint.trust`)."""
        if path in self._verified:
            return
        manifest = verify_manifest(path, device=self.groups.device)
        error: Optional[CheckpointError] = None
        state: dict[str, Any] = {}
        try:
            state = self._read_state(path)
            for name, entry in state["models"].items():
                check_dcp_pickles(os.path.join(path, name))
                if entry.get("optimizer"):
                    check_dcp_pickles(os.path.join(path, f"{name}_optimizer"))
        except CheckpointError as e:
            error = e
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=self.groups.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # all ranks raise, or none
        if int(flag.item()):
            raise error or CheckpointError(f"checkpoint {path} cannot be read on another rank (see its error)")
        for rel in state.get("frozen", {}).values():
            verify_model_checkpoint(os.path.normpath(os.path.join(path, rel)), self.groups, warn=self.log)
        if manifest is None:
            self.log(f"[hyflow] warning: {path} has no manifest.json: its files cannot be checked for damage "
                     "(loaded because verification is off: --no-verify / trainer.verify_checkpoints=false)")
        self._verified.add(path)

    def _read_state(self, path: str) -> dict[str, Any]:
        state = read_json(os.path.join(path, STATE_FILE), path)
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT or \
                not isinstance(state.get("version", 0), int) or state.get("version", 0) > STATE_VERSION:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(f"{path}/{STATE_FILE}: not a hyflow trainer checkpoint this version reads "
                                  f"(format {found!r}, version "
                                  f"{state.get('version') if isinstance(state, dict) else None})")
        problem = _state_problem(state)
        if problem:
            raise CheckpointDamaged(f"{path}/{STATE_FILE} is malformed: {problem}", path, STATE_FILE, "unreadable")
        return state

    # ----------------------------------------------------------------- load

    def load(self, path: str, models: dict[str, TrainedModel], *,
             frozen: Optional[dict[str, torch.nn.Module]] = None) -> dict[str, Any]:
        """Load checkpoint ``path`` into ``models`` (and ``frozen`` ones it references), after
        :meth:`verify` (skipped when :meth:`find_resume` just did it); restore this rank's RNG
        states when the layout is unchanged. Returns the trainer state (its ``job`` entry is
        what :meth:`save` was given). Call it last before training resumes."""
        watchdog.beat(f"loading checkpoint {path}")
        self.verify(path)
        state = self._read_state(path)
        saved, current = state["layout"], _layout_dict(self.layout)
        same_layout = saved == current
        if not same_layout and not self.reshard:
            raise CheckpointError(f"checkpoint {path} was written with {_describe_layout(saved)} and holds per-rank "
                                  "state beside the models (trainer.mode=one_step_off: the in-flight batch), so it "
                                  f"resumes only into that layout, not {_describe_layout(current)}: launch with the "
                                  "saved layout and placement")
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
            if model.absent:  # join the collectives of the loads below with nothing to read
                self._join_load(os.path.join(path, name), entry)
                continue
            self._load_model(model.module, os.path.join(path, name), exact=same_layout)
            if model.optimizer is not None and entry.get("optimizer"):  # else: saved before its first step
                fmt = entry.get("optimizer_format", optimizer_format())
                if fmt == "dp_reshardable" and distributed_parts(model.optimizer) and \
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
                                  self.groups, self.desc, verify=False)
        self._check_finite({**{name: m.chunks for name, m in models.items()}, **(frozen or {})},
                           f"loading checkpoint {path}", after=_REFUSED_HINT)
        if same_layout:
            rng_file = os.path.join(path, "rng", f"rank_{dist.get_rank():05d}.pt")
            if os.path.exists(rng_file) or os.path.isdir(os.path.dirname(rng_file)):
                restore_rng(load_rng(rng_file))
            else:
                self.log(f"[hyflow] warning: {path} has no rng/ folder: random streams are re-seeded, so the "
                         "resumed run will not repeat an uninterrupted one exactly")
        return state

    def _join_load(self, directory: str, entry: dict[str, Any]) -> None:
        """A rank without the model: the same dist_checkpointing loads as its holders, empty."""
        with quiet_dist_checkpointing():
            dist_checkpointing.load({}, directory, strict=StrictHandling.RAISE_UNEXPECTED)
            if entry.get("optimizer"):
                dist_checkpointing.load({}, f"{directory}_optimizer")

    def _load_model(self, module: torch.nn.Module, directory: str, exact: bool) -> None:
        """Load weights (already verified); ``exact`` keeps the padded vocabulary rows as saved
        (a resume in the same layout must continue bit for bit), otherwise they are zeroed as
        on any reshard."""
        if not exact:
            load_model_checkpoint(module, directory, self.groups, self.desc, verify=False)
            return
        info = read_checkpoint_info(directory)  # complete, files present
        check_compatible(self.desc, read_description(directory), directory)
        check_adapter_checkpoint(info.extra, module, directory)
        with quiet_dist_checkpointing():
            state = dist_checkpointing.load(module.sharded_state_dict(), directory,
                                            strict=StrictHandling.RAISE_UNEXPECTED)
        module.load_state_dict(state, strict=True)

    def _load_optimizer(self, model: TrainedModel, directory: str, fmt: str) -> None:
        module = model.module
        allocate_distributed_optimizer_state(model.optimizer)
        sharded = model.optimizer.sharded_state_dict(module.sharded_state_dict(), is_loading=True,
                                                     metadata=optimizer_metadata(fmt))
        with quiet_dist_checkpointing():
            loaded = dist_checkpointing.load(sharded, directory)
        with torch.no_grad():  # Megatron's dp_reshardable loader copies into parameter views
            model.optimizer.load_state_dict(loaded)
        fuse_torch_adam(model.optimizer)  # the saved param groups' flags replace the built ones
        restore_adam_steps(model.optimizer)
