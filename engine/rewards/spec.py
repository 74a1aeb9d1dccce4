"""A reward named on a command line (``hyflow eval --reward``, ``hyflow generate --reward``): the
keys of the ``reward`` section it stands for, so the command scores exactly as a training config
with those keys would.

* ``numeric_match`` (a built-in rule) -> ``{kind: rule, rule: numeric_match}``
* ``my_reward.py`` or ``my_reward.py:score_fn`` (verl's ``compute_score`` file) ->
  ``{kind: function, function_path: ..., function_name: ...}``
* ``model:CHECKPOINT`` (a reward model) -> ``{kind: model, model_checkpoint: CHECKPOINT}``
"""

from __future__ import annotations

import os
from typing import Any
import json

from hyflow.rewards.rules import rule_names


def reward_spec(text: str) -> dict[str, Any]:
    """The ``reward`` keys of ``text``; ``ValueError`` naming the forms accepted."""
    if text.startswith("model:"):
        return {"kind": "model", "model_checkpoint": text[len("model:"):]}
    if text in rule_names():
        return {"kind": "rule", "rule": text}
    path, _, name = text.partition(".py:") if ".py:" in text else (text, "", "")
    path = path + ".py" if name else path
    if path.endswith(".py"):
        if not os.path.isfile(path):
            raise ValueError(f"reward function file {path!r} does not exist")
        return {"kind": "function", "function_path": path, "function_name": name or "compute_score"}
    raise ValueError(f"unknown reward {text!r}: give a rule ({', '.join(rule_names())}), a Python file defining "
                     "compute_score (FILE.py, or FILE.py:FUNCTION), or model:CHECKPOINT")


def reward_overrides(text: str) -> list[str]:
    """:func:`reward_spec` as ``reward.<key>=<value>`` config overrides."""
    return [f"reward.{key}={json.dumps(value)}" for key, value in reward_spec(text).items()]
