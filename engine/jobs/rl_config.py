"""Configuration of the ``rl`` job: PPO / GRPO / RLOO / REINFORCE++ post-training.

A light module (no torch / Megatron imports): ``hyflow train`` and ``hyflow plan``
validate a config with it before any process starts. Sections mirror the roles of
the dataflow: actor (trains and generates), rollout (how it generates), reference,
critic, reward, algorithm, data, trainer, cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from hyflow.config import ConfigError
from hyflow.models.description import ModelDescription, tiny_llama
from hyflow.parallel.layout import Layout
from hyflow.training.optim_config import OptimConfig

AdvEstimator = Literal["gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus",
                       "reinforce_plus_plus_baseline", "remax"]
LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLKind = Literal["k1", "k2", "k3", "abs", "low_var_kl"]


def _positive(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is None or value < 1:
            raise ConfigError(f"must be >= 1, got {value}", key=name)


@dataclass
class GenerationLayout:
    """The actor's generation layout; micro-DP replicas fill the remaining ranks."""

    tp: int = field(default=1, metadata={"help": "generation tensor parallel (must divide actor tp)"})
    pp: int = field(default=1, metadata={"help": "generation pipeline parallel (must divide actor pp)"})

    def validate(self) -> None:
        _positive(self, "tp", "pp")


@dataclass
class RolloutConfig:
    """How the actor generates responses."""

    layout: GenerationLayout = field(default_factory=GenerationLayout)
    n: int = field(default=4, metadata={"help": "responses sampled per prompt (the GRPO group size)"})
    max_prompt_length: int = field(default=128, metadata={"help": "longest prompt in tokens"})
    max_new_tokens: int = field(default=64, metadata={"help": "longest response in tokens"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (0 = greedy)"})
    top_k: int = field(default=0, metadata={"help": "keep the k most likely tokens (0 = off)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass (1 = off)"})
    stop_token_ids: list[int] = field(default_factory=list,
                                      metadata={"help": "extra stop ids besides the tokenizer's EOS"})
    truncate_long_prompts: bool = field(default=False, metadata={
        "help": "left-truncate prompts over max_prompt_length instead of dropping them"})
    prefill_chunk_size: int = field(default=0, metadata={"help": "chunked prefill size (0 = whole prompt)"})
    max_concurrent: int = field(default=64, metadata={"help": "sequences decoded at once per replica"})
    offload_grad_buffers: bool = field(default=False, metadata={
        "help": "free the actor's gradient buffers while generating (memory for the KV cache)"})
    offload_optimizer: bool = field(default=False, metadata={
        "help": "move the actor's optimizer state to host memory while generating (GPU)"})

    def validate(self) -> None:
        _positive(self, "n", "max_prompt_length", "max_new_tokens", "max_concurrent")
        if self.temperature < 0:
            raise ConfigError(f"must be >= 0, got {self.temperature}", key="temperature")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"must be in (0, 1], got {self.top_p}", key="top_p")
        if self.top_k < 0 or self.prefill_chunk_size < 0:
            raise ConfigError("top_k and prefill_chunk_size must be >= 0")


@dataclass
class ActorConfig:
    """The policy: trained in ``layout``, generating in ``rollout.layout``."""

    checkpoint: Optional[str] = field(default=None, metadata={
        "help": "converted checkpoint directory (hyflow convert hf2mcore); null = random init of `model`"})
    layout: Layout = field(default_factory=Layout, metadata={"help": "training layout; dp is derived"})
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    spec: Literal["auto", "local", "sdpa", "te"] = "auto"
    recompute: Literal["none", "selective", "full"] = field(default="none", metadata={
        "help": "activation recomputation during the update"})
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    micro_batch_size: int = field(default=4, metadata={"help": "sequences per forward/backward"})
    mini_batch_size: int = field(default=16, metadata={
        "help": "sequences per optimizer step (all data-parallel ranks together)"})
    ppo_epochs: int = field(default=1, metadata={"help": "passes over each rollout batch"})
    old_logprobs: Literal["recompute", "rollout"] = field(default="recompute", metadata={
        "help": "PPO's old log-probs: 'recompute' scores the batch with a training-layout forward; "
                "'rollout' reuses the log-probs the sampler reported (same weights, one forward pass "
                "less per step; equal to ~1e-5 in fp32, but generation kernels or bf16 can differ more: "
                "watch rollout/logprob_diff_max under 'recompute')"})
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: Optional[float] = field(default=None, metadata={"help": "dual-clip constant (> 1) or null"})
    loss_agg_mode: LossAgg = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = field(default=False, metadata={"help": "KL to the reference as a loss term"})
    kl_loss_coef: float = 0.001
    kl_loss_type: KLKind = "low_var_kl"
    sft_warmup_steps: int = field(default=0, metadata={
        "help": "supervised steps on reference answers before RL (for tasks a random model cannot start)"})
    sft_lr: float = field(default=1e-3, metadata={"help": "constant learning rate of the SFT warm-up"})

    def validate(self) -> None:
        _positive(self, "micro_batch_size", "mini_batch_size", "ppo_epochs")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1:
            raise ConfigError(f"must be > 1 or null, got {self.clip_ratio_c}", key="clip_ratio_c")
        if self.clip_ratio_low < 0 or self.clip_ratio_high < 0:
            raise ConfigError("clip ratios must be >= 0")


@dataclass
class CriticConfig:
    """Value model (needed by GAE; GRPO / RLOO / REINFORCE++ run without it)."""

    enable: bool = False
    layout: Layout = field(default_factory=Layout, metadata={
        "help": "must equal the actor's layout for now; the trunk starts from the actor's weights"})
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    micro_batch_size: int = 4
    cliprange_value: float = 0.5

    def validate(self) -> None:
        _positive(self, "micro_batch_size")


@dataclass
class ReferenceConfig:
    """Frozen copy of the initial policy for KL terms."""

    enable: bool = True
    layout: Optional[Layout] = field(default=None, metadata={"help": "null = the actor's training layout"})


@dataclass
class RewardConfig:
    """Where scores come from: a rule, a user function, a reward model, or a rule / function
    plus a reward model (``kind: rule|function`` with ``model_checkpoint`` set):

    * ``kind: model``: score = model_coef * RM;
    * ``kind: rule|function`` and ``model_checkpoint``: score = rule/function score + model_coef * RM;

    RM is the reward model's scalar value head at the last response token of prompt + response
    (the actor's token ids; the reward model must use the actor's tokenizer).
    """

    kind: Literal["rule", "function", "model"] = field(default="rule", metadata={
        "help": "rule | function | model (model: the reward model's score alone)"})
    rule: Literal["exact_match", "numeric_match", "format"] = "numeric_match"
    function_path: Optional[str] = field(default=None, metadata={
        "help": "python file defining compute_score(data_source, solution_str, ground_truth, extra_info=None)"})
    function_name: str = "compute_score"
    model_checkpoint: Optional[str] = field(default=None, metadata={
        "help": "reward model: hyflow checkpoint directory of a GPTModel with a scalar value head (same "
                "tokenizer as the actor), run frozen in the actor's training layout; needed by kind=model, "
                "added to the rule / function score when set with kind=rule|function"})
    model_coef: float = field(default=1.0, metadata={
        "help": "weight of the reward model's score: kind=model -> model_coef * RM; "
                "kind=rule|function -> rule/function score + model_coef * RM"})
    format_score: float = field(default=0.0, metadata={
        "help": "partial credit for a wrong answer whose response matches format_pattern"})
    format_pattern: Optional[str] = field(default=None, metadata={"help": "regex of the `format` rule"})

    def validate(self) -> None:
        if self.kind == "function" and not self.function_path:
            raise ConfigError("reward.kind=function needs reward.function_path", key="function_path")
        if self.kind == "model" and not self.model_checkpoint:
            raise ConfigError("reward.kind=model needs reward.model_checkpoint", key="model_checkpoint")


@dataclass
class KLControlConfig:
    """KL penalty coefficient in the reward: fixed, or adaptive towards a target KL."""

    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class AlgorithmConfig:
    """Advantage estimation and reward shaping."""

    adv_estimator: AdvEstimator = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: KLKind = "k1"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)

    def validate(self) -> None:
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ConfigError(f"gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}")


@dataclass
class DataConfig:
    """Prompts: files in verl's format, or a built-in synthetic task."""

    train_files: list[str] = field(default_factory=list, metadata={"help": "parquet or jsonl files"})
    task: Optional[str] = field(default=None, metadata={
        "help": "built-in synthetic task generated locally instead of files"})
    task_size: int = field(default=2000, metadata={"help": "prompts generated for a synthetic task"})
    task_options: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "options of the synthetic task's generator, e.g. {min_digits: 2, max_digits: 4}"})
    tokenizer: Optional[str] = field(default=None, metadata={"help": "HF tokenizer dir / sentencepiece model"})
    prompt_key: str = "prompt"
    train_batch_size: int = field(default=8, metadata={"help": "prompts per RL step"})
    shuffle: bool = True
    seed: int = 1

    def validate(self) -> None:
        _positive(self, "train_batch_size", "task_size")
        if not self.train_files and not self.task:
            raise ConfigError("set data.train_files or data.task")


@dataclass
class TrainerConfig:
    """Run-level settings."""

    total_steps: int = field(default=100, metadata={"help": "RL steps"})
    output_dir: str = field(default="runs/rl", metadata={"help": "metrics, config, TensorBoard, checkpoints"})
    nproc: int = field(default=1, metadata={"help": "ranks to launch on this machine"})
    seed: int = 1234
    log_every: int = 1
    save_every: int = field(default=0, metadata={"help": "checkpoint every N steps (0 = only at the end)"})
    keep_last: int = field(default=2, metadata={"help": "complete checkpoints kept"})
    resume: str = field(default="auto", metadata={"help": "auto | never | path of a checkpoint"})
    max_bad_steps: int = field(default=3, metadata={"help": "consecutive NaN/inf steps before stopping"})
    tensorboard: bool = True

    def validate(self) -> None:
        _positive(self, "total_steps", "nproc", "keep_last", "max_bad_steps")
        if self.save_every < 0:
            raise ConfigError(f"must be >= 0, got {self.save_every}", key="save_every")


@dataclass
class ClusterConfig:
    """The machines a run is planned for (used by ``hyflow plan``)."""

    gpu_memory_gib: float = 80.0
    gpus_per_node: int = 8


@dataclass
class RLJobConfig:
    """``job: rl`` - RL post-training of a language model."""

    job: Literal["rl"] = "rl"
    model: ModelDescription = field(default_factory=tiny_llama, metadata={
        "help": "architecture (ignored when actor.checkpoint is set: read from its model.json)"})
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def actor_layout(self, world_size: Optional[int] = None) -> Layout:
        """The actor's training layout with dp filled in for ``world_size`` ranks."""
        return self.actor.layout.with_dp_for(world_size or self.trainer.nproc)

    def validate(self) -> None:
        world = self.trainer.nproc
        train = self.actor_layout(world)
        train.check_model(self.model)
        gen = self.rollout.layout
        if train.tp % gen.tp or train.pp % gen.pp:
            raise ConfigError(
                f"rollout.layout tp={gen.tp} pp={gen.pp} must divide the actor's training layout "
                f"tp={train.tp} pp={train.pp} (the generation layout is built from the training shards)")
        if self.critic.enable and (self.critic.layout.tp, self.critic.layout.pp) not in (
                (1, 1), (train.tp, train.pp)):
            raise ConfigError(
                f"critic.layout tp={self.critic.layout.tp} pp={self.critic.layout.pp}: the critic "
                f"currently trains in the actor's layout (tp={train.tp} pp={train.pp}); leave "
                "critic.layout unset or equal to actor.layout")
        if self.algorithm.adv_estimator == "gae" and not self.critic.enable:
            raise ConfigError("algorithm.adv_estimator=gae needs a value model: set critic.enable=true")
        if self.algorithm.adv_estimator in ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline") \
                and self.rollout.n < 2:
            raise ConfigError(
                f"{self.algorithm.adv_estimator} compares responses within a prompt's group: "
                f"rollout.n must be >= 2, got {self.rollout.n}")
        seqs = self.data.train_batch_size * self.rollout.n
        if seqs % self.actor.mini_batch_size:
            raise ConfigError(
                f"data.train_batch_size * rollout.n = {seqs} responses per step is not a multiple of "
                f"actor.mini_batch_size={self.actor.mini_batch_size}")
        per_rank = self.actor.mini_batch_size
        if per_rank % (train.dp * self.actor.micro_batch_size):
            raise ConfigError(
                f"actor.mini_batch_size={per_rank} must be a multiple of dp * micro_batch_size = "
                f"{train.dp} * {self.actor.micro_batch_size}")
        total = self.rollout.max_prompt_length + self.rollout.max_new_tokens
        if total > self.model.context_length:
            raise ConfigError(
                f"rollout.max_prompt_length + max_new_tokens = {total} exceeds the model's context "
                f"length {self.model.context_length} (model.max_position_embeddings, extended by "
                "model.rope_scaling); shorten them or extend the context with rope_scaling")
