"""Score a batch of decoded responses: rule verifiers, a user function, or a reward model.

:class:`RewardManager` is built from a ``RewardConfig`` (:meth:`RewardManager.from_config`)
and turns responses plus their rows' ``data_source`` / ``ground_truth`` / ``extra_info`` into
one float per response (:class:`RewardBatch`). Any failure raises :class:`RewardError` naming
the scorer, the row and its data source; nothing is silently scored 0.

The reward-model path is an interface: the trainer passes ``model_fn(prompts, responses) ->
scores`` (a scalar-head model it runs), and the manager validates what comes back. With
``kind=model`` the reward model's score is the reward (``model_coef * rm``); with ``kind=rule`` or
``function`` and a ``model_fn`` (the trainer passes one when ``reward.model_checkpoint`` is set)
the two are combined: ``rule/function score + model_coef * rm``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from hyflow.rewards.rules import DEFAULT_FORMAT_PATTERN, RULES, format_match
from hyflow.rewards.user_function import RewardError, coerce_score, load_user_function
from hyflow.rewards.worker import TIMED_OUT, FunctionPool

__all__ = ["RewardBatch", "RewardManager", "RewardModelFn"]

#: ``model_fn(prompts, responses) -> one score per response`` (prompts as chat-formatted text).
#: When the caller has the token ids it passes them too, as ``sequences=`` (one ``prompt ids +
#: response ids`` list per response); the trainer's reward model scores exactly those tokens.
RewardModelFn = Callable[..., Sequence[float]]
_MAX_LISTED = 5


@dataclass
class RewardBatch:
    """Scores of a batch, the rows' data sources and per-sample extras from user functions."""

    scores: list[float]
    data_sources: list[str]
    extras: dict[str, list[float]] = field(default_factory=dict)  # NaN where a sample lacks the key
    timeouts: int = 0  # calls of a user function stopped at reward.timeout_s, scored timeout_score

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        """``reward/mean|std|min|max``, ``reward/<data_source>/mean`` when there are several
        sources, and ``reward/extra/<key>`` means."""
        out: dict[str, float] = {}
        if not self.scores:
            return out
        n = len(self.scores)
        mean = sum(self.scores) / n
        out[f"{prefix}/mean"] = mean
        out[f"{prefix}/std"] = math.sqrt(sum((s - mean) ** 2 for s in self.scores) / n)
        out[f"{prefix}/min"] = min(self.scores)
        out[f"{prefix}/max"] = max(self.scores)
        sources = sorted(set(self.data_sources))
        if len(sources) > 1:
            for src in sources:
                vals = [s for s, d in zip(self.scores, self.data_sources) if d == src]
                out[f"{prefix}/{src}/mean"] = sum(vals) / len(vals)
        for key, vals in self.extras.items():
            finite = [v for v in vals if not math.isnan(v)]
            if finite:
                out[f"{prefix}/extra/{key}"] = sum(finite) / len(finite)
        return out


class RewardManager:
    """Scores responses with one scorer: ``kind`` is ``rule``, ``function`` or ``model``.

    ``scorer(data_source, solution_str, ground_truth, extra_info, where) -> (score, extras)``
    serves the rule and function kinds; ``model_fn`` the model kind. For rules,
    ``format_score`` is the partial credit given to a wrong answer whose response still
    matches ``format_pattern`` (0 = plain 0/1 rewards).

    A ``model_fn`` given with a rule / function scorer is added to it: ``score = scorer +
    model_coef * model_fn`` (the reward model's raw score is kept as the ``reward_model`` extra);
    with ``kind=model`` the score is ``model_coef * model_fn``.
    """

    def __init__(self, kind: str, name: str, scorer: Optional[Callable[..., tuple[float, dict]]] = None,
                 model_fn: Optional[RewardModelFn] = None, model_coef: float = 1.0,
                 pool: Optional[FunctionPool] = None, timeout_score: float = 0.0) -> None:
        if kind in ("rule", "function") and scorer is None and pool is None:
            raise ValueError(f"reward kind {kind!r} needs a scorer")
        self.pool, self.timeout_score = pool, float(timeout_score)
        if kind == "model" and model_fn is None:
            raise RewardError("reward.kind=model: the trainer must pass the reward model's scoring "
                              "function (model_fn) to RewardManager.from_config")
        self.kind, self.name, self.scorer, self.model_fn = kind, name, scorer, model_fn
        self.model_coef = float(model_coef)

    # ----------------------------------------------------------------------------- construction

    @classmethod
    def from_rule(cls, rule: str, format_score: float = 0.0, format_pattern: Optional[str] = None,
                  **rule_options: Any) -> "RewardManager":
        """A manager scoring with the built-in rule ``rule`` (``hyflow.rewards.rules.RULES``)."""
        if rule not in RULES:
            raise RewardError(f"unknown reward rule {rule!r}; available: {', '.join(sorted(RULES))}")
        fn = RULES[rule]
        pattern = format_pattern or DEFAULT_FORMAT_PATTERN
        if rule == "format":
            rule_options.setdefault("pattern", pattern)

        def score(data_source: str, solution: str, ground_truth: Any, extra_info: Optional[dict],
                  where: Optional[str] = None) -> tuple[float, dict]:
            try:
                value = fn(solution, ground_truth, extra_info, **rule_options)
            except (ValueError, TypeError) as exc:
                raise RewardError(f"reward rule {rule} cannot score {where or 'a sample'} "
                                  f"(data_source={data_source!r}): {exc}", function=rule, row=where,
                                  data_source=data_source) from exc
            if value == 0.0 and format_score and rule != "format":
                row_pattern = (extra_info or {}).get("format_pattern") or pattern
                value = format_score * format_match(solution, row_pattern)
            return float(value), {}

        return cls("rule", f"rule:{rule}", scorer=score)

    @classmethod
    def from_function(cls, path: str, name: str = "compute_score", timeout_s: float = 0.0,
                      batch_timeout_s: float = 0.0, workers: int = 1, timeout_score: float = 0.0) -> "RewardManager":
        """A manager calling the user function ``name`` from the file ``path``: in worker processes
        with a time limit per call (and per batch) when ``timeout_s`` > 0 (:mod:`hyflow.rewards.worker`),
        else in this process."""
        if timeout_s > 0:
            pool = FunctionPool(path, name, workers=workers, timeout_s=timeout_s, batch_timeout_s=batch_timeout_s)
            return cls("function", f"function:{name}", pool=pool, timeout_score=timeout_score)
        fn = load_user_function(path, name)
        return cls("function", f"function:{fn.name}", scorer=fn)

    def close(self) -> None:
        """Stop the worker processes of a user function (no-op otherwise)."""
        if self.pool is not None:
            self.pool.close()

    @classmethod
    def from_config(cls, cfg: Any, model_fn: Optional[RewardModelFn] = None) -> "RewardManager":
        """From a ``RewardConfig``; ``model_fn`` is required when ``cfg.kind == "model"`` or a
        rule / function is combined with ``cfg.model_checkpoint``.

        Optional keys read when the config has them: ``format_score``, ``format_pattern``,
        ``model_coef``.
        """
        coef = getattr(cfg, "model_coef", 1.0)
        if cfg.kind == "model":
            return cls("model", f"model:{cfg.model_checkpoint}", model_fn=model_fn, model_coef=coef)
        if cfg.kind == "rule":
            out = cls.from_rule(cfg.rule, format_score=getattr(cfg, "format_score", 0.0) or 0.0,
                                format_pattern=getattr(cfg, "format_pattern", None))
        elif cfg.kind == "function":
            out = cls.from_function(cfg.function_path, cfg.function_name, timeout_s=getattr(cfg, "timeout_s", 0.0),
                                    batch_timeout_s=getattr(cfg, "batch_timeout_s", 0.0),
                                    workers=getattr(cfg, "workers", 1), timeout_score=getattr(cfg, "timeout_score", 0.0))
        else:
            raise RewardError(f"unknown reward.kind {cfg.kind!r}")
        if getattr(cfg, "model_checkpoint", None):
            if model_fn is None:
                raise RewardError(f"reward.model_checkpoint is set with reward.kind={cfg.kind}: the trainer "
                                  "must pass the reward model's scoring function (model_fn) to "
                                  "RewardManager.from_config")
            out.model_fn, out.model_coef = model_fn, float(coef)
            out.name += f"+model:{cfg.model_checkpoint}"
        return out

    # ----------------------------------------------------------------------------- scoring

    def score(self, solutions: Sequence[str], data_sources: Sequence[str], ground_truths: Sequence[Any],
              extra_infos: Optional[Sequence[Optional[dict]]] = None, where: Optional[Sequence[str]] = None,
              prompts: Optional[Sequence[str]] = None,
              sequences: Optional[Sequence[Sequence[int]]] = None) -> RewardBatch:
        """One score per response; ``where[i]`` names sample ``i`` in errors (default ``sample i``).
        ``sequences`` (prompt + response token ids) are handed to ``model_fn`` when given."""
        n = len(solutions)
        extra_infos = list(extra_infos) if extra_infos is not None else [None] * n
        where = list(where) if where is not None else [f"sample {i}" for i in range(n)]
        lengths = {len(data_sources), len(ground_truths), len(extra_infos), len(where)}
        if prompts is not None:
            lengths.add(len(prompts))
        if sequences is not None:
            lengths.add(len(sequences))
        if lengths != {n}:
            raise ValueError(f"score(): {n} solutions but inputs of lengths {sorted(lengths)}")
        if self.kind == "model":
            return self._score_model(solutions, data_sources, prompts, where, sequences)
        base = self._score_scorer(solutions, data_sources, ground_truths, extra_infos, where)
        if self.model_fn is None:
            return base
        model = self._score_model(solutions, data_sources, prompts, where, sequences, coef=1.0)
        scores = [b + self.model_coef * m for b, m in zip(base.scores, model.scores)]
        return RewardBatch(scores, base.data_sources, dict(base.extras, reward_model=model.scores),
                           timeouts=base.timeouts)

    def _score_scorer(self, solutions: Sequence[str], data_sources: Sequence[str], ground_truths: Sequence[Any],
                      extra_infos: Sequence[Optional[dict]], where: Sequence[str]) -> RewardBatch:
        n = len(solutions)
        scores: list[float] = []
        extras: dict[str, list[float]] = {}
        timeouts = 0
        if self.pool is not None:
            results = self.pool.map([(data_sources[i], solutions[i], ground_truths[i], extra_infos[i], where[i])
                                     for i in range(n)])
        for i in range(n):
            if self.pool is None:
                assert self.scorer is not None
                s, ex = self.scorer(data_sources[i], solutions[i], ground_truths[i], extra_infos[i], where=where[i])
            elif results[i] is TIMED_OUT:
                s, ex = self.timeout_score, {}
                timeouts += 1
            else:
                s, ex = results[i]
            scores.append(s)
            for key, value in ex.items():
                extras.setdefault(key, [math.nan] * i).append(value)
            for vals in extras.values():
                if len(vals) < i + 1:
                    vals.append(math.nan)
        return RewardBatch(scores, list(data_sources), extras, timeouts=timeouts)

    def _score_model(self, solutions: Sequence[str], data_sources: Sequence[str],
                     prompts: Optional[Sequence[str]], where: Sequence[str],
                     sequences: Optional[Sequence[Sequence[int]]] = None,
                     coef: Optional[float] = None) -> RewardBatch:
        if prompts is None:
            raise ValueError("a reward model needs the prompts to score responses")
        assert self.model_fn is not None
        kwargs = {} if sequences is None else {"sequences": [list(s) for s in sequences]}
        raw = list(self.model_fn(list(prompts), list(solutions), **kwargs))
        if len(raw) != len(solutions):
            raise RewardError(f"reward model returned {len(raw)} scores for {len(solutions)} responses",
                              function=self.name)
        scores = []
        for value, w, src in zip(raw, where, data_sources):
            try:
                scores.append(coerce_score(value, "reward model")[0])
            except ValueError as exc:
                raise RewardError(f"{exc} on {w} (data_source={src!r})", function=self.name, row=w,
                                  data_source=src) from None
        coef = self.model_coef if coef is None else coef
        if coef != 1.0:
            scores = [coef * s for s in scores]
        return RewardBatch(scores, list(data_sources))

    def score_records(self, records: Sequence[Any], solutions: Sequence[str],
                      sequences: Optional[Sequence[Sequence[int]]] = None) -> RewardBatch:
        """Score responses to ``records`` (:class:`hyflow.data.PromptRecord`).

        ``len(solutions)`` must be a multiple ``n`` of ``len(records)``; responses are grouped per
        prompt: ``solutions[i*n:(i+1)*n]`` answer ``records[i]`` (the GRPO group layout).
        ``sequences[i]`` (optional) are response ``i``'s prompt + response token ids, for a reward model.
        """
        if not records or len(solutions) % len(records):
            raise ValueError(f"{len(solutions)} responses is not a multiple of {len(records)} prompts")
        n = len(solutions) // len(records)
        rep = [r for r in records for _ in range(n)]
        return self.score(solutions, [r.data_source for r in rep], [r.ground_truth for r in rep],
                          [r.extra_info for r in rep], where=[r.where for r in rep],
                          prompts=[r.prompt_text for r in rep], sequences=sequences)

    def check_records(self, records: Sequence[Any]) -> None:
        """Fail before training when a rule cannot use some row's ground truth (all bad rows
        counted, the first few named). Function and model scorers are not checked here."""
        if self.kind != "rule":
            return
        assert self.scorer is not None
        bad = []
        for r in records:
            try:
                self.scorer(r.data_source, "", r.ground_truth, r.extra_info, where=r.where)
            except RewardError as exc:
                bad.append(str(exc))
        if bad:
            listed = "\n  ".join(bad[:_MAX_LISTED])
            more = f"\n  ... and {len(bad) - _MAX_LISTED} more" if len(bad) > _MAX_LISTED else ""
            raise RewardError(f"{len(bad)} row(s) have ground truths {self.name} cannot use:\n  {listed}{more}",
                              function=self.name)
