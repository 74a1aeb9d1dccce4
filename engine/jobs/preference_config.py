"""Configuration of the preference jobs: ``job: dpo`` (DPO / IPO / hinge, conservative and
reference-free DPO) and ``job: kto``.

A light module (no torch / Megatron imports): ``hyflow train`` validates a config with it
before any process starts. Sections: model, actor (the trained policy: layout, optimizer,
micro-batches), algorithm (the loss, with TRL's key names), data (preference rows), trainer.
The reference is always a frozen copy of the starting actor (``actor.checkpoint``, or the
random initialisation of ``model`` with ``trainer.seed``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from hyflow.checkpoint.architecture import adopt_checkpoint_architecture, adopt_model_tokenizer
from hyflow.config import ConfigError
from hyflow.config.checks import check_positive
from hyflow.jobs.rl_config import TrainedModelConfig
from hyflow.jobs.trainer_config import ValidatedTrainerConfig
from hyflow.models.description import ModelDescription, tiny_llama
from hyflow.parallel.layout import Layout


@dataclass
class PolicyConfig(TrainedModelConfig):
    """The trained policy; the reference is a frozen copy of its starting weights."""

    micro_batch_size: int = field(default=4, metadata={
        "unit": "pairs (dpo) / examples (kto) per DP rank",
        "help": "pairs (dpo: chosen + rejected, 2 sequences each) or examples (kto) per forward/backward"})

    def validate(self) -> None:
        super().validate()
        check_positive(self, "micro_batch_size")
        if self.layout.cp > 1:
            raise ConfigError("context parallelism (cp > 1) is not supported by the preference jobs; "
                              "set actor.layout.cp=1", key="layout.cp")
        if self.layout.vpp:
            raise ConfigError("virtual pipeline stages (vpp) are not supported by the preference jobs "
                              "(checkpoints hold one model chunk per rank); unset actor.layout.vpp",
                              key="layout.vpp")


@dataclass
class DPOAlgorithmConfig:
    """The DPO loss (TRL's key names)."""

    loss_type: Literal["sigmoid", "ipo", "hinge"] = field(default="sigmoid", metadata={
        "help": "sigmoid: DPO; ipo: IPO (sequence log-probs, as in the paper); hinge: SLiC-HF's hinge"})
    beta: float = field(default=0.1, metadata={
        "help": "strength of the KL constraint to the reference (IPO: tau; hinge: 1/margin)"})
    label_smoothing: float = field(default=0.0, metadata={
        "help": "conservative DPO: probability that a pair's preference label is flipped (sigmoid only)"})
    reference_free: bool = field(default=False, metadata={
        "help": "compare against a uniform reference (log-probs 0): no reference model at all"})
    precompute_ref_logprobs: bool = field(default=False, metadata={
        "help": "score the whole dataset with the reference once before training (cached in the run's "
                "checkpoints/ so resuming does not recompute) and free the reference model"})
    rpo_alpha: float = field(default=0.0, metadata={
        "help": "RPO (Pang et al. 2024): add rpo_alpha * the chosen response's token-mean negative "
                "log-likelihood to each pair's loss, so training keeps raising the chosen answer instead of "
                "only pushing the rejected one down; 0: plain DPO (TRL's rpo_alpha; TRL averages the NLL over "
                "the batch's chosen tokens, here over each pair's, then over pairs)"})

    def validate(self) -> None:
        if self.beta <= 0:
            raise ConfigError(f"must be > 0, got {self.beta}", key="beta")
        if not (math.isfinite(self.rpo_alpha) and self.rpo_alpha >= 0):
            raise ConfigError(f"must be a finite number >= 0 (0: plain DPO), got {self.rpo_alpha}", key="rpo_alpha")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"must be in [0, 0.5), got {self.label_smoothing}", key="label_smoothing")
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ConfigError(f"label_smoothing (conservative DPO) applies to loss_type=sigmoid only, "
                              f"not {self.loss_type!r}", key="label_smoothing")
        if self.reference_free and self.precompute_ref_logprobs:
            raise ConfigError("reference_free=true has no reference to precompute: drop "
                              "precompute_ref_logprobs", key="precompute_ref_logprobs")


@dataclass
class KTOAlgorithmConfig:
    """The KTO loss (TRL's key names)."""

    beta: float = field(default=0.1, metadata={"help": "strength of the KL constraint to the reference"})
    desirable_weight: float = field(default=1.0, metadata={
        "help": "lambda_D, the weight of desirable examples' losses"})
    undesirable_weight: float = field(default=1.0, metadata={
        "help": "lambda_U, the weight of undesirable examples' losses (the paper suggests "
                "lambda_D * n_D / (lambda_U * n_U) in [1, 4/3])"})
    precompute_ref_logprobs: bool = field(default=False, metadata={
        "help": "score the whole dataset (completions and KL pairs) with the reference once before "
                "training (cached in the run's checkpoints/) and free the reference model"})

    def validate(self) -> None:
        if self.beta <= 0:
            raise ConfigError(f"must be > 0, got {self.beta}", key="beta")
        if self.desirable_weight <= 0 or self.undesirable_weight <= 0:
            raise ConfigError("desirable_weight and undesirable_weight must be > 0")


@dataclass
class PreferenceDataConfig:
    """Preference rows in TRL's formats (DPO: prompt/chosen/rejected; KTO: prompt/completion/label),
    from files or a built-in synthetic task."""

    train_files: list[str] = field(default_factory=list, metadata={"help": "parquet or jsonl files"})
    val_files: list[str] = field(default_factory=list, metadata={
        "help": "held-out rows in the same format, scored every trainer.val_every steps (eval_rewards/accuracies, "
                "eval_rewards/margins, eval_loss, ...); empty = no validation"})
    task: Optional[str] = field(default=None, metadata={
        "help": "built-in preference task generated locally instead of files (hyflow make-task --list)"})
    task_size: int = field(default=2000, metadata={
        "unit": "problems", "help": "problems generated for a synthetic task"})
    task_options: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "options of the synthetic task's generator, e.g. {ops: '+-', max_operand: 20}"})
    tokenizer: Optional[str] = field(default=None, metadata={"help": "HF tokenizer dir / sentencepiece model"})
    train_batch_size: int = field(default=32, metadata={
        "unit": "pairs (dpo) / examples (kto), all DP ranks",
        "help": "pairs (dpo) or examples (kto) per optimizer step, all data-parallel ranks together"})
    max_prompt_length: int = field(default=128, metadata={
        "unit": "tokens", "help": "longest prompt in tokens (after the chat template)"})
    max_completion_length: int = field(default=128, metadata={
        "unit": "tokens", "help": "longest completion in tokens"})
    truncate_long: bool = field(default=False, metadata={
        "help": "truncate over-long rows (prompts from the left, completions from the right) instead of "
                "dropping them"})
    shuffle: bool = field(default=True, metadata={
        "help": "shuffle the rows every epoch (deterministic from data.seed, resumable)"})
    seed: int = field(default=1, metadata={"help": "data order (and the synthetic task's draw)"})

    def validate(self) -> None:
        check_positive(self, "train_batch_size", "task_size", "max_prompt_length", "max_completion_length")
        if not self.train_files and not self.task:
            raise ConfigError("set data.train_files or data.task")


@dataclass
class PreferenceTrainerConfig(ValidatedTrainerConfig):
    """Run-level settings."""

    total_steps: int = field(default=100, metadata={"help": "optimizer steps"})
    output_dir: str = field(default="runs/dpo", metadata={"help": "metrics, config, TensorBoard, checkpoints"})


def _validate_job(cfg: "PreferenceJobConfig") -> None:
    if cfg.actor.checkpoint:  # the architecture and (without data.tokenizer) the tokenizer are the checkpoint's
        cfg.model, _ = adopt_checkpoint_architecture(cfg.actor.checkpoint, cfg.model, tiny_llama())
        adopt_model_tokenizer(cfg.data, cfg.model)
    world = cfg.trainer.nproc
    layout = cfg.actor_layout(world)
    layout.check_model(cfg.model)
    per_rank, rest = divmod(cfg.data.train_batch_size, layout.dp * cfg.actor.micro_batch_size)
    if rest:
        what = "pairs" if cfg.job == "dpo" else "examples"
        raise ConfigError(
            f"data.train_batch_size={cfg.data.train_batch_size} {what} must be a multiple of dp * "
            f"actor.micro_batch_size = {layout.dp} * {cfg.actor.micro_batch_size} (each data-parallel rank "
            f"takes whole micro-batches of whole pairs)")
    total = cfg.data.max_prompt_length + cfg.data.max_completion_length
    if total > cfg.model.max_position_embeddings:
        raise ConfigError(
            f"data.max_prompt_length + max_completion_length = {total} exceeds "
            f"model.max_position_embeddings={cfg.model.max_position_embeddings}")


@dataclass
class PreferenceJobConfig:
    """The sections and checks ``job: dpo`` and ``job: kto`` share; each sets ``job`` and
    ``algorithm`` (and its trainer's default output directory)."""

    job: str = field(default="dpo", metadata={"help": "the job this config runs (dpo or kto)"})
    model: ModelDescription = field(default_factory=tiny_llama, metadata={
        "help": "architecture (ignored when actor.checkpoint is set: read from its model.json)"})
    actor: PolicyConfig = field(default_factory=PolicyConfig)
    algorithm: Any = None
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    trainer: PreferenceTrainerConfig = field(default_factory=PreferenceTrainerConfig)

    def actor_layout(self, world_size: Optional[int] = None) -> Layout:
        """The actor's training layout with dp filled in for ``world_size`` ranks."""
        return self.actor.layout.with_dp_for(world_size or self.trainer.nproc)

    def validate(self) -> None:
        _validate_job(self)


@dataclass
class DPOJobConfig(PreferenceJobConfig):
    """``job: dpo`` - Direct Preference Optimisation (and IPO, hinge, cDPO) on preference pairs."""

    job: Literal["dpo"] = field(default="dpo", metadata={"help": "the job this config runs (dpo or kto)"})
    algorithm: DPOAlgorithmConfig = field(default_factory=DPOAlgorithmConfig)


@dataclass
class KTOJobConfig(PreferenceJobConfig):
    """``job: kto`` - Kahneman-Tversky Optimisation on unpaired desirable / undesirable examples."""

    job: Literal["kto"] = field(default="kto", metadata={"help": "the job this config runs (dpo or kto)"})
    algorithm: KTOAlgorithmConfig = field(default_factory=KTOAlgorithmConfig)
    trainer: PreferenceTrainerConfig = field(default_factory=lambda: PreferenceTrainerConfig(output_dir="runs/kto"))
