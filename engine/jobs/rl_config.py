"""Configuration of the ``rl`` job: PPO / GRPO / RLOO / REINFORCE++ post-training.

A light module (no torch / Megatron imports): ``hyflow train`` and ``hyflow plan``
validate a config with it before any process starts. Sections mirror the roles of
the dataflow: actor (trains and generates), rollout (how it generates), reference,
critic, reward, algorithm, data, trainer, cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from hyflow.agent.config import MultiTurnConfig
from hyflow.checkpoint.architecture import adopt_checkpoint_architecture, adopt_model_tokenizer
from hyflow.choices import AggMode, KLKind, PolicyLossName
from hyflow.config import ConfigError
from hyflow.config.checks import check_finite, check_positive
from hyflow.jobs.algorithm_config import GROUP_ESTIMATORS, AlgorithmConfig, RolloutCorrectionConfig
from hyflow.jobs.trainer_config import ValidatedTrainerConfig
from hyflow.models.description import ModelDescription, tiny_llama
from hyflow.models.lora_config import LoRAConfig
from hyflow.models.stage_split import job_head_layers, resolve_stage_layers
from hyflow.parallel.distributed import default_dtype
from hyflow.parallel.layout import Layout
from hyflow.rollout.config import GenerationSettings, redefault
from hyflow.placement.config import PlacementConfig, resolve_placement
from hyflow.training.optim_config import OptimConfig
from hyflow.validation.config import ValKwargs
from hyflow.vllm_backend.config import VLLMConfig, check_vllm_installed, check_vllm_model



@dataclass
class GenerationLayout:
    """The actor's generation layout; micro-DP replicas fill the remaining ranks."""

    tp: int = field(default=1, metadata={"help": "generation tensor parallel (must divide actor tp)"})
    pp: int = field(default=1, metadata={"help": "generation pipeline parallel (must divide actor pp)"})

    def validate(self) -> None:
        check_positive(self, "tp", "pp")

    def as_layout(self) -> Layout:
        """The generation layout as a :class:`~hyflow.parallel.layout.Layout` (dp and start follow from
        where it runs: the reshard plan's micro-DP replicas, or the generation pool)."""
        return Layout(tp=self.tp, pp=self.pp)


@dataclass
class RolloutConfig(GenerationSettings):
    """How the actor generates responses: the generation settings (sampling, lengths, chunking,
    concurrency: :class:`~hyflow.rollout.config.GenerationSettings`, which own their checks) and
    the job's own keys (layouts, offloading, exact mode)."""

    layout: GenerationLayout = field(default_factory=GenerationLayout)
    backend: Literal["hyflow", "vllm"] = field(default="hyflow", metadata={
        "help": "the generation engine: hyflow (its own KV-cache engine over the Megatron generation model; the "
                "CPU default and the exact log-probs reference) or vllm (vLLM in the training ranks, fed the "
                "generation layout's weights in memory every step; rollout.vllm holds its options)"})
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    # the job's defaults for three settings (the engine alone: 1 response, 256 tokens, no prompt limit)
    n: int = redefault(GenerationSettings, "n", 4)
    max_new_tokens: int = redefault(GenerationSettings, "max_new_tokens", 64)
    max_prompt_length: int = redefault(GenerationSettings, "max_prompt_length", 128)
    offload_grad_buffers: bool = field(default=False, metadata={
        "help": "free the actor's gradient buffers while generating (memory for the KV cache)"})
    offload_optimizer: bool = field(default=False, metadata={
        "help": "move the actor's optimizer state to host memory while generating (GPU)"})
    exact_logprobs: bool = field(default=False, metadata={
        "help": "after sampling, re-score the responses in the generation layout with the training forward's "
                "micro-batches and reduction order, and report those log-probs: bit-identical to the training "
                "layout's when the generation TP equals the training TP (so actor.old_logprobs=rollout is exact); "
                "costs one forward over the batch, spread over the micro-DP replicas (docs/algorithms.md)"})
    routing_replay: bool = field(default=False, metadata={
        "help": "mixture-of-experts actors: record each sampled token's experts per layer and route the actor's "
                "old-log-prob and update forwards through them (R3), so the policy ratio compares the same "
                "experts; rollout/routing_mismatch reports the share of (token, layer) decisions it overrode"})
    record_routing: bool = field(default=False, metadata={
        "help": "record the experts without replaying them: rollout/routing_mismatch measures how often the "
                "training forward routes a sampled token elsewhere (needs actor.old_logprobs=recompute)"})
    force_staleness: int = field(default=0, metadata={
        "help": "tests and benchmarks only: generate with the actor's weights of this many steps ago (a forced "
                "off-policy lag; the update still starts from the current weights)"})
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig, metadata={
        "help": "multi-turn, tool-using trajectories (hyflow.agent); max_new_tokens is then the per-turn limit"})

    @property
    def max_response_length(self) -> int:
        """The longest response a row can hold: a multi-turn trajectory's budget, else max_new_tokens."""
        return self.multi_turn.max_response_tokens if self.multi_turn.enable else self.max_new_tokens

    def validate(self) -> None:
        check_finite(self, "temperature", "top_p")
        if self.force_staleness < 0:
            raise ConfigError(f"must be >= 0, got {self.force_staleness}", key="force_staleness")
        if self.backend not in ("hyflow", "vllm"):
            raise ConfigError(f"must be hyflow or vllm, got {self.backend!r}", key="backend")
        if self.backend == "vllm":
            check_vllm_installed()
            if self.layout.pp != 1:
                raise ConfigError(f"rollout.backend=vllm generates with tensor parallelism only (vLLM's pipeline "
                                  f"stages do not run inside the training ranks): set rollout.layout.pp=1, got "
                                  f"{self.layout.pp}", key="layout.pp")
        super().validate()  # sampling, lengths, chunking, concurrency: the generation engine's own checks


@dataclass
class TrainedModelConfig:
    """What every trained policy has (the RL actor, the DPO / KTO policy): where its weights
    come from, its layout, precision, layer spec, recomputation and optimizer."""

    checkpoint: Optional[str] = field(default=None, metadata={
        "help": "starting weights: an HF model directory or .gguf file (read directly, each rank its own shards), "
                "or a hyflow checkpoint (hyflow convert hf2mcore); null = random init of `model`"})
    checkpoint_cache: Optional[str] = field(default=None, metadata={
        "help": "with an HF checkpoint: convert it once into this directory (a hyflow checkpoint; later starts "
                "load it instead of reading the HF files, until they change); null = read the HF files"})
    layout: Layout = field(default_factory=Layout, metadata={"help": "training layout; dp is derived"})
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = field(default="auto", metadata={
        "help": "parameter and compute dtype of the trained models (and their frozen copies); auto: bf16 on GPU, "
                "fp32 on CPU"})
    spec: Literal["auto", "local", "sdpa", "te"] = field(default="auto", metadata={
        "help": "Megatron layer spec: local (plain torch), sdpa, te (Transformer Engine); "
                "auto picks te on GPU when installed"})
    recompute: Literal["none", "selective", "full"] = field(default="none", metadata={
        "help": "activation recomputation during the update"})
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    lora: Optional[LoRAConfig] = field(default=None, metadata={
        "help": "train low-rank adapters instead of the weights ({rank, alpha, dropout, targets}; {} for the "
                "defaults): the base is frozen (no gradient, no optimizer state), the reference is the base with "
                "the adapters off, generation syncs the adapters only; LoRA usually wants a higher lr (1e-4..5e-4)"})

    def resolve_dtype(self) -> None:
        """``dtype: auto``: bf16 where this process runs on CUDA, fp32 on the CPU."""
        if self.dtype == "auto":
            self.dtype = default_dtype()

    def validate(self) -> None:
        self.resolve_dtype()
        if self.lora is not None and self.spec == "te":
            raise ConfigError("LoRA adapts Megatron's own linear layers (the local and sdpa specs; Transformer "
                              "Engine's fused layer-norm linear hides the normalised input): set spec to sdpa, "
                              "local or auto", key="spec")


@dataclass
class ActorConfig(TrainedModelConfig):
    """The policy: trained in ``layout``, generating in ``rollout.layout``."""

    micro_batch_size: int = field(default=4, metadata={
        "unit": "sequences per DP rank (verl: per GPU)",
        "help": "sequences per forward/backward (when max_tokens_per_micro_batch is null); rows of similar "
                "length go together, each micro-batch padded to its own longest row"})
    max_tokens_per_micro_batch: Optional[int] = field(default=None, metadata={
        "unit": "tokens per DP rank",
        "help": "token budget of a micro-batch instead of a fixed row count (verl's use_dynamic_bsz): rows "
                "grouped by length, each micro-batch padded to its own longest row (packed: total tokens); "
                "at least max_prompt_length + max_new_tokens; null = micro_batch_size rows"})
    pack_sequences: bool = field(default=False, metadata={
        "help": "concatenate sequences into one row per micro-batch (per-sequence positions, block-diagonal "
                "causal attention): no padding tokens; up to max_tokens_per_micro_batch tokens, or "
                "micro_batch_size sequences without a budget"})
    mini_batch_size: int = field(default=16, metadata={
        "unit": "responses, all DP ranks (verl's prompts x rollout.n)",
        "help": "sequences per optimizer step (all data-parallel ranks together)"})
    balance_batch: bool = field(default=True, metadata={
        "help": "before each epoch, move rows between data-parallel ranks inside each mini-batch so every "
                "rank trains on about as many tokens (verl's trainer.balance_batch); the update is the same, "
                "the gradient all-reduce stops waiting for the rank with the longest responses"})
    ppo_epochs: int = field(default=1, metadata={"help": "passes over each rollout batch"})
    old_logprobs: Literal["recompute", "rollout"] = field(default="recompute", metadata={
        "help": "PPO's old log-probs: 'recompute' scores the batch with a training-layout forward; "
                "'rollout' reuses the log-probs the sampler reported (same weights, one forward pass "
                "less per step; equal to ~1e-5 in fp32, but generation kernels or bf16 can differ more: "
                "watch rollout/logprob_diff_max under 'recompute')"})
    fused_output_layer: bool = field(default=True, metadata={
        "help": "score only response tokens: the output layer and log-softmax run on response positions "
                "in chunks, never holding [batch, seq, vocab] float32 logits (false: full logits, the "
                "reference path; the same numbers to ~1e-6)"})
    clip_ratio_low: float = field(default=0.2, metadata={
        "help": "PPO clip: ratios below 1 - clip_ratio_low are clipped"})
    clip_ratio_high: float = field(default=0.2, metadata={
        "help": "PPO clip: ratios above 1 + clip_ratio_high are clipped "
                "(DAPO's clip-higher when larger than clip_ratio_low)"})
    clip_ratio_c: Optional[float] = field(default=None, metadata={"help": "dual-clip constant (> 1) or null"})
    policy_loss: PolicyLossName = field(default="vanilla", metadata={
        "help": "vanilla (PPO clip) | gspo (sequence-level ratio, geometric mean over the response; "
                "needs loss_agg_mode=seq-mean-token-mean; the paper clips at 3e-4 / 4e-4) | cispo "
                "(clipped IS weight with stop-gradient times log-prob; the clip ratios bound the weight, "
                "clip_ratio_low >= 1 removes the lower bound as in the paper)"})
    loss_agg_mode: AggMode = field(default="token-mean", metadata={
        "help": "how per-token losses become one number: mean over tokens, or per sequence then over sequences"})
    loss_scale_factor: Optional[int] = field(default=None, metadata={
        "unit": "tokens",
        "help": "constant normaliser of loss_agg_mode=seq-mean-token-sum-norm (Dr. GRPO's MAX_TOKENS); "
                "null = rollout.max_new_tokens"})
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    entropy_coeff: float = field(default=0.0, metadata={
        "help": "weight of the entropy bonus in the actor loss (0 = off)"})
    use_kl_loss: bool = field(default=False, metadata={"help": "KL to the reference as a loss term"})
    kl_loss_coef: float = field(default=0.001, metadata={
        "help": "weight of the KL(actor || reference) term in the actor loss (0 = off)"})
    kl_loss_type: KLKind = field(default="low_var_kl", metadata={"help": "KL estimator of the actor-loss term"})
    sft_warmup_steps: int = field(default=0, metadata={
        "help": "supervised steps on reference answers before RL (for tasks a random model cannot start)"})
    sft_lr: float = field(default=1e-3, metadata={"help": "constant learning rate of the SFT warm-up"})

    def validate(self) -> None:
        super().validate()
        check_positive(self, "micro_batch_size", "mini_batch_size", "ppo_epochs")
        if self.max_tokens_per_micro_batch is not None:
            check_positive(self, "max_tokens_per_micro_batch")
        check_finite(self, "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "entropy_coeff", "kl_loss_coef", "sft_lr")
        if self.kl_loss_coef < 0:
            raise ConfigError(f"must be >= 0, got {self.kl_loss_coef}", key="kl_loss_coef")
        if self.sft_lr <= 0:
            raise ConfigError(f"must be > 0, got {self.sft_lr}", key="sft_lr")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1:
            raise ConfigError(f"must be > 1 or null, got {self.clip_ratio_c}", key="clip_ratio_c")
        if self.clip_ratio_low < 0 or self.clip_ratio_high < 0:
            raise ConfigError("clip ratios must be >= 0")
        if self.loss_scale_factor is not None and self.loss_scale_factor < 1:
            raise ConfigError(f"must be >= 1 or null, got {self.loss_scale_factor}", key="loss_scale_factor")
        if self.policy_loss != "vanilla" and self.clip_ratio_c is not None:
            raise ConfigError(f"the dual clip (clip_ratio_c) exists for policy_loss=vanilla only; got "
                              f"policy_loss={self.policy_loss}: set clip_ratio_c: null", key="clip_ratio_c")
        if self.policy_loss == "gspo" and self.loss_agg_mode != "seq-mean-token-mean":
            raise ConfigError("GSPO's objective is the mean over sequences of each sequence's token mean: set "
                              f"actor.loss_agg_mode=seq-mean-token-mean (got {self.loss_agg_mode})",
                              key="loss_agg_mode")
        if self.policy_loss == "gspo" and self.pack_sequences:
            raise ConfigError("gspo's sequence-level ratio is taken over a row, which holds one sequence only "
                              "unpacked: set actor.pack_sequences=false", key="pack_sequences")
        if self.lora is not None and self.sft_warmup_steps:
            raise ConfigError("the LoRA actor's reference is its base model with the adapters off, which an SFT "
                              "warm-up of the adapters would move away from: warm the model up (or fine-tune it) "
                              "first and start LoRA from that checkpoint, or set actor.sft_warmup_steps=0",
                              key="sft_warmup_steps")
        if self.rollout_correction.mode != "off" and self.old_logprobs == "rollout":
            raise ConfigError("rollout_correction weighs the training-layout log-probs against the sampler's; "
                              "with old_logprobs=rollout they are the same numbers (every weight is 1): set "
                              "actor.old_logprobs=recompute or rollout_correction.mode=off",
                              key="rollout_correction.mode")


@dataclass
class CriticConfig:
    """Value model (needed by GAE; GRPO / RLOO / REINFORCE++ run without it)."""

    enable: bool = field(default=False, metadata={"help": "train a value model (needed by adv_estimator=gae)"})
    layout: Optional[Layout] = field(default=None, metadata={
        "help": "null = the actor's layout; another layout needs the critic on a pool of its own (placement); "
                "the trunk starts from the actor's initial weights"})
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    micro_batch_size: int = field(default=4, metadata={
        "unit": "sequences per DP rank (verl: per GPU)", "help": "sequences per critic forward/backward"})
    max_tokens_per_micro_batch: Optional[int] = field(default=None, metadata={
        "unit": "tokens per DP rank",
        "help": "token budget of a micro-batch (values and update); null = micro_batch_size rows"})
    mini_batch_size: Optional[int] = field(default=None, metadata={
        "unit": "responses, all DP ranks (verl's prompts x rollout.n)",
        "help": "sequences per critic optimizer step (all data-parallel ranks); null = actor.mini_batch_size"})
    ppo_epochs: Optional[int] = field(default=None, metadata={
        "help": "passes of the critic over each rollout batch; null = actor.ppo_epochs"})
    cliprange_value: float = field(default=0.5, metadata={
        "help": "PPO value clip: new values stay within this distance of the old ones"})
    lora: Optional[LoRAConfig] = field(default=None, metadata={
        "help": "train the critic as low-rank adapters on its (frozen) trunk plus its value head; null: the "
                "whole critic trains"})

    def validate(self) -> None:
        check_positive(self, "micro_batch_size")
        for name in ("max_tokens_per_micro_batch", "mini_batch_size", "ppo_epochs"):
            if getattr(self, name) is not None:
                check_positive(self, name)
        check_finite(self, "cliprange_value")


@dataclass
class ReferenceConfig:
    """Frozen copy of the initial policy for KL terms."""

    enable: bool = field(default=True, metadata={
        "help": "keep a frozen copy of the initial actor for KL terms and the reported KL"})
    layout: Optional[Layout] = field(default=None, metadata={
        "help": "null = the actor's training layout; another layout needs placement pools (colocated roles share "
                "the actor's layout)"})
    micro_batch_size: Optional[int] = field(default=None, metadata={
        "unit": "sequences per DP rank (verl: per GPU)",
        "help": "sequences per forward when scoring old / reference log-probs; null = actor.micro_batch_size"})
    max_tokens_per_micro_batch: Optional[int] = field(default=None, metadata={
        "unit": "tokens per DP rank",
        "help": "token budget of a scoring micro-batch (forward only: can exceed the actor's); "
                "null = actor.max_tokens_per_micro_batch"})

    def validate(self) -> None:
        for name in ("micro_batch_size", "max_tokens_per_micro_batch"):
            if getattr(self, name) is not None:
                check_positive(self, name)


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
    rule: Literal["exact_match", "numeric_match", "format", "length_match"] = field(default="numeric_match", metadata={
        "help": "built-in rule scorer when reward.kind=rule"})
    function_path: Optional[str] = field(default=None, metadata={
        "help": "python file defining compute_score(data_source, solution_str, ground_truth, extra_info=None)"})
    function_name: str = field(default="compute_score", metadata={
        "help": "name of the scoring function in reward.function_path"})
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
    timeout_s: float = field(default=60.0, metadata={
        "help": "seconds one call of the reward function (kind=function) may take: calls run in worker processes "
                "and a call past the limit is stopped, scored reward.timeout_score and counted in reward/timeouts; "
                "the file's import gets max(60, timeout_s). 0 = no limit (the function runs inside the rank)"})
    batch_timeout_s: float = field(default=0.0, metadata={
        "help": "seconds all of one rank's reward calls of a step may take; at the limit the unfinished ones are "
                "scored like timed-out calls (0 = no limit beyond reward.timeout_s per call)"})
    timeout_score: float = field(default=0.0, metadata={"help": "the score of a reward call that timed out"})
    workers: int = field(default=1, metadata={
        "help": "worker processes per rank calling the reward function (calls run in parallel; with timeout_s > 0)"})

    def validate(self) -> None:
        check_finite(self, "model_coef", "format_score", "timeout_s", "batch_timeout_s", "timeout_score")
        for key in ("timeout_s", "batch_timeout_s"):
            if getattr(self, key) < 0:
                raise ConfigError(f"must be >= 0 (0 = no limit), got {getattr(self, key)}", key=key)
        check_positive(self, "workers")
        if self.kind == "function" and not self.function_path:
            raise ConfigError("reward.kind=function needs reward.function_path", key="function_path")
        if self.kind == "model" and not self.model_checkpoint:
            raise ConfigError("reward.kind=model needs reward.model_checkpoint", key="model_checkpoint")


@dataclass
class DataConfig:
    """Prompts: files in verl's format, or a built-in synthetic task."""

    train_files: list[str] = field(default_factory=list, metadata={"help": "parquet or jsonl files"})
    val_files: list[str] = field(default_factory=list, metadata={
        "help": "held-out parquet / jsonl files in the same format, generated and scored every trainer.val_every "
                "steps (logged as val-core/<data_source>/reward/mean@N); empty = no validation"})
    task: Optional[str] = field(default=None, metadata={
        "help": "built-in synthetic task generated locally instead of files"})
    task_size: int = field(default=2000, metadata={
        "unit": "prompts", "help": "prompts generated for a synthetic task"})
    task_options: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "options of the synthetic task's generator, e.g. {min_digits: 2, max_digits: 4}"})
    tokenizer: Optional[str] = field(default=None, metadata={"help": "HF tokenizer dir / sentencepiece model"})
    prompt_key: str = field(default="prompt", metadata={"help": "column of the dataset rows that holds the prompt"})
    train_batch_size: int = field(default=8, metadata={
        "unit": "prompts, all DP ranks (as verl)", "help": "prompts per RL step"})
    shuffle: bool = field(default=True, metadata={"help": "shuffle the prompts every epoch"})
    seed: int = field(default=1, metadata={"help": "seed of the shuffle"})

    def validate(self) -> None:
        check_positive(self, "train_batch_size", "task_size")
        if not self.train_files and not self.task:
            raise ConfigError("set data.train_files or data.task")
        if self.task and self.task_size < self.train_batch_size:
            raise ConfigError(f"data.task_size={self.task_size} prompts is fewer than one batch of "
                              f"{self.train_batch_size}: raise data.task_size or lower it", key="train_batch_size")


@dataclass
class RLTrainerConfig(ValidatedTrainerConfig):
    """Run-level settings of the RL job."""

    total_steps: int = field(default=100, metadata={"help": "RL steps"})
    output_dir: str = field(default="runs/rl", metadata={"help": "metrics, config, TensorBoard, checkpoints"})
    log_samples: int = field(default=0, metadata={
        "help": "print this many prompt / response / ground truth / score lines of the step's batch every "
                "log_every steps (verl's trainer.log_val_generations; 0 = none)"})
    mode: Literal["sync", "one_step_off", "async"] = field(default="sync", metadata={
        "help": "sync: generate, then train on it (with placement.pools: the generation pool samples step t+1 "
                "after receiving the weights of step t); one_step_off: the generation pool samples step t+1 with the "
                "weights of step t while the training pool updates on step t (token-level truncated importance "
                "sampling, actor.rollout_correction (token_tis when left off), corrects the one-step "
                "staleness); async: the generation pool samples ahead of the training pool, up to "
                "trainer.max_staleness weight versions, and takes new weights at a token boundary "
                "(trainer.update_after_tokens, trainer.partial_rollout; hyflow.jobs.fully_async). one_step_off and "
                "async need a generation pool of its own (placement; without pools the ranks split in half)"})
    max_staleness: int = field(default=2, metadata={
        "help": "trainer.mode=async: the most weight versions a trained token may lag the weights being updated "
                "(verl's async staleness bound): a generation replica starts a prompt only while it has started "
                "fewer than (updates received + 1 + k) batches of prompts, and a completed group older than that "
                "for its batch is dropped and counted (fully_async/count/dropped_stale_samples); 0 = the pooled "
                "sync run"})
    partial_rollout: Literal["continue", "abort"] = field(default="continue", metadata={
        "help": "trainer.mode=async, when new weights arrive while samples are half generated: continue them "
                "with the new weights (their caches recomputed; every token records the version that sampled "
                "it, and the rollout correction uses each token's own log-prob), or abort and re-generate them "
                "from the start with the new weights"})
    update_after_tokens: int = field(default=8, metadata={
        "help": "trainer.mode=async with max_staleness >= 1: a generation replica takes the next weights this "
                "many decode steps (tokens) after they are due (its batch for them sent and the staleness bound "
                "reached), at once when nothing can run (a token boundary: samples are half generated then; "
                "the schedule is a function of decode steps, so runs are reproducible and resumable); 0 = only "
                "when nothing can run (no partial rollouts)"})

    def validate(self) -> None:
        super().validate()
        if self.log_samples < 0:
            raise ConfigError(f"must be >= 0, got {self.log_samples}", key="log_samples")
        if self.max_staleness < 0:
            raise ConfigError(f"must be >= 0 weight versions, got {self.max_staleness}", key="max_staleness")
        if self.update_after_tokens < 0:
            raise ConfigError(f"must be >= 0 tokens (0 = between batches), got {self.update_after_tokens}",
                              key="update_after_tokens")


@dataclass
class ClusterConfig:
    """The machines a run is planned for (used by ``hyflow plan``)."""

    gpu_memory_gib: float = field(default=80.0, metadata={"help": "memory of one GPU, for hyflow plan"})
    gpus_per_node: int = field(default=8, metadata={"help": "GPUs per node, for hyflow plan and the Slurm launcher"})


@dataclass
class RLJobConfig:
    """``job: rl`` - RL post-training of a language model."""

    job: Literal["rl"] = field(default="rl", metadata={"help": "which job the config describes"})
    model: ModelDescription = field(default_factory=tiny_llama, metadata={
        "help": "architecture; with actor.checkpoint set, the checkpoint's model.json replaces it (this "
                "section then only serves tools run where the checkpoint is not, e.g. hyflow plan)"})
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: RLTrainerConfig = field(default_factory=RLTrainerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    #: What validation adopted or noticed (e.g. the architecture read from actor.checkpoint).
    notes: list[str] = field(default_factory=list, init=False, repr=False, compare=False)

    @property
    def loss_norm_length(self) -> int:
        """The constant normaliser of ``seq-mean-token-sum-norm``: ``actor.loss_scale_factor``, or
        the response budget ``rollout.max_new_tokens``."""
        return self.actor.loss_scale_factor or self.rollout.max_new_tokens

    def resolved_placement(self, world_size: Optional[int] = None):
        """Where every role runs (:func:`hyflow.placement.config.resolve_placement`)."""
        return resolve_placement(self, world_size or self.trainer.nproc)

    def trained_actor_layout(self) -> Layout:
        """``actor.layout`` with its pipeline stage split chosen when ``stage_layers`` is null: the
        split balanced by ``hyflow plan``'s cost model (:func:`hyflow.models.stage_split.resolve_stage_layers`),
        from the config alone, so every rank and ``hyflow plan`` build the same one."""
        layout = self.actor.layout
        if layout.stage_layers is not None or layout.pp == 1 or layout.vpp:
            return layout
        return resolve_stage_layers(layout, self.model, job_head_layers(self, self.model))

    def actor_layout(self, world_size: Optional[int] = None) -> Layout:
        """The actor's training layout with dp filled in: over ``world_size`` ranks when colocated,
        over the actor's pool with placement pools; its stage split chosen (:meth:`trained_actor_layout`)."""
        placement = self.resolved_placement(world_size)
        if placement.colocated:
            return self.trained_actor_layout().with_dp_for(world_size or self.trainer.nproc)
        return placement.roles["actor"].layout

    def _check_routing(self, train: Layout, gen: GenerationLayout) -> None:
        """Routing replay / recording: a mixture-of-experts actor and the layouts it supports."""
        rollout = self.rollout
        key = "rollout.routing_replay" if rollout.routing_replay else "rollout.record_routing"
        if not (rollout.routing_replay or rollout.record_routing):
            return
        if self.model.moe is None:
            raise ConfigError(f"{key} records the experts of a mixture-of-experts model; model.family="
                              f"{self.model.family} is dense (drop {key})")
        if rollout.multi_turn.enable:
            raise ConfigError(f"{key} with rollout.multi_turn: a trajectory's observation tokens have no recorded "
                              f"experts yet; drop {key} or rollout.multi_turn")
        if train.cp > 1:
            raise ConfigError(f"{key} with actor.layout.cp={train.cp}: the recorded experts are not split over "
                              "context-parallel ranks yet; use cp=1")
        if rollout.routing_replay and self.actor.recompute == "full":  # selective recomputes attention only
            raise ConfigError("rollout.routing_replay with actor.recompute=full: the layers recomputed in the "
                              "backward would route on their own; use actor.recompute=selective or none")
        if rollout.record_routing and not rollout.routing_replay and self.actor.old_logprobs != "recompute":
            raise ConfigError("rollout.record_routing compares the routing in the old-log-prob forward: set "
                              "actor.old_logprobs=recompute")

    def _check_async(self) -> None:
        """What ``trainer.mode=async`` does not run yet, refused by name."""
        dynamic = self.algorithm.dynamic_sampling.enable  # the generation pool filters its groups
        reward_model = self.reward.kind == "model" or self.reward.model_checkpoint is not None
        refusals = (
            ("reward.model_checkpoint", dynamic and reward_model,
             "with algorithm.dynamic_sampling scores each group on the generation pool, where no reward model "
             "runs (it runs with the actor's training layout): use a rule or function reward, or set "
             "algorithm.dynamic_sampling.enable=false"),
            ("rollout.multi_turn.enable", dynamic and self.rollout.multi_turn.enable,
             "with algorithm.dynamic_sampling scores single-turn responses on the generation pool: drop "
             "rollout.multi_turn or algorithm.dynamic_sampling"),
            ("rollout.record_routing", self.rollout.record_routing or self.rollout.routing_replay,
             "does not record experts across a weight update: drop rollout.record_routing / routing_replay"),
        )
        for key, bad, why in refusals:
            if bad:
                raise ConfigError(f"trainer.mode=async {why}", key=key)

    def validate(self) -> None:
        if self.actor.checkpoint:  # the run's architecture is the checkpoint's model.json (when here)
            self.model, note = adopt_checkpoint_architecture(self.actor.checkpoint, self.model, tiny_llama())
            for line in (note, adopt_model_tokenizer(self.data, self.model)):
                if line and line not in self.notes:
                    self.notes.append(line)
        world = self.trainer.nproc
        placement = self.resolved_placement(world)
        train = self.actor_layout(world)
        train.check_model(self.model)
        if self.actor.layout.stage_layers is None and train.stage_layers is not None:
            note = (f"actor.layout.stage_layers: automatic {'/'.join(map(str, train.stage_layers))} layers per "
                    "pipeline stage (the last stage also runs the output layer; `hyflow plan` shows the costs)")
            if note not in self.notes:
                self.notes.append(note)
        gen = self.rollout.layout
        if self.rollout.backend == "vllm":
            try:
                check_vllm_model(self.model.head_dim)
            except ConfigError as e:
                raise ConfigError(str(e), key="rollout.backend") from None
            if not placement.colocated and placement.roles["rollout"].layout.pp > 1:
                raise ConfigError(f"rollout.backend=vllm generates with tensor parallelism only: the generation pool's "
                                  f"layout has pp={placement.roles['rollout'].layout.pp}; give it pp=1",
                                  key="placement.rollout")
        if placement.colocated:
            if train.tp % gen.tp or train.pp % gen.pp:
                raise ConfigError(
                    f"rollout.layout tp={gen.tp} pp={gen.pp} must divide the actor's training layout "
                    f"tp={train.tp} pp={train.pp} (the generation layout is built from the training shards)")
            for role in ("critic", "reference"):
                own = getattr(self, role).layout
                if getattr(self, role).enable and own is not None and \
                        ((own.tp, own.pp, own.cp, own.vpp) != (train.tp, train.pp, train.cp, train.vpp)
                         or own.stage_layers not in (None, train.stage_layers)):
                    raise ConfigError(
                        f"{role}.layout tp={own.tp} pp={own.pp}: colocated roles share the actor's training "
                        f"layout (tp={train.tp} pp={train.pp}); leave {role}.layout null, or run the {role} on "
                        f"a pool of its own (placement.pools, placement.{role})")
        if self.trainer.mode == "async":
            self._check_async()
        stale = self.trainer.mode == "one_step_off" or (self.trainer.mode == "async" and self.trainer.max_staleness)
        if stale:
            mode = self.trainer.mode
            if self.actor.old_logprobs == "rollout":
                raise ConfigError(
                    f"trainer.mode={mode} samples with weights behind the update: PPO's old log-probs must be "
                    "recomputed by the trainer (actor.old_logprobs=recompute); the sampler's are the behaviour "
                    "policy of the importance correction")
            if self.actor.rollout_correction.mode == "off":  # the stale sampler always needs a correction
                self.actor.rollout_correction.mode = "token_tis"
                note = (f"trainer.mode={mode}: actor.rollout_correction.mode off -> token_tis "
                        f"(cap {self.actor.rollout_correction.cap}) corrects the stale sampler")
                if note not in self.notes:
                    self.notes.append(note)
        if self.algorithm.adv_estimator == "gae" and not self.critic.enable:
            raise ConfigError("algorithm.adv_estimator=gae needs a value model: set critic.enable=true")
        if self.algorithm.adv_estimator in GROUP_ESTIMATORS and self.rollout.n < 2:
            raise ConfigError(
                f"{self.algorithm.adv_estimator} compares responses within a prompt's group: "
                f"rollout.n must be >= 2, got {self.rollout.n}")
        if placement.colocated and self.data.train_batch_size % train.dp:
            raise ConfigError(
                f"data.train_batch_size={self.data.train_batch_size} prompts must split evenly over the actor's "
                f"{train.dp} data-parallel ranks (each rank generates, scores and trains its own prompts)")
        if self.algorithm.dynamic_sampling.enable and self.algorithm.adv_estimator not in GROUP_ESTIMATORS:
            raise ConfigError(f"algorithm.dynamic_sampling keeps groups whose rewards differ: it needs a group "
                              f"estimator ({', '.join(sorted(GROUP_ESTIMATORS))}), not "
                              f"adv_estimator={self.algorithm.adv_estimator}")
        buffer = self.algorithm.overlong_buffer
        if buffer.enable and buffer.length > self.rollout.max_new_tokens:
            raise ConfigError(f"algorithm.overlong_buffer.length={buffer.length} exceeds the response budget "
                              f"rollout.max_new_tokens={self.rollout.max_new_tokens}")
        seqs = self.data.train_batch_size * self.rollout.n
        critic_mini = self.critic.mini_batch_size or self.actor.mini_batch_size
        critic_dp = train.dp if placement.colocated or not self.critic.enable else placement.roles["critic"].layout.dp
        for key, mini, dp in (("actor.mini_batch_size", self.actor.mini_batch_size, train.dp),
                              ("critic.mini_batch_size", critic_mini if self.critic.enable else None, critic_dp)):
            if mini is None:
                continue
            if seqs % mini:
                raise ConfigError(
                    f"data.train_batch_size * rollout.n = {seqs} responses per step is not a multiple of "
                    f"{key}={mini}")
            if mini % dp:
                who = "actor" if key.startswith("actor") else "critic"
                raise ConfigError(f"{key}={mini} must be a multiple of the {who}'s data-parallel size {dp}")
        if self.rollout.multi_turn.enable:
            self._check_multi_turn()
        longest = self.rollout.max_prompt_length + self.rollout.max_response_length
        for key, budget in (("actor.max_tokens_per_micro_batch", self.actor.max_tokens_per_micro_batch),
                            ("critic.max_tokens_per_micro_batch", self.critic.max_tokens_per_micro_batch),
                            ("reference.max_tokens_per_micro_batch", self.reference.max_tokens_per_micro_batch)):
            if budget is not None and budget < longest:
                raise ConfigError(
                    f"{key}={budget} is smaller than the longest sequence, rollout.max_prompt_length + "
                    f"{self._response_key} = {longest}; raise it to at least {longest}")
        self._check_routing(train, gen)
        total = self.rollout.max_prompt_length + self.rollout.max_response_length
        if total > self.model.context_length:
            raise ConfigError(
                f"rollout.max_prompt_length + {self._response_key} = {total} exceeds the model's context "
                f"length {self.model.context_length} (model.max_position_embeddings, extended by "
                "model.rope_scaling); shorten them or extend the context with rope_scaling")

    @property
    def _response_key(self) -> str:
        return "multi_turn.max_response_tokens" if self.rollout.multi_turn.enable else "max_new_tokens"

    def _check_multi_turn(self) -> None:
        """What multi-turn rollouts do not combine with, each named with the way out (the rollouts
        role's ``multi_turn`` capability is checked by the preflight: placement pools lack it)."""
        if self.algorithm.adv_estimator == "remax":
            raise ConfigError("rollout.multi_turn does not generate ReMax's greedy baselines: use grpo, rloo, "
                              "reinforce_plus_plus or gae")
        if self.algorithm.overlong_buffer.enable:
            raise ConfigError("algorithm.overlong_buffer measures one response against rollout.max_new_tokens; it "
                              "does not apply to multi-turn trajectories (rollout.multi_turn.max_response_tokens "
                              "bounds them): set algorithm.overlong_buffer.enable=false")
        if self.rollout.truncate_long_prompts:
            raise ConfigError("rollout.truncate_long_prompts would cut a multi-turn context from the left (the "
                              "trainer would score other tokens than the sampler's): set it to false")
        if self.rollout.multi_turn.max_response_tokens < self.rollout.max_new_tokens:
            raise ConfigError(f"rollout.multi_turn.max_response_tokens={self.rollout.multi_turn.max_response_tokens} "
                              f"is below one turn's rollout.max_new_tokens={self.rollout.max_new_tokens}")
