"""The hybrid engine executor: reshard the actor between training and generation layouts.

``HybridEngine(train_model, desc, train_groups, (tp_g, pp_g))`` plans the reshard once
(:mod:`hyflow.hybrid.reshard_plan`), takes this rank's table from the plan
(:mod:`hyflow.hybrid.reshard_table`), creates the generation groups
(:func:`hyflow.hybrid.generation_groups.build_generation_groups`) and the generation-layout
``GPTModel``, whose parameters are views of one flat generation buffer
(:class:`hyflow.hybrid.generation_buffer.GenerationBuffer`) for the whole run. The executor runs the
table and decides nothing itself: every route names its generation parameter, the training
parameter that supplies it and how the bytes come.

:meth:`to_generation`, in the order that keeps the peak low:

1. optimizer state to host and gradient buffers freed (``offload_optimizer`` /
   ``offload_grad_buffers``, :mod:`hyflow.hybrid.offload`), *before* anything is allocated;
2. the generation buffer takes its memory back;
3. the table's routes: local copies; the *TP merge*, a bucketed all-gather inside each group
   of ``s = TP/TP_g`` ranks with the layout fix-ups (:mod:`hyflow.hybrid.transport`: NCCL/gloo
   collectives, or shared memory for CPU ranks on one host); the *PP merge* (``PP_g < PP``),
   each stage's generation shards to the stages that take them (point to point, or shared
   memory on one CPU host);
4. the training parameters' storage is freed (``release_training_weights``): their values are
   a slice of the buffer, so no rank holds two copies.

:meth:`to_training` undoes it in reverse: training weights re-grown and refilled from their
slice of the buffer (bit-identical), the buffer's memory given back, then gradient buffers
and optimizer state restored. Bytes received are measured and can be compared with the plan.

A mixture-of-experts actor's routed experts are not in the table: they live on the expert grid
and reach the generation model (every expert on every replica) through
:class:`hyflow.hybrid.expert_exchange.ExpertExchange`, into a buffer of their own; the training
experts are kept aside while generating (they are not a slice of what the rank generates with).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Collection, Optional

import torch
import torch.distributed as dist
from megatron.core.utils import unwrap_model

from hyflow.hybrid.adapter_sync import AdapterSync
from hyflow.hybrid.expert_exchange import ExpertExchange, plan_expert_exchange, same_expert_grid
from hyflow.hybrid.generation_groups import build_generation_groups
from hyflow.hybrid.generation_buffer import GenerationBuffer, advise_huge_pages
from hyflow.hybrid.offload import OptimizerStateOffload
from hyflow.hybrid.param_specs import ReshardPlanError, model_param_specs
from hyflow.hybrid.reshard_plan import PP_STAGING_SLOT, TP_STAGING_SLOT, ReshardPlan, plan_reshard
from hyflow.hybrid.reshard_plan import staging_slot_bytes as fit_slot
from hyflow.hybrid.reshard_table import VIA_COPY, VIA_TP_MERGE, RankTable, rank_table
from hyflow.hybrid.transport import GatherItem, make_pp_exchange, make_transport
from hyflow.kernels import take_shard
from hyflow.models.builder import build_gpt_model, resolve_spec
from hyflow.models.description import ModelDescription
from hyflow.models.lora import has_adapters
from hyflow.models.weights import is_expert_param
from hyflow.monitor import comm
from hyflow.parallel.groups import ParallelGroups
from hyflow.parallel.layout import pad_vocab_size
from hyflow.roles import WeightPathCapabilities


@dataclass
class ReshardStats:
    """What one transition did on this rank."""

    seconds: float = 0.0
    bytes_received: int = 0
    generation_bytes: int = 0
    released_training_bytes: int = 0
    history: list = field(default_factory=list)


def exact_generation_forward(train_tp: int, sequence_parallel: bool, gen_tp: int) -> bool:
    """Whether a generation-layout forward reproduces the training forward bit for bit: the
    generation TP equals the training TP (pipeline and micro-DP changes do not matter: stages pass
    hidden states unchanged) and the training forward does not use sequence parallelism (its
    reduce-scatter / all-gather pairs replace the generation model's all-reduces: another
    summation order beyond two ranks)."""
    return gen_tp == train_tp and (train_tp == 1 or not sequence_parallel)


class HybridEngine:
    """Reshards one actor (a single model chunk) between two layouts on the same ranks: the
    colocated :class:`~hyflow.roles.WeightPath`.

    ``table`` replaces this rank's reshard table (default: the plan's); the engine checks that
    it describes the two models and then follows it.
    """

    @classmethod
    def capabilities_for(cls, cfg) -> WeightPathCapabilities:
        """What the engine :func:`hyflow.rl.models.build_rl_models` builds for the RL config
        ``cfg`` can do (with ``rollout.force_staleness`` it is built with a buffer of its own)."""
        train = cfg.actor.layout
        return WeightPathCapabilities(
            generation_model=True, stale_weights=True,
            exact_in_generation_layout=cfg.actor.lora is None and exact_generation_forward(
                train.tp, train.sequence_parallel, cfg.rollout.layout.tp))

    def __init__(self, train_model: torch.nn.Module, desc: ModelDescription,
                 train_groups: ParallelGroups, generation: tuple[int, int] | Any, *,
                 dtype: str = "fp32", spec: str = "auto", release_training_weights: bool = True,
                 transport: str = "auto", staging_slot_bytes: int = TP_STAGING_SLOT,
                 optimizer=None, offload_grad_buffers: bool = False, offload_optimizer: bool = False,
                 table: Optional[RankTable] = None, in_place: bool = True):
        layout = train_groups.layout
        if layout.vpp:
            raise ValueError("the hybrid engine reshards layouts without vpp")
        self.desc = desc
        self.train_model = unwrap_model(train_model)
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
        self.release_training_weights = release_training_weights
        first = next(self.train_model.parameters())
        self.device, self.dtype = first.device, first.dtype
        self.padded_vocab = pad_vocab_size(desc.vocab_size, layout.tp)
        specs = model_param_specs(desc, self.padded_vocab, first.element_size(),
                                  fused_norms=resolve_spec(spec) == "te")
        # for the weights CP is more data parallelism (the generation layout has no CP)
        self.plan: ReshardPlan = plan_reshard(specs, layout.cp_as_dp(), generation, num_layers=desc.num_layers)
        self.gen_layout = self.plan.gen  # the generation layout (tp, pp; dp = DP x micro-DP)
        rank = dist.get_rank()
        self.table: RankTable = table if table is not None else rank_table(self.plan, rank)
        groups = build_generation_groups(self.plan, rank, experts=desc.is_moe)
        self.gen_groups = groups.layout
        self.tp_merge_group, self.tp_merge_ranks = groups.tp_merge, groups.tp_merge_ranks
        self.pp_merge_group, self.pp_merge_ranks = groups.pp_merge, groups.pp_merge_ranks
        # Built without storage: every parameter is then pointed at the buffer (or at the training
        # weights), so start-up never holds the generation weights twice (hyflow plan's start-up phase).
        self.gen_model = build_gpt_model(desc, self.gen_groups, dtype=dtype, spec=spec,
                                         padded_vocab_size=self.padded_vocab, meta=True)
        self._train_params = dict(self.train_model.named_parameters())
        gen_params = dict(self.gen_model.named_parameters())
        gen_experts = {n: p for n, p in gen_params.items() if is_expert_param(n)}  # the expert exchange's
        gen_params = {n: p for n, p in gen_params.items() if n not in gen_experts}
        _check_table(self.table, gen_params, self._train_params)

        # Identical layouts (every route a same-shape copy of this rank's own parameter): the
        # generation model reads the training weights themselves, so a transition moves nothing.
        self.in_place = in_place and _aliasable(self.table, gen_params, self._train_params)
        if self.in_place:
            bind_parameters(self.gen_model, {r.gen_name: self._train_params[r.train_name].detach()
                                             for r in self.table.routes}, pending=gen_experts)
            self.release_training_weights = False
        # Otherwise the generation model's parameters are views of the buffer for the whole run.
        self.buffer = GenerationBuffer(0 if self.in_place else self.table.numel, self.dtype, self.device)
        routes = () if self.in_place else self.table.routes
        flat = self.buffer.acquire()
        self._views = {r.gen_name: flat[r.offset:r.offset + r.numel].view(r.shape) for r in routes}
        if self._views:
            bind_parameters(self.gen_model, self._views, pending=gen_experts)
        self.buffer.release()
        self.expert_exchange, self.expert_buffer = self._experts(desc, layout, gen_experts, in_place)
        self.planned_bytes_received = self.plan.bytes_recv[rank] + (
            self.expert_exchange.plan.recv_bytes(rank) if self.expert_exchange is not None else 0)

        # What a transition does, read off the table once.
        own = () if self.in_place else self.table.own_routes
        self._copies = [(self._train_params[r.train_name], self._views[r.gen_name])
                        for r in own if r.via == VIA_COPY]
        self._gathers = [GatherItem(self._train_params[r.train_name], r.fixup, self._views[r.gen_name])
                         for r in own if r.via == VIA_TP_MERGE]
        self._restores = [(self._train_params[r.train_name], self._views[r.gen_name], r.fixup, r.via)
                          for r in own]
        itemsize = first.element_size()
        self._publish = [(self._views[n], takers) for n, takers in self.table.pp_publish]
        self._receive = {j: [(self._views[n] if n else None, k * itemsize) for n, k in stream]
                         for j, stream in self.table.pp_receive}
        gathered = sum(it.shard.numel() * itemsize for it in self._gathers)
        self.transport = make_transport(transport, self.tp_merge_group, self.tp_merge_ranks, self.device,
                                        fit_slot(gathered, staging_slot_bytes))
        self.pp_exchange = None
        if self.table.pp_merge_size > 1:
            published = sum(v.numel() * itemsize for v, _ in self._publish)
            self.pp_exchange = make_pp_exchange(
                transport, self.pp_merge_group, self.pp_merge_ranks, self.device,
                fit_slot(published, min(staging_slot_bytes, PP_STAGING_SLOT)))
        self._released: list[tuple[torch.UntypedStorage, int]] = []
        self._unmapped: dict[str, torch.Tensor] = {}
        self.stats = ReshardStats()
        self.in_generation = False
        # A LoRA actor: the base reaches the generation buffer once, transitions move the adapters
        # and merge them there (hyflow.hybrid.adapter_sync); the merged weights are not the training
        # forward's arithmetic, so no generation-layout forward is exact.
        self.adapters = AdapterSync(self) if has_adapters(self.train_model) else None
        self.capabilities = WeightPathCapabilities(
            generation_model=True, stale_weights=not self.in_place,
            exact_in_generation_layout=self.adapters is None and exact_generation_forward(
                layout.tp, layout.sequence_parallel, self.gen_layout.tp))

    def describe(self) -> str:
        """One line: the two layouts and the micro-DP replicas per model copy."""
        line = (f"actor training {self.train_groups.layout.describe()} -> generation tp={self.gen_layout.tp} "
                f"pp={self.gen_layout.pp} with {self.plan.micro_dp_size} micro-DP replicas per model copy")
        if self.adapters is not None:
            line += (f"; LoRA: transitions move the adapters only ({self.adapters.plan.model_bytes / 2**20:.2f} MiB "
                     f"vs {self.plan.model_bytes / 2**20:.1f} MiB of weights), merged in the generation layout")
        return line

    def generation_weights(self) -> Optional[torch.Tensor]:
        """The flat buffer the generation model's parameters view (None when they alias the
        training weights: identical layouts built ``in_place``)."""
        return None if self.in_place else self.buffer.tensor

    def _experts(self, desc: ModelDescription, layout, gen_experts: dict, in_place: bool):
        """(exchange, buffer) for the routed experts: none when the generation model shares the
        training experts (the same expert grid), else the exchange into a buffer of their own."""
        if not gen_experts:
            return None, None
        train = {n: p for n, p in self._train_params.items() if is_expert_param(n)}
        if in_place and self.in_place and same_expert_grid(layout, self.gen_layout.tp, self.gen_layout.pp):
            bind_parameters(self.gen_model, {n: train[n].detach() for n in gen_experts})
            return None, None
        plan = plan_expert_exchange(desc, layout, self.plan, self.dtype.itemsize)
        buffer = GenerationBuffer(sum(p.numel() for p in gen_experts.values()), self.dtype, self.device)
        flat, offset, views = buffer.acquire(), 0, {}
        for name, param in gen_experts.items():  # the generation model built on meta: views of the buffer
            views[name] = flat[offset:offset + param.numel()].view(param.shape)
            offset += param.numel()
        bind_parameters(self.gen_model, views)
        gen_experts = {n: p for n, p in self.gen_model.named_parameters() if n in views}
        buffer.release()
        exchange = ExpertExchange(plan, dist.get_rank(), self.train_groups.pgs.tp_ep_pp, train, gen_experts,
                                  self.device)
        return exchange, buffer

    # ------------------------------------------------------------ transitions
    @torch.no_grad()
    def to_generation(self) -> torch.nn.Module:
        """Fill the generation buffer and return the generation-layout model."""
        if self.in_generation:
            return self.gen_model
        start = time.perf_counter()
        # 1. Room first: optimizer state to host (before the weights are released: it tells
        #    their storage apart), gradient buffers freed.
        if self._optimizer_offload is not None:
            self._optimizer_offload.offload()
        if self.offload_grads:
            self._ddp.offload_grad_buffers()
        # 2. The buffer's memory back. 3. The routes: copies, TP merge, PP merge.
        self.buffer.acquire()
        received = 0
        if self.adapters is None or not self.adapters.base_ready:  # a LoRA base comes once
            for param, view in self._copies:
                view.copy_(param.detach())
            with comm.transfer("all_gather", self.tp_merge_group) as xfer:  # shared memory or collectives
                xfer.nbytes = received = self.transport.gather(self._gathers)
            if self.pp_exchange is not None:
                with comm.transfer("p2p", self.pp_merge_group) as xfer:
                    xfer.nbytes = self.pp_exchange.exchange(self._publish, self._receive)
                received += xfer.nbytes
            if self.expert_exchange is not None:  # every expert of the rank's generation stage
                self.expert_buffer.acquire()
                with comm.transfer("all_to_all", self.expert_exchange.group) as xfer:
                    xfer.nbytes = self.expert_exchange.gather()
                received += xfer.nbytes
        if self.adapters is not None:  # the adapters to the generation layout, merged into the base
            received += self.adapters.to_generation()
        # 4. The training copy goes.
        if self.release_training_weights:
            self._release_training()
        self.in_generation = True
        seconds = time.perf_counter() - start
        held = self.buffer.nbytes + (self.expert_buffer.nbytes if self.expert_buffer is not None else 0)
        self.stats = ReshardStats(seconds=seconds, bytes_received=received, generation_bytes=held,
                                  released_training_bytes=sum(n for _, n in self._released),
                                  history=self.stats.history + [("to_generation", seconds)])
        return self.gen_model

    @torch.no_grad()
    def to_training(self) -> None:
        """Restore the training parameters (if released), give the buffer's memory back, then
        the gradient buffers and optimizer state."""
        if not self.in_generation:
            return
        start = time.perf_counter()
        if self.adapters is not None:  # the generation weights back to the base, bit for bit
            self.adapters.to_training()
        if self._released:
            for storage, nbytes in self._released:
                storage.resize_(nbytes)
                advise_huge_pages(storage)  # before the first touch (see hyflow.hybrid.generation_buffer)
                # no stale bytes in padding
                torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).zero_()
            s, slot = self.table.tp_merge_size, self.table.tp_slot
            for param, view, fixup, via in self._restores:
                if via == VIA_TP_MERGE:
                    take_shard(fixup, view, slot, s, out=param)
                else:
                    param.copy_(view)
            for name, value in self._unmapped.items():
                self._train_params[name].copy_(value)
            self._released, self._unmapped = [], {}
        if self.adapters is None:  # a LoRA actor's buffer keeps the base for the next transition
            self.buffer.release()
            if self.expert_buffer is not None:
                self.expert_buffer.release()
        if self.offload_grads:
            self._ddp.restore_grad_buffers()
        if self._optimizer_offload is not None:
            self._optimizer_offload.restore()
        self.in_generation = False
        self.stats.history.append(("to_training", time.perf_counter() - start))

    # ---------------------------------------------------------------- helpers
    def _release_training(self) -> None:
        """Free the training parameters' storage (their values live in the buffer; the few
        no route reads are kept aside)."""
        mapped = {id(param) for param, *_ in self._restores}
        self._unmapped = {n: p.detach().clone() for n, p in self._train_params.items() if id(p) not in mapped}
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


def bind_parameters(model: torch.nn.Module, tensors: dict[str, torch.Tensor], pending: Collection[str] = ()) -> None:
    """Give the named parameters of a model built on ``meta`` their storage: each becomes a
    parameter over ``tensors[name]`` that keeps the meta one's attributes (Megatron's tensor-parallel
    marks) and ``requires_grad``. Raises if a parameter is left without storage, but the ``pending``
    ones (bound by a later call: the routed experts)."""
    params = dict(model.named_parameters())
    bound = {}
    for name, value in tensors.items():
        old = params[name]
        new = torch.nn.Parameter(value, requires_grad=old.requires_grad)
        new.__dict__.update(old.__dict__)
        bound[id(old)] = new
    for module in model.modules():  # every registration of a shared parameter
        for attr, param in module._parameters.items():
            if param is not None and id(param) in bound:
                module._parameters[attr] = bound[id(param)]
    left = [n for n, p in model.named_parameters() if p.is_meta and n not in pending]
    if left:
        raise ReshardPlanError(f"generation parameters without storage after binding: {left[:4]}")


def _check_table(table: RankTable, gen_params: dict, train_params: dict) -> None:
    """Refuse a table that does not describe the two models, naming what differs."""
    problems = []
    routed = {r.gen_name for r in table.routes}
    missing, extra = sorted(set(gen_params) - routed), sorted(routed - set(gen_params))
    if missing:
        problems.append(f"generation parameters without a route: {missing[:4]}")
    if extra:
        problems.append(f"routes to parameters the generation model lacks: {extra[:4]}")
    for r in table.routes:
        if r.gen_name in gen_params and tuple(gen_params[r.gen_name].shape) != r.shape:
            problems.append(f"{r.gen_name}: route shape {r.shape} != model {tuple(gen_params[r.gen_name].shape)}")
    for r in table.own_routes:
        param = train_params.get(r.train_name)
        if param is None:
            problems.append(f"{r.gen_name}: its source {r.train_name!r} is not a parameter of this stage")
        elif param.numel() * (table.tp_merge_size if r.via == VIA_TP_MERGE else 1) != r.numel:
            problems.append(f"{r.gen_name}: source {r.train_name} has {param.numel()} elements, the route "
                            f"needs {r.numel} ({r.via})")
    if problems:
        raise ReshardPlanError(
            "the reshard table does not describe this model (the planner lists a Megatron GPTModel's "
            "parameters from the model description, hyflow.hybrid.param_specs): " + "; ".join(problems[:6]))


def _aliasable(table: RankTable, gen_params: dict, train_params: dict) -> bool:
    """Whether every generation parameter is this rank's own training parameter, same shape and
    dtype, copied as it is (a copy route; its TP fix-up is moot without a merge): then the
    generation model can share the training storage."""
    if table.tp_merge_size != 1 or table.pp_merge_size != 1 or table.pp_publish or table.pp_receive:
        return False
    if {r.gen_name for r in table.routes} != set(gen_params):
        return False
    for r in table.routes:
        train = train_params.get(r.train_name)
        if (r.via != VIA_COPY or r.src_stage != table.train_stage or train is None
                or tuple(train.shape) != tuple(r.shape) or train.dtype != gen_params[r.gen_name].dtype):
            return False
    return True
