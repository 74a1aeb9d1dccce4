"""Rewards for RL: rule verifiers, verl-style user functions, and the batch scorer.

* :mod:`.rules` -- ``exact_match``, ``numeric_match`` (robust answer-number extraction:
  ``#### 42``, ``\\boxed{42}``, last number), ``format`` and ``length_match`` verifiers;
* :mod:`.user_function` -- ``compute_score(data_source, solution_str, ground_truth,
  extra_info=None)`` loaded from a file, with failures naming the function, row and source;
* :mod:`.manager` -- :class:`RewardManager`, built from a ``RewardConfig``, scoring a batch.
"""
from hyflow.rewards.manager import RewardBatch, RewardManager, RewardModelFn
from hyflow.rewards.rules import (
    DEFAULT_FORMAT_PATTERN,
    RULES,
    exact_match,
    extract_answer,
    extract_number,
    format_match,
    length_match,
    normalize_text,
    numeric_match,
    parse_number,
    rule_names,
)
from hyflow.rewards.user_function import RewardError, UserFunction, coerce_score, load_user_function

__all__ = [
    "RewardBatch", "RewardManager", "RewardModelFn",
    "DEFAULT_FORMAT_PATTERN", "RULES", "exact_match", "extract_answer", "extract_number", "format_match", "length_match",
    "normalize_text", "numeric_match", "parse_number", "rule_names",
    "RewardError", "UserFunction", "coerce_score", "load_user_function",
]
