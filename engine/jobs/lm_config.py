"""Configuration of the ``lm`` job (light: validates without importing torch/Megatron)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hyflow.config import ConfigError
from hyflow.jobs.trainer_config import TrainerConfig
from hyflow.models.description import ModelDescription, tiny_llama
from hyflow.parallel.layout import Layout
from hyflow.training.optim_config import OptimConfig


@dataclass
class LMDataConfig:
    """Synthetic next-token data."""

    task: Literal["arith_sequences"] = field(
        default="arith_sequences",
        metadata={"help": "arith_sequences: x_t = a + t*d mod vocab, random a and d per row"})
    seq_length: int = field(default=32, metadata={"unit": "tokens", "help": "tokens per sequence"})
    micro_batch_size: int = field(default=4, metadata={
        "unit": "sequences per DP rank", "help": "sequences per micro-batch"})
    global_batch_size: int = field(default=16, metadata={
        "unit": "sequences, all DP ranks", "help": "sequences per optimizer step"})
    max_step_size: int = field(default=7, metadata={"help": "largest progression step d"})

    def validate(self) -> None:
        for name in ("seq_length", "micro_batch_size", "global_batch_size", "max_step_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)}", key=name)
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} is not a multiple of "
                f"micro_batch_size={self.micro_batch_size}", key="global_batch_size")


@dataclass
class LMActorConfig:
    """The trained model: layout, precision, optimizer."""

    layout: Layout = field(default_factory=Layout,
                           metadata={"help": "training layout; dp is derived from trainer.nproc"})
    dtype: Literal["fp32", "bf16", "fp16"] = field(default="fp32", metadata={"help": "parameter dtype"})
    spec: Literal["auto", "local", "sdpa", "te"] = field(default="auto", metadata={"help": "layer spec"})
    recompute: Literal["none", "selective", "full"] = field(default="none", metadata={
        "help": "activation recomputation: selective (core attention) or full (every layer)"})
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class LMTrainerConfig(TrainerConfig):
    """Run-level settings."""

    total_steps: int = field(default=60, metadata={"help": "optimizer steps"})
    output_dir: str = field(default="runs/lm", metadata={"help": "metrics, config, TensorBoard, checkpoints"})


@dataclass
class LMJobConfig:
    """``job: lm`` - train a language model on synthetic data."""

    job: Literal["lm"] = field(default="lm", metadata={"help": "which job the config describes"})
    model: ModelDescription = field(default_factory=tiny_llama)
    actor: LMActorConfig = field(default_factory=LMActorConfig)
    data: LMDataConfig = field(default_factory=LMDataConfig)
    trainer: LMTrainerConfig = field(default_factory=LMTrainerConfig)

    def validate(self) -> None:
        layout = self.actor.layout
        per_replica = layout.tp * layout.pp * layout.cp
        if self.trainer.nproc % per_replica:
            raise ConfigError(
                f"trainer.nproc={self.trainer.nproc} is not a multiple of tp*pp*cp = {per_replica}")
        layout = layout.with_dp_for(self.trainer.nproc)
        layout.check_model(self.model, seq_length=self.data.seq_length)
        if self.data.seq_length > self.model.context_length:
            raise ConfigError(
                f"data.seq_length={self.data.seq_length} exceeds the model's context length "
                f"{self.model.context_length} (model.max_position_embeddings, extended by "
                "model.rope_scaling)")
        if self.data.global_batch_size % (layout.dp * self.data.micro_batch_size):
            raise ConfigError(
                f"data.global_batch_size={self.data.global_batch_size} must be a multiple of "
                f"dp * micro_batch_size = {layout.dp} * {self.data.micro_batch_size}")
        n_micro = self.data.global_batch_size // (layout.dp * self.data.micro_batch_size)
        if layout.vpp and n_micro % layout.pp:
            raise ConfigError(
                f"the interleaved pipeline (vpp={layout.vpp}) needs the micro-batches per rank "
                f"({n_micro}) to be a multiple of pp={layout.pp}; raise data.global_batch_size")
