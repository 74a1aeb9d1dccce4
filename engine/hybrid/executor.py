"""The hybrid engine executor: reshard the actor between training and generation layouts.

``HybridEngine(train_chunks, desc, train_groups, (tp_g, pp_g))`` builds, once, the
generation-layout ``GPTModel`` (no weights of its own) and the process groups of the
plan (:mod:`hyflow.hybrid.planner`). Then, as often as the trainer alternates:

* :meth:`to_generation` fills one flat generation buffer and points the generation
  model's parameters into it:

  1. *TP merge* — inside each group of the ``s = TP/TP_g`` consecutive TP ranks of a
     stage, an all-gather of every sharded parameter; the shards are laid out by the
     fix-up kernels of :mod:`hyflow.kernels` (gate/up de-interleave, row-parallel
     concatenation, plain concatenation) straight into the buffer. The transport
     (:mod:`hyflow.hybrid.transport`) is a collective per parameter (NCCL on GPU) or,
     for CPU ranks on one host, a shared-memory staging area. Replicated parameters
     (norms) are copied locally. The buffer faults in huge pages on CPU
     (:mod:`hyflow.hybrid.memory`).
  2. *PP merge* (when ``PP_g < PP``) — inside each group of ``p = PP/PP_g``
     consecutive stages with the same TP rank, each stage's generation shards reach the
     stages that need them: point-to-point sends (NCCL on GPU), or on one CPU host a
     shared-memory exchange (each rank publishes once, every peer copies what it takes).

  Then (``release_training_weights``) the training parameters' storage is freed: its
  contents are a slice of the generation buffer, so no rank holds more than one copy.
* :meth:`to_training` restores the training parameters from their slice of the
  generation buffer (a local copy: bit-identical) and frees the buffer.

Optimizer state is never read or changed; with ``offload_optimizer`` / ``offload_grad_buffers``
it (and the gradient buffers) leave device memory during generation
(:mod:`hyflow.hybrid.offload`) and come back bit for bit. Bytes received are measured and can be compared
with the plan (:attr:`plan`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from hyflow.hybrid.planner import (PP_STAGING_SLOT, STAGING_SLACK, GenerationShape, ReshardPlan,
                                   generation_enumerations, gpt_param_specs, plan_reshard)
from hyflow.hybrid.memory import advise_huge_pages, empty_buffer
from hyflow.hybrid.offload import OptimizerStateOffload
from hyflow.hybrid.transport import GatherItem, make_pp_exchange, make_transport
from hyflow.models.builder import build_gpt_model
from hyflow.models.description import ModelDescription
from hyflow.models.weights import _tp_slice, global_name
from hyflow.monitor import comm
from hyflow.parallel.groups import ParallelGroups, build_groups
from hyflow.parallel.layout import Layout, pad_vocab_size


@dataclass
class ReshardStats:
    """What one transition did on this rank."""

    seconds: float = 0.0
    bytes_received: int = 0
    generation_bytes: int = 0
    released_training_bytes: int = 0
    history: list = field(default_factory=list)


def _unwrap(model):
    return getattr(model, "module", model)


def _kind(param: torch.Tensor) -> str:
    if getattr(param, "partition_stride", 1) == 2:
        return "gate_up"
    return "row_concat" if param.partition_dim == 1 else "column_concat"


def _enumerate(groups) -> list[list[int]]:
    return sorted(sorted(g) for g in groups)


class HybridEngine:
    """Reshards one actor (a single model chunk) between two layouts on the same ranks."""

    def __init__(self, train_model: torch.nn.Module, desc: ModelDescription,
                 train_groups: ParallelGroups, generation: tuple[int, int] | GenerationShape, *,
                 dtype: str = "fp32", spec: str = "auto", release_training_weights: bool = True,
                 transport: str = "auto", staging_slot_bytes: int = 64 << 20,
                 optimizer=None, offload_grad_buffers: bool = False, offload_optimizer: bool = False):
        layout = train_groups.layout
        if layout.vpp or layout.cp > 1:
            raise ValueError("the hybrid engine reshards layouts without vpp or cp")
        self.desc = desc
        self.train_model = _unwrap(train_model)
        # During generation, optionally free the DDP gradient buffers (they are zeroed before
        # every step anyway; Megatron-Core's ``offload_grad_buffers``) and move the optimizer
        # state to host memory (:mod:`hyflow.hybrid.offload`).
        self._ddp = train_model if hasattr(train_model, "offload_grad_buffers") else None
        if offload_grad_buffers and self._ddp is None:
            raise ValueError("offload_grad_buffers needs the DDP-wrapped training model (wrap_ddp)")
        if offload_optimizer and optimizer is None:
            raise ValueError("offload_optimizer needs the training optimizer (optimizer=...)")
        self.offload_grads = offload_grad_buffers
        self._optimizer_offload = OptimizerStateOffload(optimizer, train_model.parameters()) \
            if offload_optimizer else None
        self.train_groups = train_groups
        self.gen_shape = generation if isinstance(generation, GenerationShape) else GenerationShape(*generation)
        self.padded_vocab = pad_vocab_size(desc.vocab_size, layout.tp)
        param_bytes = next(self.train_model.parameters()).element_size()
        specs = gpt_param_specs(desc.num_layers, desc.hidden_size, desc.num_attention_heads,
                                desc.num_query_groups, desc.head_dim, desc.ffn_hidden_size,
                                self.padded_vocab, tied_embeddings=desc.tied_embeddings,
                                qkv_bias=desc.qkv_bias, dtype_bytes=param_bytes)
        self.plan: ReshardPlan = plan_reshard(specs, layout, self.gen_shape)
        self.release_training_weights = release_training_weights
        self.s, self.p = self.plan.tp_ratio, self.plan.pp_ratio
        rank = dist.get_rank()
        tp, pp, _ = self.plan.train_coord(rank)
        self.t, self.l, self.stage = tp % self.s, pp % self.p, pp
        self._build_groups(rank)
        self.gen_model = build_gpt_model(desc, self.gen_groups, dtype=dtype, spec=spec,
                                         padded_vocab_size=self.padded_vocab,
                                         config_overrides={"perform_initialization": False})
        self._gen_params = dict(self.gen_model.named_parameters())
        self._gen_shapes = {n: tuple(p_.shape) for n, p_ in self._gen_params.items()}
        self._train_params = dict(self.train_model.named_parameters())
        self._map_parameters()
        # Staging slots never larger than what this group gathers (tiny models stay tiny).
        sharded = [self._train_params[local] for src, local in self._sources.values() if src == self.stage]
        total = sum(p_.numel() * p_.element_size() for p_ in sharded if getattr(p_, "tensor_model_parallel", False))
        slot = max(min(staging_slot_bytes, total + STAGING_SLACK), 4096)
        self.transport = make_transport(transport, self.tp_merge_group, self.tp_merge_ranks,
                                        next(self.train_model.parameters()).device, slot)
        # PP merge: the training stage of each rank of this rank's group, and for each the
        # generation parameters some other stage takes from it (what it publishes), fixed for the run.
        self._pp_stages = [self.plan.train_coord(r)[1] for r in self.pp_merge_ranks]
        self._pp_published = {q: self._published_by(q) for q in self._pp_stages}
        self.pp_exchange = None
        if self.p > 1:  # shared memory on one CPU host, else point to point
            published = sum(self._gen_numel(n) for n in self._pp_published[self.stage]) * param_bytes
            slot = max(min(staging_slot_bytes, PP_STAGING_SLOT, published + STAGING_SLACK), 4096)
            self.pp_exchange = make_pp_exchange(transport, self.pp_merge_group, self.pp_merge_ranks,
                                                next(self.train_model.parameters()).device, slot)
        for p_ in self._gen_params.values():
            p_.data = p_.data.new_empty(0)
        self._buffer: Optional[torch.Tensor] = None
        self._released: list[tuple[torch.UntypedStorage, int]] = []
        self.stats = ReshardStats()
        self.in_generation = False

    # ------------------------------------------------------------------ setup
    def _build_groups(self, rank: int) -> None:
        plan = self.plan
        enums = generation_enumerations(plan)
        tp_merge, pp_merge = enums["tp_merge"], enums["pp_merge"]
        self.tp_merge_group, _ = dist.new_subgroups_by_enumeration(tp_merge)
        self.tp_merge_ranks = next(g for g in tp_merge if rank in g)
        self.pp_merge_group, _ = dist.new_subgroups_by_enumeration(pp_merge)
        self.pp_merge_ranks = next(g for g in pp_merge if rank in g)
        comm.register_group(self.tp_merge_group, "reshard")
        comm.register_group(self.pp_merge_group, "reshard")
        gen_layout = Layout(tp=plan.gen.tp, pp=plan.gen.pp, dp=plan.gen_dp_size)
        tg, pg, dg = plan.gen_coord(rank)
        kinds = ("tp", "pp", "dp", "cp", "mp", "tp_cp", "dp_cp", "embd", "pos_embd")
        enumerations = {k: _enumerate(enums[k]) for k in kinds}
        self.gen_groups = build_groups(gen_layout, enumerations,
                                       coords={"tp": tg, "cp": 0, "dp": dg, "pp": pg})

    def _source(self, stage: int, holders: tuple[int, ...]) -> int:
        """Training stage a rank of ``stage`` takes a parameter from: its own if it holds
        it, else the first holder inside its generation stage's block."""
        if stage in holders:
            return stage
        return next(q for q in holders if q // self.p == stage // self.p)

    def _holders(self, name: str) -> tuple[tuple[int, ...], str]:
        """Training stages holding generation parameter ``name``, and its global name."""
        L, PP = self.desc.num_layers, self.train_groups.layout.pp
        pg = self.plan.gen_coord(dist.get_rank())[1]
        g = global_name(name, pg * (L // self.plan.gen.pp))
        tied = self.desc.tied_embeddings
        if g.startswith("decoder.layers."):
            return (int(g.split(".")[2]) // (L // PP),), g
        if g == "embedding.word_embeddings.weight" or (g == "output_layer.weight" and tied):
            return ((0, PP - 1) if tied else (0,)), g
        return (PP - 1,), g  # final norm, untied output layer

    def _map_parameters(self) -> None:
        """For every generation parameter: its source stage and training-local name."""
        per_train = self.desc.num_layers // self.train_groups.layout.pp
        PP = self.train_groups.layout.pp
        self._sources: dict[str, tuple[int, str]] = {}
        for name in self._gen_params:
            holders, g = self._holders(name)
            src = self._source(self.stage, holders)
            if g.startswith("decoder.layers."):
                layer = int(g.split(".")[2])
                local = g.replace(f"decoder.layers.{layer}.", f"decoder.layers.{layer - src * per_train}.", 1)
            elif holders == (0, PP - 1) and PP > 1:  # tied embedding: the last stage's copy
                local = "embedding.word_embeddings.weight" if src == 0 else "output_layer.weight"
            else:
                local = g
            self._sources[name] = (src, local)

    # ------------------------------------------------------------ transitions
    @torch.no_grad()
    def to_generation(self) -> torch.nn.Module:
        """Fill the generation buffer and return the generation-layout model."""
        if self.in_generation:
            return self.gen_model
        start = time.perf_counter()
        received = 0
        numel = sum(self._gen_numel(n) for n in self._gen_params)
        dtype = next(iter(self._train_params.values())).dtype
        self._buffer = empty_buffer(numel, dtype, next(iter(self._train_params.values())).device)
        views, offset = {}, 0
        for name in self._gen_params:
            n = self._gen_numel(name)
            views[name] = self._buffer[offset:offset + n].view(self._gen_shapes[name])
            offset += n
        # 1. TP merge of the parameters this rank's own stage holds: replicated ones are
        #    copied, sharded ones all-gathered by the transport (with their fix-ups).
        items = []
        for name, (src, local) in self._sources.items():
            if src != self.stage:
                continue
            param = self._train_params[local].detach()
            if getattr(self._train_params[local], "tensor_model_parallel", False) and self.s > 1:
                items.append(GatherItem(param, _kind(self._train_params[local]), views[name]))
            else:
                views[name].copy_(param)
        with comm.transfer("all_gather", self.tp_merge_group) as xfer:  # shared memory or collectives
            xfer.nbytes = self.transport.gather(items)
        received += xfer.nbytes
        # 2. PP merge: point-to-point from the stage that holds each parameter.
        if self.p > 1:
            with comm.transfer("p2p", self.pp_merge_group) as xfer:
                xfer.nbytes = self._pp_merge(views)
            received += xfer.nbytes
        for name, param in self._gen_params.items():
            param.data = views[name]
        self._views = views
        if self._optimizer_offload is not None:  # first: it must tell the weights' storage apart
            self._optimizer_offload.offload()
        if self.offload_grads:
            self._ddp.offload_grad_buffers()
        if self.release_training_weights:
            self._release_training()
        self.in_generation = True
        self.stats = ReshardStats(seconds=time.perf_counter() - start, bytes_received=received,
                                  generation_bytes=self._buffer.numel() * self._buffer.element_size(),
                                  released_training_bytes=sum(n for _, n in self._released),
                                  history=self.stats.history + [("to_generation", time.perf_counter() - start)])
        return self.gen_model

    @torch.no_grad()
    def to_training(self) -> None:
        """Restore the training parameters (if released) and free the generation buffer."""
        if not self.in_generation:
            return
        start = time.perf_counter()
        if self._optimizer_offload is not None:
            self._optimizer_offload.restore()
        if self.offload_grads:
            self._ddp.restore_grad_buffers()
        if self._released:
            for storage, nbytes in self._released:
                storage.resize_(nbytes)
                advise_huge_pages(storage)  # before the first touch (see hyflow.hybrid.memory)
                torch.empty(0, dtype=torch.uint8).set_(storage).zero_()  # no stale bytes in padding
            for name, (src, local) in self._sources.items():
                if src == self.stage:
                    param = self._train_params[local]
                    param.copy_(_tp_slice(self._views[name], param, self.t, self.s))
            self._restore_unmapped()
            self._released = []
        for param in self._gen_params.values():
            param.data = param.data.new_empty(0)
        self._buffer, self._views = None, {}
        self.in_generation = False
        self.stats.history.append(("to_training", time.perf_counter() - start))

    # ---------------------------------------------------------------- helpers
    def _gen_numel(self, name: str) -> int:
        n = 1
        for d in self._gen_shapes[name]:
            n *= d
        return n

    def _published_by(self, stage: int) -> list[str]:
        """Generation parameters some other stage of the PP-merge group takes from ``stage``."""
        return [n for n in self._gen_params
                if any(self._source(q, self._holders(n)[0]) == stage for q in self._pp_stages if q != stage)]

    def _pp_merge(self, views: dict[str, torch.Tensor]) -> int:
        """Exchange generation shards between the stages of this rank's generation stage."""
        group_stages = self._pp_stages
        if self.pp_exchange is not None:  # each rank publishes what any peer takes from its stage
            nbytes = self._buffer.element_size()
            receive = {j: [(views[n] if self._sources[n][0] == stage else None, self._gen_numel(n) * nbytes)
                           for n in self._pp_published[stage]]
                       for j, stage in enumerate(group_stages) if stage != self.stage}
            return self.pp_exchange.exchange([views[n] for n in self._pp_published[self.stage]], receive)
        ops, received = [], 0
        for peer, stage in zip(self.pp_merge_ranks, group_stages):
            if stage == self.stage:
                continue
            needs = [n for n, (src, _) in self._sources.items() if src == stage]
            if needs:  # receive what this rank takes from the peer's stage
                buf = torch.empty(sum(views[n].numel() for n in needs), dtype=self._buffer.dtype)
                ops.append((dist.P2POp(dist.irecv, buf, peer), needs, buf))
                received += buf.numel() * buf.element_size()
            sends = self._peer_needs(stage)
            if sends:
                payload = torch.cat([views[n].reshape(-1) for n in sends])
                ops.append((dist.P2POp(dist.isend, payload, peer), None, payload))
        if ops:
            for req in dist.batch_isend_irecv([op for op, _, _ in ops]):
                req.wait()
        for _, needs, buf in ops:
            if needs is None:
                continue
            offset = 0
            for n in needs:
                k = views[n].numel()
                views[n].copy_(buf[offset:offset + k].view_as(views[n]))
                offset += k
        return received

    def _peer_needs(self, peer_stage: int) -> list[str]:
        """Generation parameters a peer stage takes from this rank's stage, in order
        (every stage of the block builds the same generation stage: same names)."""
        return [n for n in self._gen_params if self._source(peer_stage, self._holders(n)[0]) == self.stage]

    def _release_training(self) -> None:
        """Free the training parameters' storage (their values live in the buffer)."""
        mapped = {local for src, local in self._sources.values() if src == self.stage}
        self._unmapped = {n: p.detach().clone() for n, p in self._train_params.items() if n not in mapped}
        seen, released = set(), []
        for param in self._train_params.values():
            storage = param.untyped_storage()
            key = storage.data_ptr()
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            released.append((storage, storage.nbytes()))
        for storage, _ in released:
            storage.resize_(0)
        self._released = released

    def _restore_unmapped(self) -> None:
        for name, value in getattr(self, "_unmapped", {}).items():
            self._train_params[name].copy_(value)
        self._unmapped = {}
