"""The models of a preference run: the trained policy, and the frozen reference's log-probs.

The reference is the starting actor (``actor.checkpoint``, or the random initialisation of
``model`` with ``trainer.seed``), built from that source rather than copied from the actor, so
it is the same whether a run starts fresh or resumes. It gives sequence log-probs in one of
three ways (:class:`ReferenceLogps`):

* ``reference_free``: zeros (DPO against a uniform reference), no model;
* per batch: a frozen model in the actor's layout scores each step's rows;
* ``precompute_ref_logprobs``: the frozen model scores the whole dataset once (each data-parallel
  rank its share), every rank keeps the table (two floats per record), the model is freed, and
  the table is cached in ``<output_dir>/checkpoints/reference_logps.pt`` under a fingerprint of
  the dataset's token ids and the reference's source, so a resumed (or repeated) run loads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from hyflow.checkpoint.model import CHECKPOINT_INFO_FILE, adapter_base
from hyflow.checkpoint.starting_weights import load_starting_weights, starting_description
from hyflow.data.preference import PreferenceDataset, sequence_tensors
from hyflow.jobs.preference_losses import score_sequences
from hyflow.models.builder import build_gpt_model
from hyflow.models.description import ModelDescription
from hyflow.models.lora import BaseModelView, apply_lora, has_adapters, lora_spec
from hyflow.models.weights import load_full_state_dict, random_full_state_dict
from hyflow.parallel.groups import ParallelGroups, init_training_groups
from hyflow.rl.batch import pad_multiple
from hyflow.training.optimizer import build_optimizer, wrap_ddp

CACHE_FILE = "reference_logps.pt"
CACHE_FORMAT = "hyflow-reference-logps"


def micro_batches(tensors: dict[str, torch.Tensor], rows: Sequence[int], size: int) -> list[dict[str, torch.Tensor]]:
    """The rows ``rows`` of every [B, ...] tensor in micro-batches of ``size`` rows (a pair's two
    rows are adjacent, so an even ``size`` never splits a pair)."""
    if len(rows) % size:
        raise ValueError(f"{len(rows)} rows do not split into micro-batches of {size}")
    device = next(iter(tensors.values())).device
    out = []
    for start in range(0, len(rows), size):
        idx = torch.as_tensor(rows[start:start + size], device=device)
        out.append({k: v[idx] for k, v in tensors.items()})
    return out


@dataclass
class Policy:
    """The trained actor of one rank: DDP-wrapped chunks, optimizer, LR scheduler."""

    desc: ModelDescription
    groups: ParallelGroups
    chunks: list
    optimizer: Any
    scheduler: Any
    vocab_size: int  # log-probs are normalised over the model's real vocabulary (as its HF twin's)


def _recompute(kind: str) -> dict:
    if kind == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if kind == "selective":
        return {"recompute_granularity": "selective"}
    return {}


def _load_initial(cfg, model: torch.nn.Module, desc: ModelDescription, groups: ParallelGroups,
                  write_cache: bool = True) -> None:
    """The starting weights: ``actor.checkpoint`` (a hyflow checkpoint or an HF model), or ``model``'s
    random init with ``trainer.seed``."""
    if cfg.actor.checkpoint:
        load_starting_weights(model, cfg.actor.checkpoint, groups, desc, cfg.actor.checkpoint_cache, write_cache)
    else:
        load_full_state_dict(model, random_full_state_dict(desc, cfg.trainer.seed), desc, groups)


def build_policy(cfg, tokenizer) -> Policy:
    """Groups, the actor at its starting weights, its optimizer and LR schedule."""
    layout = cfg.actor_layout(dist.get_world_size())
    groups = init_training_groups(layout, seed=cfg.trainer.seed)
    desc = starting_description(cfg.actor.checkpoint) if cfg.actor.checkpoint else cfg.model
    if desc.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"the model's vocabulary ({desc.vocab_size}) is smaller than the tokenizer's "
                         f"({tokenizer.vocab_size}); use a model/tokenizer pair that match")
    actor = build_gpt_model(desc, groups, dtype=cfg.actor.dtype, spec=lora_spec(cfg.actor.spec, cfg.actor.lora),
                            config_overrides=_recompute(cfg.actor.recompute))
    _load_initial(cfg, actor, desc, groups)
    if cfg.actor.lora is not None:  # the base is frozen: DDP and the optimizer see the adapters only
        apply_lora(actor, cfg.actor.lora, seed=cfg.trainer.seed, base=adapter_base(cfg.actor.checkpoint, cfg.trainer.seed))
    chunks = wrap_ddp([actor], groups, cfg.actor.optim.distributed_optimizer)
    optimizer, scheduler = build_optimizer(chunks, cfg.actor.optim, cfg.trainer.total_steps,
                                           actor.config.params_dtype)
    return Policy(desc, groups, chunks, optimizer, scheduler, desc.vocab_size)


def build_reference_model(cfg, policy: Policy) -> torch.nn.Module:
    """A frozen, eval-mode copy of the starting actor in the actor's layout; for a LoRA policy its
    base with the adapters off (no copy)."""
    if has_adapters(policy.chunks):
        return BaseModelView(policy.chunks[0])
    model = build_gpt_model(policy.desc, policy.groups, dtype=cfg.actor.dtype, spec=cfg.actor.spec,
                            config_overrides={"perform_initialization": False})
    _load_initial(cfg, model, policy.desc, policy.groups, write_cache=False)
    model.requires_grad_(False)
    model.eval()
    return model


def record_sequences(record, kind: str) -> list[tuple[list[int], list[int]]]:
    """The two scored sequences of a record: DPO chosen, rejected; KTO completion, KL pair."""
    if kind == "dpo":
        return record.sequences()
    return [(record.prompt_ids, record.completion_ids), (record.prompt_ids, record.kl_completion_ids)]


class ReferenceLogps:
    """Sequence log-probs of the reference (see the module docstring)."""

    def __init__(self, model: Optional[torch.nn.Module] = None, table: Optional[torch.Tensor] = None,
                 free: bool = False) -> None:
        self.model, self.table, self.free = model, table, free

    def for_rows(self, records: Sequence, micro: Optional[list], column: Optional[int], policy: Policy,
                 n_rows: int) -> torch.Tensor:
        """[n_rows] log-probs of ``records``' rows: both sequences of each record interleaved
        (``column=None``), or one column of each (0: DPO chosen / KTO completion, 1: rejected / KL).
        ``micro`` are those rows' micro-batches, scored when the reference is a model."""
        device = policy.groups.device
        if self.free:
            return torch.zeros(n_rows, dtype=torch.float32, device=device)
        if self.table is not None:
            uids = torch.tensor([r.uid for r in records], dtype=torch.long, device=self.table.device)
            picked = self.table[uids] if column is None else self.table[uids, column]
            return picked.reshape(-1).to(device)
        return score_sequences([self.model], micro, policy.vocab_size, policy.groups)

    @classmethod
    def build(cls, cfg, policy: Policy, dataset: PreferenceDataset, checkpoints_root: str,
              log: Callable[[str], None]) -> "ReferenceLogps":
        """The job's reference: free, a frozen model, or the precomputed table (loaded from the
        cache when its fingerprint matches, else computed and cached)."""
        algo = cfg.algorithm
        if getattr(algo, "reference_free", False):
            return cls(free=True)
        if not algo.precompute_ref_logprobs:
            return cls(model=build_reference_model(cfg, policy))
        path = os.path.join(checkpoints_root, CACHE_FILE)
        fingerprint = reference_fingerprint(cfg, policy, dataset)
        ok = [dist.get_rank() == 0 and _cache_matches(path, fingerprint)]
        dist.broadcast_object_list(ok, src=0)  # start-up only: one rank decides for all
        if ok[0]:
            table = torch.load(path, map_location="cpu", weights_only=True)["logps"]
            log(f"[hyflow] reference log-probs of {len(dataset)} records loaded from {path}")
            return cls(table=table)
        model = build_reference_model(cfg, policy)
        table = precompute(model, dataset, policy, cfg.actor.micro_batch_size, log)
        del model
        if dist.get_rank() == 0:
            os.makedirs(checkpoints_root, exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"
            torch.save({"format": CACHE_FORMAT, "fingerprint": fingerprint, "logps": table}, tmp)
            os.replace(tmp, path)
            log(f"[hyflow] reference log-probs cached in {path}")
        dist.barrier()
        return cls(table=table)


def reference_fingerprint(cfg, policy: Policy, dataset: PreferenceDataset) -> str:
    """What the precomputed table depends on: the dataset's token ids, the reference's weights
    (checkpoint path and its info file, or the random init's description and seed) and dtype."""
    source: dict[str, Any] = {"dtype": cfg.actor.dtype, "kind": dataset.kind, "vocab": policy.vocab_size}
    if cfg.actor.checkpoint:
        info = os.path.join(cfg.actor.checkpoint, CHECKPOINT_INFO_FILE)
        with open(info, "rb") as f:
            source["checkpoint"] = [os.path.abspath(cfg.actor.checkpoint), hashlib.sha256(f.read()).hexdigest()]
    else:
        source["random_init"] = [policy.desc.to_dict(), cfg.trainer.seed]
    text = json.dumps(source, sort_keys=True) + dataset.fingerprint()
    return hashlib.sha256(text.encode()).hexdigest()


def _cache_matches(path: str, fingerprint: str) -> bool:
    if not os.path.exists(path):
        return False
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - a torn or foreign file: recompute
        return False
    return isinstance(data, dict) and data.get("format") == CACHE_FORMAT and data.get("fingerprint") == fingerprint


@torch.no_grad()
def precompute(model: torch.nn.Module, dataset: PreferenceDataset, policy: Policy, micro_size: int,
               log: Callable[[str], None], micro_per_call: int = 8) -> torch.Tensor:
    """[len(dataset), 2] reference log-probs of every record's two sequences, on every rank.

    Data-parallel rank r scores records ``r::dp`` (sorted by length, so few pads), in forwards
    of up to ``micro_per_call`` micro-batches; the shares are all-gathered over the DP group."""
    groups = policy.groups
    dp, rank = groups.layout.dp, groups.dp_rank
    mine = list(range(rank, len(dataset), dp))
    per = -(-len(dataset) // dp)
    mine += [mine[-1]] * (per - len(mine))  # equal shares for the all-gather (the dataset holds >= dp records)
    order = sorted(range(per), key=lambda k: sum(len(p) + len(c) for p, c in record_sequences(dataset[mine[k]],
                                                                                                 dataset.kind)))
    local = torch.zeros(per, 2, dtype=torch.float32, device=groups.device)
    block = micro_size * micro_per_call
    start, last_report = time.perf_counter(), 0.0
    for b in range(0, per, block):
        ks = order[b:b + block]
        ks = ks + [ks[i % len(ks)] for i in range((-len(ks)) % micro_size)]  # whole micro-batches (repeats scored twice)
        rows = [s for k in ks for s in record_sequences(dataset[mine[k]], dataset.kind)]
        tensors = sequence_tensors(rows, 0, groups.device, multiple=pad_multiple(groups))  # right padding: any id
        micro = micro_batches(tensors, list(range(len(rows))), 2 * micro_size)
        scores = score_sequences([model], micro, policy.vocab_size, groups).view(-1, 2)
        local[torch.tensor(ks, dtype=torch.long, device=groups.device)] = scores
        done = min(b + block, per)
        if time.perf_counter() - last_report > 10 or done == per:
            last_report = time.perf_counter()
            log(f"[hyflow] reference log-probs: {done * dp}/{per * dp} records "
                f"({time.perf_counter() - start:.0f}s)")
    gathered = [torch.empty_like(local) for _ in range(dp)]
    dist.all_gather(gathered, local, group=groups.pgs.dp)
    table = torch.empty(len(dataset), 2, dtype=torch.float32, device=groups.device)
    for r, part in enumerate(gathered):
        idx = list(range(r, len(dataset), dp))
        table[torch.tensor(idx, dtype=torch.long, device=groups.device)] = part[:len(idx)]
    return table.cpu()
