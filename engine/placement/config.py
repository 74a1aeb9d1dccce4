"""Where each role of an RL run lives: the ``placement:`` section and its resolution.

Two kinds of placement:

* **colocated** (``placement.pools`` empty, the default in ``trainer.mode: sync``): every role on
  every rank in the actor's training layout; the actor generates through the hybrid engine
  (:mod:`hyflow.hybrid`), resharded in memory on the same ranks.
* **pools**: named, disjoint rank ranges ``[first, end)`` that together cover every rank; each role
  (actor, rollout, critic, reference, reward) names the pool it runs on and runs there in its own
  layout, data-parallel over the pool::

      placement:
        pools: {train: [0, 4], gen: [4, 6], critic: [6, 8]}
        actor: train
        rollout: gen
        critic: critic
        reference: critic
        reward: critic

  Generation (``rollout``) always gets a pool of its own; the actor's weights reach it after each
  update through :mod:`hyflow.placement.weight_sync`. ``trainer.mode: one_step_off`` without pools
  splits the ranks in half: actor, critic, reference and reward on the first half, generation on
  the second.

Resolution (:func:`resolve_placement`) is pure arithmetic on the config, run at config time: a
pool that a layout does not divide, a rank in no pool, overlapping pools, an unknown pool name
all fail with one message naming them before any process starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from hyflow.config import ConfigError
from hyflow.parallel.layout import Layout, LayoutError, pad_vocab_size

ROLES = ("actor", "rollout", "critic", "reference", "reward")
#: roles whose model is trained (an optimizer lives with it)
TRAINED = ("actor", "critic")


@dataclass
class PlacementConfig:
    """Which ranks run which role (empty ``pools``: every role colocated on every rank)."""

    pools: dict[str, list[int]] = field(default_factory=dict, metadata={
        "help": "named rank ranges [first, end) (end exclusive), disjoint and covering every rank, e.g. "
                "{train: [0, 4], gen: [4, 8]}; empty = colocated (the hybrid engine; in trainer.mode="
                "one_step_off: the first half of the ranks trains, the second half generates)"})
    actor: Optional[str] = field(default=None, metadata={"help": "pool of the actor's training"})
    rollout: Optional[str] = field(default=None, metadata={
        "help": "pool that generates (its own pool: weights are synced to it after each update)"})
    critic: Optional[str] = field(default=None, metadata={"help": "pool of the critic (null = the actor's)"})
    reference: Optional[str] = field(default=None, metadata={"help": "pool of the reference (null = the actor's)"})
    reward: Optional[str] = field(default=None, metadata={
        "help": "pool of the reward model, when reward.model_checkpoint is set (null = the actor's)"})

    def validate(self) -> None:
        for name, bounds in self.pools.items():
            if len(bounds) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds):
                raise ConfigError(f"pool {name!r} must be [first, end) rank numbers, got {bounds!r}",
                                  key=f"pools.{name}")
            if not 0 <= bounds[0] < bounds[1]:
                raise ConfigError(f"pool {name!r} = {bounds}: needs 0 <= first < end", key=f"pools.{name}")
        if self.pools:
            for role in ROLES:
                pool = getattr(self, role)
                if pool is not None and pool not in self.pools:
                    raise ConfigError(f"pool {pool!r} is not defined; pools: {', '.join(self.pools)}", key=role)
            for role in ("actor", "rollout"):
                if getattr(self, role) is None:
                    raise ConfigError(f"with pools, name the {role}'s pool (placement.{role}=<pool>)", key=role)
        else:
            given = [r for r in ROLES if getattr(self, r) is not None]
            if given:
                raise ConfigError(f"placement.{given[0]}={getattr(self, given[0])!r} names a pool but "
                                  "placement.pools is empty; define the pools (e.g. pools: {train: [0, 2], "
                                  "gen: [2, 4]}) or drop the role")


@dataclass(frozen=True)
class Pool:
    """A named rank range ``[start, stop)``."""

    name: str
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def ranks(self) -> range:
        return range(self.start, self.stop)

    def __contains__(self, rank: int) -> bool:
        return self.start <= rank < self.stop

    def describe(self) -> str:
        return f"{self.name} = ranks {self.start}-{self.stop - 1}"


@dataclass(frozen=True)
class RolePlacement:
    """A role on its pool, in its layout (``dp`` filled for the pool's size, ``start`` the pool's
    first rank: ``layout.rank_of`` / ``layout.coords`` read global ranks)."""

    role: str
    pool: Pool
    layout: Layout


@dataclass(frozen=True)
class Placement:
    """The resolved placement of a run of ``world`` ranks."""

    world: int
    colocated: bool
    pools: tuple[Pool, ...] = ()
    roles: dict[str, RolePlacement] = field(default_factory=dict)

    def pool_of(self, rank: int) -> Pool:
        return next(p for p in self.pools if rank in p)

    def roles_on(self, rank: int) -> list[str]:
        """Roles running on ``rank``, in :data:`ROLES` order."""
        return [r for r in ROLES if r in self.roles and rank in self.roles[r].pool]

    def has(self, role: str) -> bool:
        return role in self.roles

    def same_pool(self, a: str, b: str) -> bool:
        return self.roles[a].pool == self.roles[b].pool

    def describe(self) -> str:
        if self.colocated:
            return "colocated: every role on every rank"
        parts = []
        for pool in self.pools:
            here = [f"{r} ({self.roles[r].layout.describe()})" for r in ROLES
                    if r in self.roles and self.roles[r].pool == pool]
            parts.append(f"{pool.describe()}: " + (", ".join(here) or "idle"))
        return "; ".join(parts)


def role_layouts(cfg: Any) -> dict[str, Layout]:
    """Each role's layout without ``dp`` (the tp/pp the config gives it; the actor's stage split chosen)."""
    actor = cfg.trained_actor_layout() if hasattr(cfg, "trained_actor_layout") else cfg.actor.layout
    out = {"actor": actor, "rollout": cfg.rollout.layout.as_layout()}
    if cfg.critic.enable:
        out["critic"] = cfg.critic.layout or actor
    if cfg.reference.enable:
        out["reference"] = cfg.reference.layout or actor
    if cfg.reward.model_checkpoint:
        out["reward"] = actor  # the reward model runs in the actor's tp/pp
    return out


def _pools(cfg: Any, world: int) -> dict[str, Pool]:
    """The pools of the config; ``one_step_off`` without pools splits the ranks in half."""
    place = cfg.placement
    if place.pools:
        return {name: Pool(name, b[0], b[1]) for name, b in place.pools.items()}
    if world < 2 or world % 2:
        raise ConfigError(f"trainer.mode={cfg.trainer.mode} without placement.pools splits the ranks in half "
                          f"(training, generation): trainer.nproc={world} must be even; or define "
                          "placement.pools", key="trainer.mode")
    return {"train": Pool("train", 0, world // 2), "gen": Pool("gen", world // 2, world)}


def _check_cover(pools: dict[str, Pool], world: int) -> None:
    ordered = sorted(pools.values(), key=lambda p: p.start)
    for pool in ordered:
        if pool.stop > world:
            raise ConfigError(f"pool {pool.name!r} = [{pool.start}, {pool.stop}) ends beyond the "
                              f"{world} ranks (trainer.nproc={world})", key=f"placement.pools.{pool.name}")
    for a, b in zip(ordered, ordered[1:]):
        if b.start < a.stop:
            raise ConfigError(f"pools {a.name!r} [{a.start}, {a.stop}) and {b.name!r} [{b.start}, {b.stop}) "
                              f"overlap on {_ranks(list(range(b.start, min(a.stop, b.stop))))}; pools must be "
                              "disjoint",
                              key="placement.pools")
    covered = set(r for p in ordered for r in p.ranks)
    missing = [r for r in range(world) if r not in covered]
    if missing:
        raise ConfigError(f"{_ranks(missing)} belong{'s' if len(missing) == 1 else ''} to no pool; every rank of trainer.nproc={world} "
                          "must be in one pool of placement.pools", key="placement.pools")


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` / ``ranks 1-2, 5``."""
    out, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(out)


def resolve_placement(cfg: Any, world: Optional[int] = None) -> Placement:
    """The placement of ``cfg`` (an ``RLJobConfig``) on ``world`` ranks (default ``trainer.nproc``).

    Raises :class:`~hyflow.config.ConfigError` naming the pool, role and numbers that do not fit.
    """
    world = world or cfg.trainer.nproc
    place = cfg.placement
    if not place.pools and cfg.trainer.mode == "sync":
        return Placement(world=world, colocated=True)
    pools = _pools(cfg, world)
    _check_cover(pools, world)
    default = {"actor": "train", "rollout": "gen"} if not place.pools else {}
    layouts = role_layouts(cfg)
    actor_pool = place.actor or default["actor"]
    roles: dict[str, RolePlacement] = {}
    for role, base in layouts.items():
        name = getattr(place, role) or default.get(role) or actor_pool
        pool = pools[name]
        per_copy = base.tp * base.pp * base.cp
        key = "rollout.layout" if role == "rollout" else f"{role}.layout" if role != "reward" else "actor.layout"
        if pool.size % per_copy:
            raise ConfigError(f"placement: the {role} runs on pool {name!r} of {pool.size} ranks, which its "
                              f"layout tp={base.tp} x pp={base.pp} x cp={base.cp} = {per_copy} does not divide; "
                              f"resize the pool or change {key}", key=f"placement.{role}")
        if base.start:
            raise ConfigError(f"layout.start={base.start}: the placement sets where a role's layout starts (its "
                              "pool's first rank); leave start unset", key=key)
        layout = dataclasses.replace(base, dp=pool.size // per_copy).at(pool.start)
        try:
            layout.check_model(cfg.model, training=role in ("actor", "critic"))  # the others run forwards only
        except LayoutError as e:
            raise ConfigError(f"{role} on pool {name!r}: {e}", key=key) from None
        roles[role] = RolePlacement(role, pool, layout)
    placement = Placement(world=world, colocated=False, pools=tuple(sorted(pools.values(), key=lambda p: p.start)),
                          roles=roles)
    _check_roles(cfg, placement)
    used = {rp.pool.name for rp in roles.values()}
    idle = [name for name in pools if name not in used]
    if idle:
        raise ConfigError(f"pool {idle[0]!r} runs no role; assign it (placement.<role>={idle[0]}) or remove it",
                          key=f"placement.pools.{idle[0]}")
    return placement


def _check_roles(cfg: Any, p: Placement) -> None:
    actor, rollout = p.roles["actor"], p.roles["rollout"]
    if rollout.pool == actor.pool:
        raise ConfigError(
            f"placement.rollout={rollout.pool.name!r} is the actor's pool: generating on the actor's ranks is "
            "the colocated hybrid engine (leave placement.pools empty); give the rollout a pool of its own",
            key="placement.rollout")
    for role in ("critic", "reference", "reward"):
        if role in p.roles and p.roles[role].pool == rollout.pool:
            raise ConfigError(f"placement.{role}={rollout.pool.name!r} is the generation pool; put the {role} "
                              "on a training pool (the generation pool holds the generation engine only)",
                              key=f"placement.{role}")
    if "critic" in p.roles and p.same_pool("actor", "critic"):
        a, c = actor.layout, p.roles["critic"].layout
        if (a.tp, a.pp, a.cp) != (c.tp, c.pp, c.cp):
            raise ConfigError(
                f"the critic shares pool {actor.pool.name!r} with the actor but has another layout (critic tp={c.tp} "
                f"pp={c.pp}, actor tp={a.tp} pp={a.pp}): trained models on one pool share a layout; give the "
                "critic its own pool or leave critic.layout null", key="placement.critic")
    train_tp = actor.layout.tp
    padded = pad_vocab_size(cfg.model.vocab_size, train_tp)
    for role, rp in p.roles.items():
        if rp.layout.vpp or (role != "actor" and rp.layout.cp > 1):
            raise ConfigError(f"{role}: placement pools support layouts without vpp and cp", key=f"placement.{role}")
        if padded % rp.layout.tp:
            raise ConfigError(f"{role} tp={rp.layout.tp} does not divide the actor's padded vocabulary {padded} "
                              "(every role uses the actor's padding)", key=f"placement.{role}")
    prompts = cfg.data.train_batch_size
    for role in ("actor", "critic", "reference", "reward"):
        if role in p.roles and prompts % p.roles[role].layout.dp:
            dp = p.roles[role].layout.dp
            raise ConfigError(f"data.train_batch_size={prompts} prompts must split evenly over the {role}'s {dp} "
                              f"data-parallel ranks on pool {p.roles[role].pool.name!r}", key="data.train_batch_size")
