"""One model role of a plan (actor, reference, critic, reward) in its training layout: what
:mod:`hyflow.plan.core` reports per role and :mod:`hyflow.plan.pools` fills for placement pools."""

from __future__ import annotations

from dataclasses import dataclass

from hyflow.models.description import ModelDescription
from hyflow.parallel.layout import Layout


@dataclass
class RolePlan:
    """One model role (actor, reference, critic, reward) in its training layout."""

    name: str
    layout: Layout
    model: ModelDescription
    dtype: str
    trainable: bool
    stage_params: list[int]
    groups: dict[str, dict]
    note: str = ""
