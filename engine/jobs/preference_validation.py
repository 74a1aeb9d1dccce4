"""Held-out validation of the preference jobs (``data.val_files`` with ``job: dpo`` / ``kto``).

The validation rows' reference log-probs are scored once at the start (a table of two floats per
row on every rank: chosen / rejected, or completion / KL pair); every ``trainer.val_every`` steps,
after the last step and (``trainer.val_before_train``) before the first, the policy scores the
rows the same way (each data-parallel rank a share, forward only) and the job's own metric
function turns this rank's rows into the whole set's numbers with TRL's names and its ``eval_``
prefix: ``eval_rewards/accuracies``, ``eval_rewards/margins``, ``eval_loss``, ...
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional

import torch

from hyflow.data.preference import PreferenceDataset, build_preference_dataset
from hyflow.jobs.preference_models import Policy, ReferenceLogps, build_reference_model, precompute

#: ``metrics(records, policy_logps [n, 2], reference_logps [n, 2], total) -> dict``: this DP rank's
#: ``records`` of the validation set of ``total`` rows; returns the whole set's metrics (collective).
MetricsFn = Callable[[list, torch.Tensor, torch.Tensor, int], dict]
PREFIX = "eval_"


class PreferenceValidation:
    """The validation rows, their reference log-probs and the schedule."""

    def __init__(self, dataset: PreferenceDataset, reference: torch.Tensor, every: int, before_train: bool) -> None:
        self.dataset, self.reference = dataset, reference
        self.every, self.before_train = every, before_train

    @classmethod
    def build(cls, cfg: Any, policy: Policy, tokenizer: Any, reference: ReferenceLogps,
              log: Callable[[str], None]) -> Optional["PreferenceValidation"]:
        """None without ``data.val_files``; else the rows (tokenized and length-filtered as the
        training rows) and their reference log-probs (the reference model, built for the purpose
        when the job freed its own)."""
        if not cfg.data.val_files:
            return None
        data = dataclasses.replace(cfg.data, train_files=list(cfg.data.val_files), task=None)
        dataset = build_preference_dataset(data, tokenizer, cfg.job)
        dp = policy.groups.layout.dp
        if len(dataset) < dp:
            raise ValueError(f"data.val_files hold {len(dataset)} usable rows, fewer than the {dp} data-parallel "
                             "ranks that share them: give more validation rows")
        if reference.free:
            table = torch.zeros(len(dataset), 2, device="cpu")  # host table, rows moved per step
        else:
            model = reference.model if reference.model is not None else build_reference_model(cfg, policy)
            table = precompute(model, dataset, policy, cfg.actor.micro_batch_size, log)
            del model
        log(f"[hyflow] validation: {len(dataset)} held-out rows from {', '.join(cfg.data.val_files)}")
        return cls(dataset, table, cfg.trainer.val_every, cfg.trainer.val_before_train)

    def due(self, step: int, total_steps: int) -> bool:
        return step == total_steps or bool(self.every and step % self.every == 0)

    @staticmethod
    def summary(step: int, metrics: dict) -> str:
        """``[hyflow] validation after step N: eval_rewards/accuracies 0.75 | ...``."""
        when = "before training" if step == 0 else f"after step {step}"
        keys = [k for k in ("eval_rewards/accuracies", "eval_rewards/margins", "eval_loss") if k in metrics]
        return f"[hyflow] validation {when}: " + " | ".join(f"{k} {metrics[k]:.4g}" for k in keys)

    def run(self, cfg: Any, policy: Policy, metrics: MetricsFn) -> dict[str, float]:
        """Score the rows with the current policy; the whole set's metrics, ``eval_``-prefixed."""
        start = time.perf_counter()
        scores = precompute(policy.chunks[0], self.dataset, policy, cfg.actor.micro_batch_size, lambda _: None)
        groups = policy.groups
        rows = list(range(groups.dp_rank, len(self.dataset), groups.layout.dp))
        index = torch.tensor(rows, dtype=torch.long, device=scores.device)
        out = metrics([self.dataset[i] for i in rows], scores[index].to(groups.device),
                      self.reference[index].to(groups.device), len(self.dataset))
        result = {PREFIX + key: value for key, value in out.items()}
        result["time/eval"] = time.perf_counter() - start
        return result
