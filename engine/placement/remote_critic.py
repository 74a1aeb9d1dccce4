"""The critic on a pool of its own, in its own layout.

The training pool's :func:`hyflow.jobs.rl.rl_step` runs unchanged: ``models.critic`` is a
:class:`RemoteCritic` there (the :class:`~hyflow.roles.Critic` role, as
:class:`~hyflow.placement.pool_models.RemoteRollouts` is the rollouts'), and the critic pool runs
:func:`serve_critic`, which answers it step by step with the colocated critic itself
(:class:`hyflow.rl.critic.LocalCritic`) on the rows its DP ranks own. Per step::

    training pool (DP rank d)                      critic pool (DP rank c)
    phase 3  rows (tokens, response mask, lengths) ──► forward: values
             values of d's rows                    ◄──
    phase 5  returns of d's rows                   ──► update (mini-batches x epochs)
             the update's statistics               ◄──

Who talks to whom is the row arithmetic of :mod:`hyflow.placement.rows` (:func:`row_routes`):
training DP rank ``d`` owns prompts ``shard_range(P, D_t, d)``, critic DP rank ``c`` owns
``shard_range(P, D_c, c)``; the first rank of ``d`` sends each rank of ``c`` the rows of the prompts
they share, and the first rank of ``c`` sends each rank of ``d`` their values, then the statistics.
Every message is a tensor over p2p (int64 header, then the payload; a peer's rows and width come in
the first message of the step, so the later ones need no header). The rows come from the training
pool rather than straight from the generation pool: rl_step's batch is only final there (rewards,
DAPO's dropped and refilled groups), and what the critic scores must be what the actor trains on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from hyflow.checkpoint.discovery import checkpoints_root, latest_checkpoint
from hyflow.checkpoint.trained_model import TrainedModel
from hyflow.config import ConfigError
from hyflow.data.tasks import load_data_tokenizer
from hyflow.models.description import ModelDescription
from hyflow.placement.groups import optimizer_agreement_on
from hyflow.placement.rows import RowRoute, row_routes
from hyflow.rl.critic import LocalCritic
from hyflow.rl.dispatch import shard_range
from hyflow.rl.models import build_critic
from hyflow.rl.step_losses import ValueLoss
from hyflow.rl.update import UpdateStats
from hyflow.training.supervisor import StepSupervisor

#: the critic update's statistics, in message order (the update's means, then token counts)
STATS = ValueLoss.names + ("grad_norm", "update_ok", "lr")
_HEADER = 2  # rows, width


def has_remote_critic(placement) -> bool:
    return "critic" in placement.roles and not placement.same_pool("actor", "critic")


def _exchange(ops: list) -> None:
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def _routes(cfg, placement) -> list[RowRoute]:
    """Training DP leads -> every rank of the critic DP rank owning the rows (critic -> training
    reuses them reversed: ``dst`` of a critic lead's reply is every rank of the training DP rank)."""
    return row_routes(cfg.data.train_batch_size, placement.roles["actor"], placement.roles["critic"])


def _replies(cfg, placement) -> list[RowRoute]:
    return row_routes(cfg.data.train_batch_size, placement.roles["critic"], placement.roles["actor"])


@dataclass
class RemoteCritic:
    """The training pool's :class:`~hyflow.roles.Critic` when the critic has a pool of its own:
    :meth:`values` and :meth:`update` exchange this rank's rows with the critic pool."""

    cfg: object
    placement: object
    groups: object

    def __post_init__(self) -> None:
        self.rank, self.n = dist.get_rank(), self.cfg.rollout.n
        self.first = shard_range(self.cfg.data.train_batch_size, self.groups.layout.dp, self.groups.dp_rank)[0]
        self.sends = [r for r in _routes(self.cfg, self.placement) if r.src == self.rank]
        self.recvs = [r for r in _replies(self.cfg, self.placement) if r.dst == self.rank]

    def _rows(self, r: RowRoute) -> slice:
        return slice((r.first - self.first) * self.n, (r.stop - self.first) * self.n)

    @property
    def model(self) -> Optional[TrainedModel]:
        """None: the critic's model lives (and is checkpointed) on its own pool."""
        return None

    def values(self, columns: dict, lengths: Sequence[int], shape: tuple[int, int]) -> torch.Tensor:
        """This rank's rows' values: rows out to the critic owners, their values back."""
        device = self.groups.device
        rows = torch.tensor(lengths, dtype=torch.long, device=device)
        heads = [torch.tensor([r.stop - r.first, shape[1]], dtype=torch.long, device=device) for r in self.sends]
        _exchange([dist.P2POp(dist.isend, h, r.dst) for h, r in zip(heads, self.sends)])
        ops = []
        for r in self.sends:
            part = self._rows(r)
            for t in (columns["tokens"][part], columns["response_mask"][part], rows[part]):
                ops.append(dist.P2POp(dist.isend, t.contiguous(), r.dst))
        _exchange(ops)
        out = torch.empty(shape, dtype=torch.float32, device=device)
        inbox = [(r, torch.empty(((r.stop - r.first) * self.n, shape[1]), dtype=torch.float32, device=device))
                 for r in self.recvs]
        _exchange([dist.P2POp(dist.irecv, buf, r.src) for r, buf in inbox])
        for r, buf in inbox:
            out[self._rows(r)] = buf
        return out

    def update(self, columns: dict, lengths: Sequence[int], *, seed: int, step: int, row_offset: int,
               agg_mode: str, norm_length: float) -> UpdateStats:
        """Returns (and the step, which keys the mini-batches) out to the critic owners; their update's
        statistics back (the critic's token counts on this DP group's rank 0 only, so the DP sums of
        the padding ratio count them once). The critic pool knows the rest of the update's
        arguments from the config and its own rows."""
        device = self.groups.device
        step_t = torch.tensor([step], dtype=torch.long, device=device)
        ops = []
        for r in self.sends:
            ops += [dist.P2POp(dist.isend, step_t, r.dst),
                    dist.P2POp(dist.isend, columns["returns"][self._rows(r)].float().contiguous(), r.dst)]
        _exchange(ops)
        inbox = [torch.empty(len(STATS) + 2, dtype=torch.float64, device=device) for _ in self.recvs]
        _exchange([dist.P2POp(dist.irecv, buf, r.src) for buf, r in zip(inbox, self.recvs)])
        vec = inbox[0].tolist()
        mine = self.groups.dp_rank == 0
        return UpdateStats(sums=dict(zip(STATS, vec)), updates=1, processed_tokens=int(vec[-2]) if mine else 0,
                           real_tokens=int(vec[-1]) if mine else 0)


def serve_critic(cfg, placement, groups, pool_group, go) -> None:
    """The critic pool's loop: build the critic, then answer each step until ``go()`` says stop."""
    rank, n, device = dist.get_rank(), cfg.rollout.n, groups.device
    pad_id = load_data_tokenizer(cfg.data).pad_token_id or 0
    desc = ModelDescription.load(cfg.actor.checkpoint) if cfg.actor.checkpoint else cfg.model
    critic = LocalCritic(build_critic(cfg, desc, groups, None, optimizer_scope=optimizer_agreement_on(pool_group)),
                         cfg, groups, pad_id)
    # NaN / inf gradients skip the critic's update here as on the training pool
    guard = StepSupervisor(cfg.trainer.max_bad_steps, [critic.trained.optimizer], signals=(), group=pool_group,
                           device=device)
    guard.install()
    first = shard_range(cfg.data.train_batch_size, groups.layout.dp, groups.dp_rank)[0]
    recvs = [r for r in _routes(cfg, placement) if r.dst == rank]
    sends = [r for r in _replies(cfg, placement) if r.src == rank]
    try:
        while go():
            guard.begin_step()
            heads = [torch.empty(_HEADER, dtype=torch.long, device=device) for _ in recvs]
            _exchange([dist.P2POp(dist.irecv, h, r.src) for h, r in zip(heads, recvs)])
            sizes = [(int(h[0]) * n, int(h[1])) for h in heads]
            width = max(w for _, w in sizes)
            parts, ops = [], []
            for (b, w), r in zip(sizes, recvs):
                part = (torch.empty(b, w, dtype=torch.long, device=device), torch.empty(b, w, device=device),
                        torch.empty(b, dtype=torch.long, device=device))
                ops += [dist.P2POp(dist.irecv, t, r.src) for t in part]
                parts.append(part)
            _exchange(ops)
            pad = lambda t, value, width=width: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)  # noqa: E731
            columns = {"tokens": torch.cat([pad(p[0], pad_id) for p in parts]),
                       "response_mask": torch.cat([pad(p[1], 0.0) for p in parts])}
            lengths = torch.cat([p[2] for p in parts]).tolist()
            shape = tuple(columns["tokens"].shape)
            values = critic.values(columns, lengths, shape)
            # each training owner gets its rows' values at its own width (rows arrive in (first) order)
            by_src = {r.src: (i, b, w) for i, ((b, w), r) in enumerate(zip(sizes, recvs))}
            offsets = [sum(b for b, _ in sizes[:i]) for i in range(len(sizes))]
            _exchange([dist.P2POp(dist.isend, _slice(values, offsets, sizes, by_src, placement, r), r.dst)
                       for r in sends])
            steps = [torch.empty(1, dtype=torch.long, device=device) for _ in recvs]
            returns = [torch.empty(b, w, device=device) for b, w in sizes]
            ops = []
            for s, t, r in zip(steps, returns, recvs):
                ops += [dist.P2POp(dist.irecv, s, r.src), dist.P2POp(dist.irecv, t, r.src)]
            _exchange(ops)
            returns = torch.cat([pad(t, 0.0) for t in returns])
            step = int(steps[0])
            stats = critic.update(dict(columns, old_values=values, returns=returns), lengths, seed=cfg.trainer.seed,
                                  step=step, row_offset=first * n, agg_mode=cfg.actor.loss_agg_mode,
                                  norm_length=float(cfg.loss_norm_length))
            tokens = torch.tensor([stats.processed_tokens, stats.real_tokens], dtype=torch.float64, device=device)
            if groups.pgs.dp.size() > 1:  # the pool's totals (two scalars)
                dist.all_reduce(tokens, group=groups.pgs.dp)
            means = stats.means()
            vec = torch.tensor([means.get(k, float("nan")) for k in STATS], dtype=torch.float64, device=device)
            vec = torch.cat([vec, tokens])
            _exchange([dist.P2POp(dist.isend, vec, r.dst) for r in sends])
    finally:
        guard.uninstall()


def _slice(values: torch.Tensor, offsets, sizes, by_src, placement, reply: RowRoute) -> torch.Tensor:
    """The rows of ``reply`` (critic lead -> a training rank) out of this critic rank's ``values``,
    at the width of the training DP rank that owns them."""
    actor = placement.roles["actor"].layout
    lead = actor.rank_of(dp=actor.coords(reply.dst)["dp"])  # the training DP rank's first rank sent the rows
    i, b, w = by_src[lead]
    return values[offsets[i]:offsets[i] + b, :w].contiguous()


def check_remote_roles(cfg, placement) -> None:
    """What a role on a pool apart from the actor's cannot do yet, named before any rank starts."""
    actor = placement.roles["actor"].pool
    for role in ("reference", "reward"):
        if role in placement.roles and placement.roles[role].pool != actor:
            raise ConfigError(f"placement pools run the {role} on the actor's pool for now (the critic may have a "
                              f"pool of its own); set placement.{role}={actor.name} (or null)",
                              key=f"placement.{role}")
    if has_remote_critic(placement) and cfg.trainer.save_every:
        raise ConfigError(f"the critic on pool {placement.roles['critic'].pool.name!r} is not checkpointed yet: set "
                          "trainer.save_every=0, or placement.critic=null (the critic on the actor's pool)",
                          key="trainer.save_every")
    if has_remote_critic(placement) and cfg.trainer.resume not in ("auto", "never"):
        raise ConfigError(f"the critic on pool {placement.roles['critic'].pool.name!r} does not resume from "
                          "checkpoints yet: set trainer.resume=never, or placement.critic=null",
                          key="trainer.resume")
    if has_remote_critic(placement) and cfg.trainer.resume == "auto":
        found = latest_checkpoint(checkpoints_root(cfg.trainer.output_dir), lambda _: None)
        if found is not None:  # resume=auto would start over beside it, silently
            raise ConfigError(f"{cfg.trainer.output_dir} holds checkpoint {found.path}, and a run with the critic on "
                              f"pool {placement.roles['critic'].pool.name!r} does not resume yet: use another "
                              "trainer.output_dir, or placement.critic=null to continue it", key="trainer.resume")
