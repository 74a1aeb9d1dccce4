"""verl's command-line keys on ``hyflow train`` (the RL job): one table, read by the code and
rendered into docs/verl.md (tests/test_verl_keys.py checks the two agree).

Every entry names a verl key, the hyflow key it becomes and one line on how. Kinds:

* ``same``: the key exists in hyflow with verl's meaning (passed through unchanged);
* ``rename``: hyflow's key of another name, same value and unit;
* ``convert``: another unit or form; the command's notes say what each value became;
* ``ignored``: accepted with no effect (a note says why: hyflow has no such knob, or always does it);
* ``refused``: not supported; the command fails naming the key and what to do instead.

A key ending in ``.*`` covers a whole verl section. The conversions that depend on other keys
(``ppo_mini_batch_size`` x ``rollout.n``, ``total_epochs`` x batches per epoch, dynamic batch
sizes, ``clip_ratio``) run on the merged config, after every override is applied (:func:`finalize`).
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Sequence

from hyflow.config import ConfigError
from hyflow.config.core import parse_override
from hyflow.jobs.rl_config import DataConfig, RolloutConfig
from hyflow.models.lora_config import HF_TARGETS, LORA_TARGETS

Kind = Literal["same", "rename", "convert", "ignored", "refused"]
A, C = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"


@dataclass(frozen=True)
class VerlKey:
    """One row of the table: ``verl`` key, hyflow key (``ours``), ``kind``, one-line ``note``."""

    verl: str
    ours: str
    kind: Kind
    note: str


TABLE: tuple[VerlKey, ...] = (
    # data
    VerlKey("data.train_files", "data.train_files", "same", "a file or a list of files (parquet / jsonl)"),
    VerlKey("data.val_files", "data.val_files", "same", "validated every trainer.val_every steps"),
    VerlKey("data.train_batch_size", "data.train_batch_size", "same", "prompts per step, all DP ranks together"),
    VerlKey("data.val_batch_size", "-", "ignored", "validation generates the whole set, rollout.max_concurrent "
                                                   "sequences at a time per replica"),
    VerlKey("data.max_prompt_length", "rollout.max_prompt_length", "rename", "tokens after the chat template"),
    VerlKey("data.max_response_length", "rollout.max_new_tokens", "rename", "tokens"),
    VerlKey("data.filter_overlong_prompts", "-", "ignored", "hyflow always drops prompts over max_prompt_length "
                                                            "(rollout.truncate_long_prompts cuts them instead)"),
    VerlKey("data.truncation", "rollout.truncate_long_prompts", "convert", "left -> true; error -> false (longer "
                                                                          "prompts are dropped, counted); "
                                                                          "right / middle refused"),
    VerlKey("data.prompt_key", "data.prompt_key", "same", "column holding the chat messages"),
    VerlKey("data.reward_fn_key", "-", "convert", "only data_source (the reward is chosen per row's data_source)"),
    VerlKey("data.shuffle", "data.shuffle", "same", ""),
    VerlKey("data.seed", "data.seed", "same", ""),
    VerlKey("data.return_raw_chat", "-", "ignored", "the reward function gets the decoded response, as in verl"),
    VerlKey("data.tokenizer", "data.tokenizer", "same", "null: the model's tokenizer"),
    # the model
    VerlKey("actor_rollout_ref.model.path", "actor.checkpoint", "rename",
            "an HF directory, a .gguf file or a hyflow checkpoint"),
    VerlKey("actor_rollout_ref.model.enable_gradient_checkpointing", "actor.recompute", "convert",
            "true -> full, false -> none"),
    VerlKey("actor_rollout_ref.model.use_remove_padding", "-", "ignored",
            "hyflow pads each micro-batch to its own longest row; actor.pack_sequences=true packs them"),
    VerlKey("actor_rollout_ref.model.lora_rank", "actor.lora.rank", "convert",
            "0 (verl's off) -> no LoRA; > 0 trains adapters on the frozen base (README: LoRA)"),
    VerlKey("actor_rollout_ref.model.lora_alpha", "actor.lora.alpha", "convert",
            "used when lora_rank > 0; verl's default 16 when not given (hyflow's own default is 32)"),
    VerlKey("actor_rollout_ref.model.target_modules", "actor.lora.targets", "convert",
            "all-linear -> the four linears of each layer; HF names -> the fused Megatron layer holding them "
            "(q/k/v_proj -> linear_qkv, o_proj -> linear_proj, gate/up_proj -> linear_fc1, down_proj -> "
            "linear_fc2); used when lora_rank > 0"),
    VerlKey("actor_rollout_ref.model.*", "-", "refused", "hyflow reads the architecture from the checkpoint"),
    VerlKey("actor_rollout_ref.hybrid_engine", "-", "ignored", "hyflow always reshards the actor in memory"),
    # the actor
    VerlKey(f"{A}.optim.lr", "actor.optim.lr", "rename", ""),
    VerlKey(f"{A}.optim.weight_decay", "actor.optim.weight_decay", "rename", ""),
    VerlKey(f"{A}.optim.lr_warmup_steps", "actor.optim.warmup_steps", "convert", "-1 (verl: use the ratio) -> 0"),
    VerlKey(f"{A}.optim.lr_warmup_steps_ratio", "-", "convert", "only 0.0; set actor.optim.warmup_steps"),
    VerlKey(f"{A}.optim.warmup_style", "actor.optim.decay_style", "convert", "constant or cosine"),
    VerlKey(f"{A}.optim.clip_grad", "actor.optim.clip_grad", "rename", ""),
    VerlKey(f"{A}.grad_clip", "actor.optim.clip_grad", "rename", ""),
    VerlKey(f"{A}.ppo_mini_batch_size", "actor.mini_batch_size", "convert",
            "verl counts prompts, hyflow responses: x rollout.n (all DP ranks together in both)"),
    VerlKey(f"{A}.ppo_micro_batch_size_per_gpu", "actor.micro_batch_size", "rename",
            "sequences per forward/backward of one DP rank (its TP x PP ranks share them: per GPU in verl)"),
    VerlKey(f"{A}.ppo_micro_batch_size", "-", "refused",
            "a global micro size: give ppo_micro_batch_size_per_gpu (hyflow's actor.micro_batch_size)"),
    VerlKey(f"{A}.use_dynamic_bsz", "actor.max_tokens_per_micro_batch", "convert",
            "true: the token budget of ppo_max_token_len_per_gpu; false: micro_batch_size rows"),
    VerlKey(f"{A}.ppo_max_token_len_per_gpu", "actor.max_tokens_per_micro_batch", "convert",
            "tokens per micro-batch of one DP rank, with use_dynamic_bsz=true"),
    VerlKey(f"{A}.ppo_epochs", "actor.ppo_epochs", "rename", ""),
    VerlKey(f"{A}.shuffle", "-", "ignored", "mini-batches are drawn in a seeded order (trainer.seed)"),
    VerlKey(f"{A}.clip_ratio", "actor.clip_ratio_low", "convert", "sets clip_ratio_low and clip_ratio_high"),
    VerlKey(f"{A}.clip_ratio_low", "actor.clip_ratio_low", "rename", ""),
    VerlKey(f"{A}.clip_ratio_high", "actor.clip_ratio_high", "rename", ""),
    VerlKey(f"{A}.clip_ratio_c", "actor.clip_ratio_c", "rename", "dual clip"),
    VerlKey(f"{A}.entropy_coeff", "actor.entropy_coeff", "rename", ""),
    VerlKey(f"{A}.use_kl_loss", "actor.use_kl_loss", "rename", ""),
    VerlKey(f"{A}.kl_loss_coef", "actor.kl_loss_coef", "rename", ""),
    VerlKey(f"{A}.kl_loss_type", "actor.kl_loss_type", "rename", ""),
    VerlKey(f"{A}.loss_agg_mode", "actor.loss_agg_mode", "rename", ""),
    VerlKey(f"{A}.policy_loss.loss_mode", "actor.policy_loss", "rename", "vanilla, gspo or cispo"),
    VerlKey(f"{A}.megatron.tensor_model_parallel_size", "actor.layout.tp", "rename", ""),
    VerlKey(f"{A}.megatron.pipeline_model_parallel_size", "actor.layout.pp", "rename", ""),
    VerlKey(f"{A}.megatron.context_parallel_size", "actor.layout.cp", "rename", ""),
    VerlKey(f"{A}.megatron.expert_model_parallel_size", "actor.layout.ep", "rename", ""),
    VerlKey(f"{A}.megatron.expert_tensor_parallel_size", "actor.layout.etp", "rename", "null: tensor_model_parallel_size"),
    VerlKey(f"{A}.megatron.virtual_pipeline_model_parallel_size", "actor.layout.vpp", "rename", ""),
    VerlKey(f"{A}.megatron.sequence_parallel", "actor.layout.sequence_parallel", "rename", ""),
    VerlKey(f"{A}.megatron.*", "-", "ignored", "hyflow's Megatron settings are actor.layout and actor.optim"),
    VerlKey(f"{A}.fsdp_config.*", "-", "ignored",
            "hyflow shards with Megatron (actor.layout); rollout.offload_optimizer frees the optimizer "
            "while generating"),
    VerlKey(f"{A}.checkpoint.*", "-", "ignored", "checkpoints hold model, optimizer and data position"),
    # generation
    VerlKey(f"{C}.name", "-", "ignored", "hyflow's own generation engine on the actor's resharded weights"),
    VerlKey(f"{C}.n", "rollout.n", "rename", "responses per prompt"),
    VerlKey(f"{C}.temperature", "rollout.temperature", "rename", ""),
    VerlKey(f"{C}.top_k", "rollout.top_k", "convert", "-1 (off) -> 0"),
    VerlKey(f"{C}.top_p", "rollout.top_p", "rename", ""),
    VerlKey(f"{C}.prompt_length", "rollout.max_prompt_length", "rename", "tokens"),
    VerlKey(f"{C}.response_length", "rollout.max_new_tokens", "rename", "tokens"),
    VerlKey(f"{C}.tensor_model_parallel_size", "rollout.layout.tp", "rename", "must divide actor.layout.tp"),
    VerlKey(f"{C}.log_prob_micro_batch_size_per_gpu", "reference.micro_batch_size", "rename",
            "sequences per scoring forward of one DP rank (old and reference log-probs; the smaller "
            "of the rollout's and ref's)"),
    VerlKey(f"{C}.max_num_seqs", "rollout.max_concurrent", "rename", "sequences decoded at once per replica"),
    VerlKey(f"{C}.gpu_memory_utilization", "-", "ignored", "the KV cache holds rollout.max_concurrent sequences"),
    VerlKey(f"{C}.enforce_eager", "-", "ignored", ""),
    VerlKey(f"{C}.free_cache_engine", "-", "ignored", "the KV cache is freed after every generation"),
    VerlKey(f"{C}.load_format", "-", "ignored", "weights are resharded in memory"),
    VerlKey(f"{C}.dtype", "-", "ignored", "generation runs in actor.dtype"),
    VerlKey(f"{C}.enable_chunked_prefill", "-", "ignored", "rollout.prefill_chunk_size sets the chunk"),
    VerlKey(f"{C}.val_kwargs.n", "rollout.val_kwargs.n", "rename", ""),
    VerlKey(f"{C}.val_kwargs.do_sample", "rollout.val_kwargs.do_sample", "rename", ""),
    VerlKey(f"{C}.val_kwargs.temperature", "rollout.val_kwargs.temperature", "rename", ""),
    VerlKey(f"{C}.val_kwargs.top_k", "rollout.val_kwargs.top_k", "rename", "-1 (off) -> 0"),
    VerlKey(f"{C}.val_kwargs.top_p", "rollout.val_kwargs.top_p", "rename", ""),
    VerlKey(f"{C}.*", "-", "refused", "no equivalent in hyflow's generation engine"),
    VerlKey("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "reference.micro_batch_size", "rename",
            "see rollout.log_prob_micro_batch_size_per_gpu"),
    VerlKey("actor_rollout_ref.ref.*", "-", "ignored", "the reference shares the actor's layout"),
    VerlKey("actor_rollout_ref.*", "-", "refused", "no equivalent in hyflow"),
    # the critic
    VerlKey("critic.model.path", "critic.enable", "convert",
            "true; the critic starts from the actor's weights, so the path must be the actor's"),
    VerlKey("critic.optim.lr", "critic.optim.lr", "same", ""),
    VerlKey("critic.ppo_mini_batch_size", "critic.mini_batch_size", "convert", "prompts -> responses: x rollout.n"),
    VerlKey("critic.ppo_micro_batch_size_per_gpu", "critic.micro_batch_size", "rename",
            "sequences per forward/backward of one DP rank"),
    VerlKey("critic.ppo_epochs", "critic.ppo_epochs", "same", ""),
    VerlKey("critic.cliprange_value", "critic.cliprange_value", "same", ""),
    VerlKey("critic.megatron.*", "-", "ignored", "the critic shares the actor's layout (or placement.critic)"),
    VerlKey("critic.model.*", "-", "ignored", "the critic is the actor's trunk with a value head"),
    # reward
    VerlKey("custom_reward_function.path", "reward.function_path", "convert",
            "sets reward.kind=function (verl's compute_score signature)"),
    VerlKey("custom_reward_function.name", "reward.function_name", "rename", ""),
    VerlKey("reward_model.enable", "reward.kind", "convert", "true: the reward model's score "
                                                             "(added to the function's when one is set)"),
    VerlKey("reward_model.model.path", "reward.model_checkpoint", "rename", "a hyflow checkpoint with a value head"),
    VerlKey("reward_model.reward_manager", "-", "convert", "naive only (one score per response)"),
    VerlKey("reward_model.*", "-", "refused", "no equivalent in hyflow"),
    # algorithm: verl's keys are hyflow's
    VerlKey("algorithm.*", "algorithm.*", "same", "adv_estimator, gamma, lam, use_kl_in_reward, kl_penalty, "
                                                  "kl_ctrl.*, norm_adv_by_std_in_grpo"),
    # trainer
    VerlKey("trainer.total_epochs", "trainer.total_steps", "convert",
            "epochs x (training rows / data.train_batch_size), rows counted before length filtering"),
    VerlKey("trainer.total_training_steps", "trainer.total_steps", "rename", "wins over total_epochs"),
    VerlKey("trainer.save_freq", "trainer.save_every", "convert", "-1 (never) -> 0 (only at the end)"),
    VerlKey("trainer.test_freq", "trainer.val_every", "convert", "-1 -> 0 (validate after the last step only)"),
    VerlKey("trainer.val_before_train", "trainer.val_before_train", "same", ""),
    VerlKey("trainer.logger", "trainer.loggers", "convert", "console, tensorboard, wandb, mlflow; a name or a list"),
    VerlKey("trainer.project_name", "trainer.project_name", "same", ""),
    VerlKey("trainer.experiment_name", "trainer.experiment_name", "same", ""),
    VerlKey("trainer.default_local_dir", "trainer.output_dir", "rename", ""),
    VerlKey("trainer.n_gpus_per_node", "trainer.nproc", "rename", "ranks started on this machine"),
    VerlKey("trainer.nnodes", "-", "convert", "1 only; several nodes: hyflow launch slurm"),
    VerlKey("trainer.resume_mode", "trainer.resume", "convert", "auto -> auto, disable -> never, "
                                                                "resume_path -> trainer.resume_from_path"),
    VerlKey("trainer.resume_from_path", "trainer.resume", "rename", "a checkpoint directory"),
    VerlKey("trainer.critic_warmup", "-", "convert", "0 only"),
    VerlKey("trainer.balance_batch", "actor.balance_batch", "rename", ""),
    VerlKey("trainer.max_actor_ckpt_to_keep", "trainer.keep_last", "rename", ""),
    VerlKey("trainer.log_val_generations", "trainer.log_samples", "rename", "prompt / response / ground truth / "
                                                                           "score lines per log step"),
    VerlKey("trainer.device", "-", "ignored", "cuda when present, else the CPU"),
    VerlKey("trainer.default_hdfs_dir", "-", "convert", "null only"),
)

_BY_KEY = {row.verl: row for row in TABLE}
_SECTIONS = sorted((row for row in TABLE if row.verl.endswith(".*")), key=lambda r: -len(r.verl))
#: verl's top-level sections hyflow does not have: any key under them is verl's
VERL_ONLY = ("actor_rollout_ref.", "custom_reward_function.", "reward_model.")
#: verl's actor_rollout_ref.model.lora_alpha default (hyflow's actor.lora.alpha defaults to 32)
VERL_LORA_ALPHA = 16


def lookup(key: str) -> Optional[VerlKey]:
    """The table's row for verl key ``key`` (a section row ``x.*`` covers ``x.anything``)."""
    if key in _BY_KEY:
        return _BY_KEY[key]
    for row in _SECTIONS:
        if key.startswith(row.verl[:-1]):
            return row
    return None


@dataclass
class Translation:
    """What :func:`translate` made of a command line."""

    overrides: list[str] = field(default_factory=list)   #: hyflow overrides, in the command's order
    notes: list[str] = field(default_factory=list)        #: what each verl key became
    errors: list[ConfigError] = field(default_factory=list)
    deferred: dict[str, Any] = field(default_factory=dict)  #: verl values resolved by :func:`finalize`

    def finalize(self, data: dict, errors: list[ConfigError]) -> dict:
        """:func:`finalize`; its errors go to ``errors`` (the config loader's)."""
        before = len(self.errors)
        data = finalize(data, self)
        errors.extend(self.errors[before:])
        return data


def _set(key: str, value: Any) -> str:
    return f"{key}={json.dumps(value)}"


def _refuse(key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"verl key '{key}={value}' is not supported by hyflow: {why}", key)


def translate(overrides: Sequence[str], own_key: Callable[[str], bool]) -> Translation:
    """Turn verl keys of ``overrides`` into hyflow's; ``own_key(key)`` says whether hyflow's schema
    has ``key`` (those pass through: verl and hyflow share many names)."""
    out = Translation()
    for item in overrides:
        try:
            op, key, value = parse_override(item)
        except ConfigError:
            out.overrides.append(item)  # the config loader reports it
            continue
        row = lookup(key)
        if row is None or (row.kind == "same" and own_key(key)) or (own_key(key) and not key.startswith(VERL_ONLY)):
            out.overrides.append(item)
            continue
        if op == "del":
            out.errors.append(ConfigError(f"'{item}': hyflow has no verl key to remove; remove {row.ours}", key))
            continue
        try:
            _apply(row, key, value, out)
        except ConfigError as exc:
            out.errors.append(exc)
    return out


def _apply(row: VerlKey, key: str, value: Any, out: Translation) -> None:
    """One verl override onto ``out`` (refusals raise)."""
    if row.kind == "refused":
        named = [r.verl for r in TABLE if not r.verl.endswith("*")]
        close = difflib.get_close_matches(key, named, n=1, cutoff=0.85) if row.verl.endswith("*") else []
        raise _refuse(key, value, row.note + (f" (did you mean '{close[0]}'?)" if close else ""))
    if row.kind == "ignored":
        out.notes.append(f"{key}={value}: ignored ({row.note})")
        return
    if row.kind in ("same", "rename"):
        target = key.replace(row.verl[:-1], row.ours[:-1]) if row.verl.endswith(".*") else row.ours
        if target == "reference.micro_batch_size" and target in out.deferred:
            value = min(value, out.deferred[target])  # the rollout's and the ref's: the smaller
        out.deferred[target] = value
        out.overrides.append(_set(target, value))
        if target != key:
            out.notes.append(f"{key}={value} -> {target}={value}")
        return
    convert = _CONVERT[key]
    for target, new in convert(value, out):
        out.overrides.append(_set(target, new))
        out.notes.append(f"{key}={value} -> {target}={new}")


def _flag(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"verl key '{key}': expected true or false, got {value!r}", key)


def _truncation(value, out):
    if value == "left":
        return [("rollout.truncate_long_prompts", True)]
    if value == "error":
        return [("rollout.truncate_long_prompts", False)]
    raise _refuse("data.truncation", value, "hyflow cuts long prompts from the left (left) or drops them (error)")


def _only(key: str, allowed: Any, why: str):
    def check(value, out):
        if value != allowed:
            raise _refuse(key, value, why)
        out.notes.append(f"{key}={value}: nothing to change")
        return []
    return check


def _defer(key: str):
    def store(value, out):
        out.deferred[key] = value
        return []
    return store


def _logger(value, out):
    names = [value] if isinstance(value, str) else list(value)
    bad = [n for n in names if n not in ("console", "tensorboard", "wandb", "mlflow")]
    if bad:
        raise _refuse("trainer.logger", value, f"hyflow logs to console, tensorboard, wandb and mlflow, not {bad}")
    return [("trainer.loggers", names)]


def _resume_mode(value, out):
    mapping = {"auto": "auto", "disable": "never"}
    if value == "resume_path":
        out.notes.append("trainer.resume_mode=resume_path: trainer.resume_from_path names the checkpoint")
        return []
    if value not in mapping:
        raise _refuse("trainer.resume_mode", value, "auto, disable or resume_path")
    return [("trainer.resume", mapping[value])]


def _off_is_zero(target: str):
    return lambda value, out: [(target, 0 if value == -1 else value)]


def _warmup_style(value, out):
    if value not in ("constant", "cosine"):
        raise _refuse(f"{A}.optim.warmup_style", value, "constant or cosine")
    return [("actor.optim.decay_style", value)]


def _critic_path(value, out):
    out.deferred["critic.model.path"] = value
    return [("critic.enable", True)]


def _reward_enable(value, out):
    out.deferred["reward_model.enable"] = _flag(value, "reward_model.enable")
    return []


_CONVERT: dict[str, Callable[[Any, Translation], list[tuple[str, Any]]]] = {
    "data.truncation": _truncation,
    "data.reward_fn_key": _only("data.reward_fn_key", "data_source", "hyflow picks the reward per row's "
                                                                      "data_source"),
    "actor_rollout_ref.model.lora_rank": _defer("lora_rank"),
    "actor_rollout_ref.model.lora_alpha": _defer("lora_alpha"),
    "actor_rollout_ref.model.target_modules": _defer("target_modules"),
    "actor_rollout_ref.model.enable_gradient_checkpointing":
        lambda v, out: [("actor.recompute", "full" if _flag(v, "enable_gradient_checkpointing") else "none")],
    f"{A}.optim.lr_warmup_steps": _off_is_zero("actor.optim.warmup_steps"),
    f"{A}.optim.lr_warmup_steps_ratio": _only(f"{A}.optim.lr_warmup_steps_ratio", 0.0,
                                              "set actor.optim.warmup_steps (a number of steps)"),
    f"{A}.optim.warmup_style": _warmup_style,
    f"{A}.ppo_mini_batch_size": _defer("actor.mini_batch_size/prompts"),
    f"{A}.use_dynamic_bsz": _defer("use_dynamic_bsz"),
    f"{A}.ppo_max_token_len_per_gpu": _defer("ppo_max_token_len_per_gpu"),
    f"{A}.clip_ratio": lambda v, out: [("actor.clip_ratio_low", v), ("actor.clip_ratio_high", v)],
    f"{C}.top_k": _off_is_zero("rollout.top_k"),
    "critic.model.path": _critic_path,
    "critic.ppo_mini_batch_size": _defer("critic.mini_batch_size/prompts"),
    "custom_reward_function.path": lambda v, out: [("reward.kind", "function"), ("reward.function_path", v)],
    "reward_model.enable": _reward_enable,
    "reward_model.reward_manager": _only("reward_model.reward_manager", "naive", "hyflow scores one response at "
                                                                                 "a time (verl's naive manager)"),
    "trainer.total_epochs": _defer("trainer.total_epochs"),
    "trainer.save_freq": _off_is_zero("trainer.save_every"),
    "trainer.test_freq": _off_is_zero("trainer.val_every"),
    "trainer.logger": _logger,
    "trainer.nnodes": _only("trainer.nnodes", 1, "several nodes run through `hyflow launch slurm` (one "
                                                 "trainer.nproc per node)"),
    "trainer.resume_mode": _resume_mode,
    "trainer.critic_warmup": _only("trainer.critic_warmup", 0, "the critic trains from the first step"),
    "trainer.default_hdfs_dir": _only("trainer.default_hdfs_dir", None, "checkpoints go to trainer.output_dir"),
}


def _get(data: dict, key: str, default: Any = None) -> Any:
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _put(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {}) if isinstance(node.get(part), dict) or part not in node else node[part]
    node[parts[-1]] = value


def finalize(data: dict, tr: Translation) -> dict:
    """The conversions that need the merged config (``data``: the file plus every override)."""
    d = tr.deferred
    n = _get(data, "rollout.n", RolloutConfig().n)
    for who in ("actor", "critic"):
        prompts = d.get(f"{who}.mini_batch_size/prompts")
        if prompts is not None:
            _put(data, f"{who}.mini_batch_size", prompts * n)
            tr.notes.append(f"{'actor_rollout_ref.actor' if who == 'actor' else 'critic'}.ppo_mini_batch_size="
                            f"{prompts} prompts -> {who}.mini_batch_size={prompts * n} responses (x rollout.n={n})")
    if d.get("use_dynamic_bsz"):
        budget = d.get("ppo_max_token_len_per_gpu")
        if budget is None:
            tr.errors.append(ConfigError(f"{A}.use_dynamic_bsz=true needs {A}.ppo_max_token_len_per_gpu (hyflow's "
                                         "actor.max_tokens_per_micro_batch)", f"{A}.ppo_max_token_len_per_gpu"))
        else:
            _put(data, "actor.max_tokens_per_micro_batch", budget)
            tr.notes.append(f"{A}.ppo_max_token_len_per_gpu={budget} -> actor.max_tokens_per_micro_batch={budget}")
    for key in ("clip_ratio_low", "clip_ratio_high"):  # the explicit low / high win over clip_ratio
        if f"actor.{key}" in d:
            _put(data, f"actor.{key}", d[f"actor.{key}"])
    _lora(data, tr)
    critic_path = d.get("critic.model.path")
    actor_path = _get(data, "actor.checkpoint")
    if critic_path is not None and actor_path is not None and os.path.abspath(critic_path) != \
            os.path.abspath(actor_path):
        tr.errors.append(_refuse("critic.model.path", critic_path, "the critic starts from the actor's weights "
                                 f"(actor_rollout_ref.model.path={actor_path})"))
    if d.get("reward_model.enable"):
        if not _get(data, "reward.model_checkpoint"):
            tr.errors.append(ConfigError("reward_model.enable=true needs reward_model.model.path",
                                         "reward_model.model.path"))
        elif _get(data, "reward.kind", "rule") != "function":
            _put(data, "reward.kind", "model")
    epochs = d.get("trainer.total_epochs")
    if epochs is not None and "trainer.total_steps" not in d:
        rows = _count_rows(data, DataConfig())
        batch = _get(data, "data.train_batch_size", DataConfig().train_batch_size)
        steps = max(1, epochs * (rows // batch)) if rows else None
        if steps is None:
            tr.errors.append(ConfigError("trainer.total_epochs: cannot count the training rows (set "
                                         "trainer.total_training_steps)", "trainer.total_epochs"))
        else:
            _put(data, "trainer.total_steps", steps)
            tr.notes.append(f"trainer.total_epochs={epochs} -> trainer.total_steps={steps} ({rows} rows / "
                            f"data.train_batch_size={batch} per epoch)")
    return data


def _lora(data: dict, tr: Translation) -> None:
    """verl's ``lora_rank`` / ``lora_alpha`` / ``target_modules`` -> ``actor.lora`` (rank 0: no LoRA)."""
    d, model = tr.deferred, "actor_rollout_ref.model"
    given = {k: d[k] for k in ("lora_alpha", "target_modules") if k in d}
    rank = d.get("lora_rank")
    if rank is None and not given:
        return
    if isinstance(rank, bool) or not isinstance(rank, (int, type(None))) or (rank or 0) < 0:
        tr.errors.append(_refuse(f"{model}.lora_rank", rank, "a whole number: 0 (no LoRA) or the adapter rank"))
        return
    if not rank:
        tr.notes.append(f"{', '.join(f'{model}.{k}={v}' for k, v in given.items())}: ignored (lora_rank is 0: "
                        "no LoRA)" if given else f"{model}.lora_rank=0: no LoRA")
        return
    if not isinstance(_get(data, "actor.lora"), dict):
        _put(data, "actor.lora", {})
    _put(data, "actor.lora.rank", rank)
    tr.notes.append(f"{model}.lora_rank={rank} -> actor.lora.rank={rank}")
    alpha = given.get("lora_alpha", VERL_LORA_ALPHA)
    _put(data, "actor.lora.alpha", alpha)
    tr.notes.append(f"{model}.lora_alpha={alpha}{'' if 'lora_alpha' in given else ' (verl default)'} -> "
                    f"actor.lora.alpha={alpha}")
    if "target_modules" in given:
        targets = _lora_targets(given["target_modules"], tr)
        if targets is not None:
            _put(data, "actor.lora.targets", targets)
            tr.notes.append(f"{model}.target_modules={given['target_modules']} -> actor.lora.targets={targets}")


def _lora_targets(value: Any, tr: Translation) -> Optional[list[str]]:
    """verl's ``target_modules`` (``all-linear``, or HF / Megatron module names) as Megatron layers; a
    fused layer adapts all of its projections (q_proj alone still puts the adapter on linear_qkv)."""
    if value == "all-linear":
        return list(LORA_TARGETS)
    names = [value] if isinstance(value, str) else list(value)
    unknown = [n for n in names if n not in HF_TARGETS and n not in LORA_TARGETS]
    if unknown:
        tr.errors.append(_refuse("actor_rollout_ref.model.target_modules", value,
                                 f"unknown module(s) {unknown}: all-linear, or names among "
                                 f"{', '.join(list(HF_TARGETS) + list(LORA_TARGETS))}"))
        return None
    wanted = {HF_TARGETS.get(n, n) for n in names}
    return [t for t in LORA_TARGETS if t in wanted]


def _count_rows(data: dict, defaults: Any) -> Optional[int]:
    """Rows of the training data (a task's size, the files' rows), or None when a file is missing."""
    if _get(data, "data.task"):
        return _get(data, "data.task_size", defaults.task_size)
    files = _get(data, "data.train_files", [])
    files = [files] if isinstance(files, str) else files
    total = 0
    for path in files:
        if not os.path.isfile(path):
            return None
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq  # the data extra; parquet files need it anyway

            total += pq.ParquetFile(path).metadata.num_rows
        else:
            with open(path, encoding="utf-8") as f:
                total += sum(1 for line in f if line.strip())
    return total


# --------------------------------------------------------------------------- the doc

def markdown_table() -> str:
    """The table as docs/verl.md shows it."""
    lines = ["| verl key | hyflow key | how |", "|---|---|---|"]
    for row in TABLE:
        ours = "—" if row.ours == "-" else f"`{row.ours}`"
        note = f"{row.kind}" + (f": {row.note}" if row.note else "")
        lines.append(f"| `{row.verl}` | {ours} | {note} |")
    return "\n".join(lines)
