"""The routed experts' part of the hybrid engine's reshard: training expert grid -> generation.

In training a mixture-of-experts layer's routed experts live on the expert grid (Megatron-Core:
``EP`` ranks hold ``E / EP`` experts each, every expert split ``ETP`` ways along its FFN width,
see :mod:`hyflow.parallel.layout`). The generation layout gathers every expert on every
generation replica (EP_g = 1), split like the replica's dense layers (ETP_g = TP_g): generation TP
rank ``tg`` of stage ``pg`` needs, for every layer of its stage and every expert, the FFN columns
``[tg F / TP_g, (tg + 1) F / TP_g)``.

Everything it needs is held inside its own ``tp_ep_pp`` group (the ranks of one expert
data-parallel index: every (ETP, EP, PP) coordinate once, i.e. one copy of all experts of all
stages), so the exchange is an ``all_to_all_single`` over that group that moves exactly the
overlaps: holder ``(a, ep, q)`` (ETP rank, EP rank, training stage) sends to a receiver the part
of its shard columns ``[a F / ETP, (a + 1) F / ETP)`` that falls in the receiver's columns, for
the receiver's layers that stage ``q`` holds and the experts ``ep`` holds. Nothing is gathered
whole, nothing is sent that is not kept. One collective per generation layer slot (the k-th layer
of every generation stage) bounds the staging to one layer's experts.

:class:`ExpertExchangePlan` is the pure arithmetic (per-rank pieces and bytes, unit-tested at 1024
ranks without process groups, what ``hyflow plan`` reports); :class:`ExpertExchange` runs it on
one rank between a training model and a generation model. A ``linear_fc1`` piece is two row
blocks (gate and up halves), a ``linear_fc2`` piece one column block; both sides walk the pieces
in the same (layer, expert, fc1 / fc2) order, so the buffers carry no metadata.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from hyflow.hybrid.param_specs import ReshardPlanError, stage_split

__all__ = ["ExpertPiece", "ExpertExchangePlan", "plan_expert_exchange", "ExpertExchange", "same_expert_grid"]


@dataclass(frozen=True)
class ExpertPiece:
    """FFN columns ``[lo, hi)`` of one expert weight (``kind`` fc1 / fc2; global indices)."""

    layer: int
    expert: int
    kind: str
    lo: int
    hi: int

    def numel(self, hidden: int) -> int:
        return (2 if self.kind == "fc1" else 1) * (self.hi - self.lo) * hidden


@dataclass(frozen=True)
class ExpertExchangePlan:
    """Who sends which expert columns to whom (see the module docstring)."""

    num_layers: int
    num_experts: int
    hidden: int
    ffn: int
    dtype_bytes: int
    ep: int
    etp: int
    gen_tp: int
    train_split: tuple[int, ...]  # layers per training stage
    gen_split: tuple[int, ...]  # layers per generation stage
    #: per global rank: (etp rank, ep rank, training stage) and (generation tp rank, generation stage)
    expert_coords: tuple[tuple[int, int, int], ...]
    gen_coords: tuple[tuple[int, int], ...]
    groups: tuple[tuple[int, ...], ...]  # the tp_ep_pp groups (sorted ranks)
    _group_of: dict = field(default=None, repr=False, compare=False)

    @property
    def world_size(self) -> int:
        return len(self.expert_coords)

    @property
    def slots(self) -> int:
        """Collectives per transition: the most layers of any generation stage."""
        return max(self.gen_split)

    def group_of(self, rank: int) -> tuple[int, ...]:
        return self._group_of[rank]

    def _first(self, split: tuple[int, ...], stage: int) -> int:
        return sum(split[:stage])

    def gen_layers(self, rank: int) -> range:
        _, pg = self.gen_coords[rank]
        first = self._first(self.gen_split, pg)
        return range(first, first + self.gen_split[pg])

    def train_layers(self, rank: int) -> range:
        q = self.expert_coords[rank][2]
        first = self._first(self.train_split, q)
        return range(first, first + self.train_split[q])

    def train_experts(self, rank: int) -> range:
        per = self.num_experts // self.ep
        ep = self.expert_coords[rank][1]
        return range(ep * per, (ep + 1) * per)

    def train_cols(self, rank: int) -> tuple[int, int]:
        a = self.expert_coords[rank][0]
        w = self.ffn // self.etp
        return a * w, (a + 1) * w

    def gen_cols(self, rank: int) -> tuple[int, int]:
        tg = self.gen_coords[rank][0]
        w = self.ffn // self.gen_tp
        return tg * w, (tg + 1) * w

    def overlap(self, src: int, dst: int, slot: int) -> Optional[tuple[int, int, int]]:
        """(layer, lo, hi): the FFN columns ``src``'s training shard gives ``dst`` for ``dst``'s
        ``slot``-th generation layer, or None."""
        layers = self.gen_layers(dst)
        if slot >= len(layers) or layers[slot] not in self.train_layers(src):
            return None
        (t0, t1), (g0, g1) = self.train_cols(src), self.gen_cols(dst)
        lo, hi = max(t0, g0), min(t1, g1)
        return (layers[slot], lo, hi) if lo < hi else None

    def pieces(self, src: int, dst: int, slot: int) -> list[ExpertPiece]:
        """:meth:`overlap` as pieces, in (expert, fc1 / fc2) order."""
        hit = self.overlap(src, dst, slot)
        if hit is None:
            return []
        layer, lo, hi = hit
        return [ExpertPiece(layer, e, kind, lo, hi) for e in self.train_experts(src) for kind in ("fc1", "fc2")]

    def slot_numel(self, src: int, dst: int, slot: int) -> int:
        hit = self.overlap(src, dst, slot)
        return 0 if hit is None else 3 * (hit[2] - hit[1]) * self.hidden * (self.num_experts // self.ep)

    def slot_used(self, rank: int, slot: int) -> bool:
        """Whether any rank of ``rank``'s group has a ``slot``-th generation layer (then the whole
        group enters that slot's collective)."""
        return any(slot < len(self.gen_layers(d)) for d in self.group_of(rank))

    def recv_bytes(self, rank: int) -> int:
        """Bytes ``rank`` receives from other ranks in one transition."""
        return self.dtype_bytes * sum(self.slot_numel(src, rank, k) for src in self.group_of(rank) if src != rank
                                      for k in range(self.slots))

    def gen_bytes(self, rank: int) -> int:
        """Bytes of the generation model's routed experts on ``rank`` (its expert buffer)."""
        return len(self.gen_layers(rank)) * self.num_experts * 3 * self.hidden * (self.ffn // self.gen_tp) \
            * self.dtype_bytes

    def train_bytes(self, rank: int) -> int:
        """Bytes of ``rank``'s training expert shard."""
        return len(self.train_layers(rank)) * (self.num_experts // self.ep) * 3 * self.hidden \
            * (self.ffn // self.etp) * self.dtype_bytes

    def staging_bytes(self, rank: int) -> int:
        """Largest send + receive staging of one collective on ``rank``."""
        group = self.group_of(rank)
        best = 0
        for k in range(self.slots):
            send = sum(self.slot_numel(rank, dst, k) for dst in group)
            recv = sum(self.slot_numel(src, rank, k) for src in group)
            best = max(best, send + recv)
        return best * self.dtype_bytes


def same_expert_grid(layout: Any, gen_tp: int, gen_pp: int) -> bool:
    """Whether the generation layout holds each rank's training experts as they are (EP = 1,
    ETP = TP = TP_g, PP = PP_g): then the generation model shares their storage."""
    return layout.ep == 1 and layout.expert_tp == layout.tp == gen_tp and layout.pp == gen_pp


def plan_expert_exchange(desc: Any, layout: Any, plan: Any, dtype_bytes: int) -> ExpertExchangePlan:
    """The exchange of ``desc``'s routed experts from the training ``layout`` (a
    :class:`~hyflow.parallel.layout.Layout` with dp) to the generation side of the dense reshard
    ``plan`` (its generation TP / PP coordinates and stage split). Raises
    :class:`~hyflow.hybrid.param_specs.ReshardPlanError` when the experts do not split."""
    moe = desc.moe
    if moe is None:
        raise ReshardPlanError("plan_expert_exchange needs a mixture-of-experts model description")
    gen_tp = plan.gen.tp
    if moe.ffn_hidden_size % gen_tp:
        raise ReshardPlanError(f"generation TP_g={gen_tp} does not divide the expert ffn_hidden_size="
                               f"{moe.ffn_hidden_size}; pick a rollout.layout.tp dividing it")
    world = layout.world_size
    expert = []
    for r in range(world):
        c = layout.expert_coords(r)
        expert.append((c["etp"], c["ep"], c["pp"]))
    gen = [plan.gen_coord(r)[:2] for r in range(world)]
    groups = tuple(tuple(g) for g in layout.expert_groups("tp_ep_pp"))
    group_of = {r: g for g in groups for r in g}
    train_split = stage_split(layout.pp, desc.num_layers, layout.stage_layers if layout.pp > 1 else None)
    return ExpertExchangePlan(
        num_layers=desc.num_layers, num_experts=moe.num_experts, hidden=desc.hidden_size, ffn=moe.ffn_hidden_size,
        dtype_bytes=dtype_bytes, ep=layout.ep, etp=layout.expert_tp, gen_tp=gen_tp,
        train_split=tuple(train_split), gen_split=tuple(plan.gen_split), expert_coords=tuple(expert),
        gen_coords=tuple(gen), groups=groups, _group_of=group_of)


def _expert_name(layer: int, expert: int, kind: str) -> str:
    return f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_{kind}.weight"


class ExpertExchange:
    """Runs an :class:`ExpertExchangePlan` on one rank: ``gather`` fills the generation model's
    routed experts from the training model's (collective over the rank's ``tp_ep_pp`` group).

    ``group``: that group as a process group (members in rank order); ``gen_params`` /
    ``train_params``: the two models' parameters by (local) name.
    """

    def __init__(self, plan: ExpertExchangePlan, rank: int, group, train_params: dict, gen_params: dict,
                 device: torch.device) -> None:
        self.plan, self.rank, self.group, self.device = plan, rank, group, device
        self.members = plan.group_of(rank)
        train_first = plan.train_layers(rank).start
        train_expert0 = plan.train_experts(rank).start
        gen_first = plan.gen_layers(rank).start
        self._train = lambda p: train_params[_expert_name(p.layer - train_first, p.expert - train_expert0, p.kind)]
        self._gen = lambda p: gen_params[_expert_name(p.layer - gen_first, p.expert, p.kind)]
        self.t0, self.g0 = plan.train_cols(rank)[0], plan.gen_cols(rank)[0]
        self.tw, self.gw = plan.ffn // plan.etp, plan.ffn // plan.gen_tp
        first = next(iter(train_params.values()))
        self.dtype = first.dtype
        # (sends per member, receives per member) of every slot the group enters, worked out once
        self._slots = [([plan.pieces(rank, dst, k) for dst in self.members],
                        [plan.pieces(src, rank, k) for src in self.members])
                       for k in range(plan.slots) if plan.slot_used(rank, k)]

    @torch.no_grad()
    def gather(self) -> int:
        """Fill the generation experts; returns the bytes received from other ranks."""
        received = 0
        h = self.plan.hidden
        for sends, recvs in self._slots:
            send_sizes = [sum(p.numel(h) for p in ps) for ps in sends]
            recv_sizes = [sum(p.numel(h) for p in ps) for ps in recvs]
            send = torch.empty(sum(send_sizes), dtype=self.dtype, device=self.device)
            pos = 0
            for ps in sends:
                for p in ps:
                    pos = self._pack(p, send, pos)
            recv = torch.empty(sum(recv_sizes), dtype=self.dtype, device=self.device)
            if len(self.members) > 1:
                dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes,
                                       group=self.group)
            else:
                recv.copy_(send)
            pos = 0
            for src, ps in zip(self.members, recvs):
                for p in ps:
                    pos = self._unpack(p, recv, pos)
                if src != self.rank:
                    received += sum(p.numel(h) for p in ps) * recv.element_size()
        return received

    def _pack(self, p: ExpertPiece, buf: torch.Tensor, pos: int) -> int:
        w = self._train(p)
        a, b = p.lo - self.t0, p.hi - self.t0
        if p.kind == "fc1":
            for half in (w[a:b], w[self.tw + a:self.tw + b]):
                buf[pos:pos + half.numel()].copy_(half.reshape(-1))
                pos += half.numel()
            return pos
        block = w[:, a:b]
        buf[pos:pos + block.numel()].view(block.shape).copy_(block)
        return pos + block.numel()

    def _unpack(self, p: ExpertPiece, buf: torch.Tensor, pos: int) -> int:
        w = self._gen(p)
        a, b = p.lo - self.g0, p.hi - self.g0
        h = self.plan.hidden
        if p.kind == "fc1":
            for dst in (w[a:b], w[self.gw + a:self.gw + b]):
                dst.copy_(buf[pos:pos + dst.numel()].view(b - a, h))
                pos += dst.numel()
            return pos
        n = (b - a) * h
        w[:, a:b].copy_(buf[pos:pos + n].view(h, b - a))
        return pos + n
