"""The ``algorithm`` section of the RL job and the algorithm choices the actor section names:
advantage estimators, policy losses, loss aggregation, KL estimators, in-reward KL control, DAPO's
overlong penalty, rollout correction (importance sampling between sampler and trainer).

A light module (no torch): validated with the rest of :class:`hyflow.jobs.rl_config.RLJobConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hyflow.choices import CorrectionMode, KLKind
from hyflow.config import ConfigError
from hyflow.config.checks import check_finite, check_positive

AdvEstimator = Literal["gae", "grpo", "dr_grpo", "grpo_passk", "rloo", "reinforce_plus_plus",
                       "reinforce_plus_plus_baseline", "remax"]
#: estimators that compare the responses within a prompt's group (they need rollout.n >= 2)
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "grpo_passk", "rloo", "reinforce_plus_plus_baseline")


@dataclass
class RolloutCorrectionConfig:
    """Importance-sampling correction of the gap between the sampler's log-probs and the
    training-layout forward's (``actor.old_logprobs=recompute``); see docs/algorithms.md."""

    mode: CorrectionMode = field(default="off", metadata={
        "help": "off | token_tis (w = min(rho_t, cap)) | seq_tis (w = min(prod_t rho_t, cap)) | seq_mis "
                "(drop sequences whose prod_t rho_t leaves [low, high], weight the rest by it) | icepop "
                "(drop tokens whose rho_t leaves [low, high], weight the rest by it); "
                "rho = pi_train / pi_sampler"})
    cap: float = field(default=2.0, metadata={"help": "truncation C of token_tis / seq_tis (> 0)"})
    low: float = field(default=0.5, metadata={"help": "lower end of the kept ratio band (seq_mis, icepop)"})
    high: float = field(default=2.0, metadata={
        "help": "upper end of the kept ratio band (seq_mis, icepop; the IcePop paper used [0.5, 5])"})

    def validate(self) -> None:
        if self.cap <= 0:
            raise ConfigError(f"must be > 0, got {self.cap}", key="cap")
        if not 0 <= self.low < self.high:
            raise ConfigError(f"need 0 <= low < high, got low={self.low}, high={self.high}")


@dataclass
class KLControlConfig:
    """KL penalty coefficient in the reward: fixed, or adaptive towards a target KL."""

    type: Literal["fixed", "adaptive"] = field(default="fixed", metadata={
        "help": "fixed coefficient, or adaptive (moves the coefficient towards target_kl)"})
    kl_coef: float = field(default=0.001, metadata={
        "help": "coefficient of the in-reward KL penalty (initial value when adaptive)"})
    target_kl: float = field(default=0.1, metadata={"help": "adaptive: the KL the controller aims for"})
    horizon: int = field(default=10000, metadata={"help": "adaptive: steps over which the coefficient adapts"})

    def validate(self) -> None:
        check_finite(self, "kl_coef", "target_kl")
        if self.kl_coef < 0:
            raise ConfigError(f"must be >= 0 (a penalty), got {self.kl_coef}", key="kl_coef")
        if self.target_kl <= 0:
            raise ConfigError(f"must be > 0, got {self.target_kl}", key="target_kl")
        check_positive(self, "horizon")


@dataclass
class OverlongBufferConfig:
    """DAPO soft overlong punishment: a reward term falling linearly from 0 to -penalty_factor over
    the last ``length`` tokens of the response budget (rollout.max_new_tokens)."""

    enable: bool = field(default=False, metadata={"help": "add the overlong penalty to every response's reward"})
    length: int = field(default=16, metadata={
        "unit": "tokens", "help": "buffer length in tokens (<= rollout.max_new_tokens)"})
    penalty_factor: float = field(default=1.0, metadata={"help": "penalty of a response that uses the whole budget"})

    def validate(self) -> None:
        check_positive(self, "length")
        if self.penalty_factor < 0:
            raise ConfigError(f"must be >= 0, got {self.penalty_factor}", key="penalty_factor")


@dataclass
class DynamicSamplingConfig:
    """DAPO dynamic sampling (verl's ``algorithm.filter_groups``): groups whose rewards are all equal
    carry no group-relative signal; they are dropped and more prompts are generated until every
    data-parallel rank holds its share of ``data.train_batch_size`` groups with signal."""

    enable: bool = field(default=False, metadata={"help": "drop groups with equal rewards and refill the batch"})
    max_rounds: int = field(default=4, metadata={
        "help": "generation rounds per step at most (verl's max_num_gen_batches); when reached the batch is "
                "completed with groups without signal, a warning is printed and "
                "dynamic_sampling/gave_up is 1"})

    def validate(self) -> None:
        check_positive(self, "max_rounds")


@dataclass
class AlgorithmConfig:
    """Advantage estimation and reward shaping."""

    adv_estimator: AdvEstimator = field(default="grpo", metadata={
        "help": "gae (needs critic.enable=true) | grpo | dr_grpo | grpo_passk (only each group's best response is "
                "credited, with its margin over the second best) | rloo | reinforce_plus_plus | "
                "reinforce_plus_plus_baseline | remax"})
    gamma: float = field(default=1.0, metadata={"help": "discount factor (gae, reinforce_plus_plus)"})
    lam: float = field(default=1.0, metadata={"help": "GAE lambda"})
    norm_adv_by_std_in_grpo: bool = field(default=True, metadata={
        "help": "GRPO: divide group-centred scores by the group's standard deviation"})
    use_kl_in_reward: bool = field(default=False, metadata={
        "help": "subtract kl_ctrl.kl_coef x KL(actor || reference) from the reward"})
    kl_penalty: KLKind = field(default="k1", metadata={"help": "KL estimator of the in-reward penalty"})
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)

    def validate(self) -> None:
        check_finite(self, "gamma", "lam")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ConfigError(f"gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}")
