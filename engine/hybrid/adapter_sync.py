"""Adapter-only transitions of the hybrid engine for a LoRA actor (:mod:`hyflow.models.lora`).

The base weights never change, so they reach the generation layout once: the first
:meth:`HybridEngine.to_generation` runs the full reshard, and the generation buffer then keeps
the base for the whole run. Every transition after that moves the adapters only (a few MiB
where the weights are GiB), through the same plan arithmetic, groups and transports as the
weights: the adapters are parameters of their own to the planner (:func:`adapter_param_specs`),
sharded like their base layer (a column layer's ``B`` rows as its weight's rows, fused layouts
included; a row layer's ``A`` columns as its weight's columns; the other factor replicated), so
the TP merge's fix-ups lay them out in the generation layout exactly as the base shards there.
In the generation layout each weight is then merged in place, ``W_gen += s B_gen A_gen``
(:class:`~hyflow.models.lora.MergedWeight`), and unmerged bit for bit on the way back, so the
buffer holds the base again (and the training weights, when the engine released them, are
refilled from it unchanged). With identical layouts the generation model shares the training
weights and the merge happens in them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hyflow.hybrid.param_specs import ParamSpec, ReshardPlanError, model_param_specs
from hyflow.hybrid.reshard_plan import plan_reshard
from hyflow.hybrid.reshard_table import VIA_COPY, VIA_TP_MERGE, rank_table
from hyflow.hybrid.transport import GatherItem
from hyflow.models.lora import TARGET_PATHS, MergedWeight, lora_config_of
from hyflow.models.lora_config import LoRAConfig
from hyflow.monitor import comm


def adapter_param_specs(desc, lora: LoRAConfig, dtype_bytes: int) -> list[ParamSpec]:
    """The adapters of ``desc``'s targeted layers as the reshard planner's parameters (global
    layer numbering): ``lora_A`` / ``lora_B`` sharded like their base weight's columns / rows."""
    base = {sp.name: sp for sp in model_param_specs(desc, desc.vocab_size, dtype_bytes)}
    r, out = lora.rank, []
    for i in range(desc.num_layers):
        for target in lora.targets:
            sp = base[f"decoder.layers.{i}.{TARGET_PATHS[target]}.weight"]
            rows, cols = sp.global_shape
            name = sp.name[:-len("weight")]
            split = dict(shard_units=sp.shard_units, unit_name=sp.unit_name, layer=i)
            if sp.tp_kind == "column":
                out += [ParamSpec(name + "lora_A", (r, cols), dtype_bytes, layer=i),
                        ParamSpec(name + "lora_B", (rows, r), dtype_bytes, tp_kind="column", fixup=sp.fixup, **split)]
            else:
                out += [ParamSpec(name + "lora_A", (r, cols), dtype_bytes, tp_kind="row", fixup="row_concat", **split),
                        ParamSpec(name + "lora_B", (rows, r), dtype_bytes, layer=i)]
    return out


class AdapterSync:
    """The adapters' part of one :class:`~hyflow.hybrid.executor.HybridEngine`'s transitions (its
    plan's layouts, groups and transports; a small persistent buffer of generation-layout adapters)."""

    def __init__(self, engine) -> None:
        lora = lora_config_of(engine.train_model)
        first = next(engine.train_model.parameters())
        specs = adapter_param_specs(engine.desc, lora, first.element_size())
        self.plan = plan_reshard(specs, engine.plan.train, engine.gen_layout, num_layers=engine.desc.num_layers)
        table = rank_table(self.plan, dist.get_rank())
        if (table.tp_merge_ranks, table.pp_merge_ranks) != (engine.table.tp_merge_ranks, engine.table.pp_merge_ranks):
            raise ReshardPlanError("the adapters' reshard plan groups other ranks than the weights' plan")
        train = dict(engine.train_model.named_parameters())
        gen = dict(engine.gen_model.named_parameters())
        missing = [r.train_name for r in table.own_routes if r.train_name not in train]
        missing += [r.gen_name.replace("lora_B", "weight") for r in table.routes
                    if r.gen_name.endswith("lora_B") and r.gen_name.replace("lora_B", "weight") not in gen]
        if missing:
            raise ReshardPlanError(f"the adapters' reshard table names parameters the models lack: {missing[:4]}")
        self.engine, self.itemsize = engine, first.element_size()
        self.buffer = torch.zeros(table.numel, dtype=first.dtype, device=first.device)
        views = {r.gen_name: self.buffer[r.offset:r.offset + r.numel].view(r.shape) for r in table.routes}
        own = table.own_routes
        self._copies = [(train[r.train_name], views[r.gen_name]) for r in own if r.via == VIA_COPY]
        self._gathers = [GatherItem(train[r.train_name], r.fixup, views[r.gen_name])
                         for r in own if r.via == VIA_TP_MERGE]
        self._publish = [(views[n], takers) for n, takers in table.pp_publish]
        self._receive = {j: [(views[n] if n else None, k * self.itemsize) for n, k in stream]
                         for j, stream in table.pp_receive}
        self.merges = [MergedWeight(gen[n.replace("lora_B", "weight")], views[n.replace("lora_B", "lora_A")], views[n],
                                    lora.scale) for n in views if n.endswith("lora_B")]
        self.base_ready = False  # the generation buffer holds the base (after the first transition)
        self.merged = False

    @property
    def nbytes(self) -> int:
        """This rank's generation-layout adapters."""
        return self.buffer.numel() * self.itemsize

    @torch.no_grad()
    def to_generation(self) -> int:
        """Bring the adapters to the generation layout and merge them into the generation weights
        (which hold the base); returns the bytes received from other ranks."""
        engine = self.engine
        for param, view in self._copies:
            view.copy_(param.detach())
        with comm.transfer("all_gather", engine.tp_merge_group) as xfer:
            xfer.nbytes = received = engine.transport.gather(self._gathers)
        if engine.pp_exchange is not None:
            with comm.transfer("p2p", engine.pp_merge_group) as xfer:
                xfer.nbytes = engine.pp_exchange.exchange(self._publish, self._receive)
            received += xfer.nbytes
        for merge in self.merges:
            merge.merge()
        self.merged = self.base_ready = True
        return received

    @torch.no_grad()
    def to_training(self) -> None:
        """Unmerge, bit for bit: the generation weights hold the base again."""
        if self.merged:
            for merge in self.merges:
                merge.unmerge()
            self.merged = False
