"""Which kind of traffic a process group carries, for the communication statistics
(:mod:`hyflow.monitor.comm`): the code that creates groups declares each once.

Kinds: ``dp``, ``tp``, ``pp``, ``cp``, ``ep``, ``mp`` (Megatron's model-parallel group, used for
the gradient norm), ``reshard`` (the hybrid engine's merge groups), ``data`` (the data plane),
``world`` (the default group) and ``other`` (a group nobody registered). Groups are keyed by
``id``; a registered group is kept referenced so its id is not reused while registered.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["GROUP_KINDS", "register_group", "register_collection", "forget_groups", "group_kind"]

GROUP_KINDS = ("dp", "tp", "pp", "cp", "ep", "mp", "reshard", "data", "world", "other")

#: ProcessGroupCollection attribute -> group kind (the first registration of a group wins).
_COLLECTION_KINDS = (
    ("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("cp", "cp"), ("ep", "ep"), ("dp_cp", "dp"),
    ("intra_dp_cp", "dp"), ("inter_dist_opt", "dp"), ("intra_dist_opt", "dp"), ("expt_dp", "dp"),
    ("intra_expt_dp", "dp"), ("tp_cp", "tp"), ("expt_tp", "ep"), ("tp_ep", "ep"), ("hcp", "cp"),
    ("embd", "pp"), ("pos_embd", "pp"), ("mp", "mp"), ("tp_ep_pp", "mp"), ("tp_dp_cp", "mp"),
)

_KIND_OF: dict[int, str] = {}     # id(group) -> kind
_GROUPS: dict[int, Any] = {}      # id(group) -> group (keeps ids unique while registered)
_GUESSED: dict[int, str] = {}     # id(group) -> "world" / "other" for groups nobody registered


def register_group(group: Any, kind: str) -> None:
    """Declare that collectives over ``group`` are ``kind`` traffic (first registration wins)."""
    if kind not in GROUP_KINDS:
        raise ValueError(f"unknown group kind {kind!r}; one of {', '.join(GROUP_KINDS)}")
    if group is None or id(group) in _KIND_OF:
        return
    _KIND_OF[id(group)] = kind
    _GUESSED.pop(id(group), None)
    _GROUPS[id(group)] = group


def forget_groups() -> None:
    """Drop every registration (and the references that keep the groups alive): for processes
    that destroy their process groups and build new ones, like the test workers."""
    _KIND_OF.clear()
    _GROUPS.clear()
    _GUESSED.clear()


def register_collection(pgs: Any) -> None:
    """Register the groups of a Megatron ``ProcessGroupCollection`` by attribute name."""
    for attr, kind in _COLLECTION_KINDS:
        group = getattr(pgs, attr, None)
        if group is not None and not isinstance(group, (list, tuple)):
            register_group(group, kind)


def group_kind(group: Any) -> str:
    """The registered kind of ``group``; ``world`` for the default group."""
    kind = _KIND_OF.get(id(group))
    if kind is not None:
        return kind
    if group is None:
        return "world"
    kind = _GUESSED.get(id(group))
    if kind is None:
        kind = _GUESSED[id(group)] = "world" if group is dist.group.WORLD else "other"
        _GROUPS.setdefault(id(group), group)  # keep the id from being reused while cached
    return kind
