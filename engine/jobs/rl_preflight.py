"""Everything about an RL job that the config alone can tell, checked before any rank starts.

``hyflow train``, ``hyflow launch local`` and ``hyflow launch slurm`` (before submitting) call
:func:`preflight` after the config validated: files exist and parse, the reward function
imports with verl's signature, the tokenizer and checkpoints are readable and agree with the
model, ``trainer.resume`` names a checkpoint. Each problem is one :class:`ConfigError` naming
the key and the path. It reads headers and a first slice of each data file only (the ranks
read them whole), and loads no model, so it takes seconds, not the minutes the ranks need to
get to the same error.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from hyflow.checkpoint.discovery import checkpoint_candidates
from hyflow.checkpoint.errors import CheckpointError
from hyflow.config import ConfigError
from hyflow.data.dataset import DatasetError, read_rows, validate_row
from hyflow.data.tasks import load_data_tokenizer, make_task_rows, task_info, tokenizer_spec_for
from hyflow.data.tokenizer import CharTokenizer
from hyflow.rewards.user_function import RewardError
from hyflow.rewards.worker import DEFAULT_IMPORT_TIMEOUT_S, probe_user_function
from hyflow.vllm_backend.config import check_vllm_imports

#: Rows of each data file checked here (the ranks check every row when they load the file).
PREVIEW_ROWS = 1000


def _error(key: str, message: str) -> ConfigError:
    return ConfigError(f"config key '{key}': {message}", key=key)


def preflight(cfg: Any) -> None:
    """Raise :class:`ConfigError` for the first problem found (see the module docstring)."""
    try:
        _preflight(cfg)
    except ConfigError as e:
        if e.key and not str(e).startswith("config key"):
            raise _error(e.key, str(e)) from None
        raise


def _preflight(cfg: Any) -> None:
    check_pooled_supported(cfg)  # placement pools and trainer.mode=one_step_off: what runs today
    check_role_capabilities(cfg)
    if cfg.rollout.backend == "vllm":  # the config checked it is installed; a broken install fails here
        check_vllm_imports("rollout.backend")
    _check_context_parallel(cfg)
    _check_task(cfg.data)
    vocab = _check_tokenizer(cfg)
    _check_data_files(cfg)
    _check_reward(cfg.reward)
    if cfg.actor.checkpoint:
        _check_model_checkpoint("actor.checkpoint", cfg.actor.checkpoint)
    if vocab is not None and vocab > cfg.model.vocab_size:
        raise _error("data.tokenizer", f"the tokenizer has {vocab} tokens but the model's vocabulary is "
                                       f"{cfg.model.vocab_size} (model.vocab_size"
                                       f"{' from actor.checkpoint' if cfg.actor.checkpoint else ''}); "
                                       "use a model / tokenizer pair that match")
    _check_resume(cfg.trainer.resume)
    _check_output_dir(cfg.trainer.output_dir)


def check_pooled_supported(cfg: Any) -> None:
    """What placement pools (``trainer.mode=one_step_off``, or ``sync`` with ``placement.pools``) do not
    run yet, named before any rank starts (what the pooled roles cannot do is their declared capabilities':
    :func:`hyflow.jobs.rl_preflight.check_role_capabilities`)."""
    placement = cfg.resolved_placement()
    if placement.colocated:
        return
    # Megatron (seconds) only when this runs: the preflight imports this module
    from hyflow.placement.remote_critic import check_remote_roles

    check_remote_roles(cfg, placement)  # roles on a pool apart from the actor's: the critic only
    if cfg.data.val_files:
        raise ConfigError("validation (data.val_files) runs colocated only for now: drop data.val_files with "
                          "placement pools, or validate the checkpoints with `hyflow eval`", key="data.val_files")
    if cfg.model.is_moe:  # the weight sync moves experts (tested), but a whole pooled run waits at its start
        raise ConfigError("a mixture-of-experts actor runs colocated only for now (its pooled run does not reach "
                          "its first step yet): use trainer.mode=sync without placement.pools", key="placement.pools"
                          if cfg.placement.pools else "trainer.mode")
    actor = placement.roles["actor"].pool
    if actor.start != 0:  # Megatron's dist_checkpointing writes the models' common part from rank 0
        raise ConfigError(f"checkpoints of placement pools need the actor's pool to start at rank 0 (it is "
                          f"{actor.describe()}): list the training pool first in placement.pools",
                          key="placement.pools")


def role_classes(cfg: Any) -> tuple[type, type]:
    """The weight path and rollouts classes (:mod:`hyflow.roles`) the ranks build for ``cfg``:
    :func:`hyflow.rl.models.build_rl_models` colocated, :func:`hyflow.placement.pool_models.build_training_models`
    on placement pools. Each declares what it can do for a config (``capabilities_for(cfg)``)."""
    # imported here: torch and Megatron, seconds the preflight pays only when a capability is needed
    if cfg.resolved_placement().colocated:
        # Megatron (seconds) only when this runs: the preflight imports this module
        from hyflow.rl.dispatch import RolloutDispatcher
        from hyflow.rl.vllm_rollouts import VLLMRollouts
        from hyflow.hybrid.executor import HybridEngine

        return HybridEngine, VLLMRollouts if cfg.rollout.backend == "vllm" else RolloutDispatcher
    # Megatron (seconds) only when this runs: the preflight imports this module
    from hyflow.placement.pool_models import RemoteRollouts, WeightSender

    return WeightSender, RemoteRollouts


#: config values that need a role's capability: (key, needed(cfg), role, has(capabilities), what, remedy)
REQUIREMENTS = (
    ("algorithm.adv_estimator", lambda cfg: cfg.algorithm.adv_estimator == "remax", "rollouts",
     lambda caps: caps.greedy, "ReMax's greedy baselines",
     "run ReMax colocated (trainer.mode=sync, placement.pools empty)"),
    ("rollout.exact_logprobs", lambda cfg: cfg.rollout.exact_logprobs, "rollouts",
     lambda caps: caps.exact_logprobs, "the training forward's log-probs of the policy that sampled (it samples "
     "with older weights and holds no generation model to re-score with)",
     "set rollout.exact_logprobs=false, or trainer.mode=sync"),
    ("rollout.multi_turn.enable", lambda cfg: cfg.rollout.multi_turn.enable, "rollouts",
     lambda caps: caps.multi_turn, "multi-turn trajectories",
     "use rollout.backend=hyflow (any trainer.mode, colocated or on placement pools), or set "
     "rollout.multi_turn.enable=false"),
    ("rollout.force_staleness", lambda cfg: cfg.rollout.force_staleness > 0, "weights",
     lambda caps: caps.stale_weights, "sampling with older weights (it holds no generation weights of its own)",
     "set rollout.force_staleness=0, or run colocated"),
)


def check_role_capabilities(cfg: Any) -> None:
    """A config that needs a capability its roles do not declare is refused here, naming the key:
    the requirements (:data:`REQUIREMENTS`) against the classes' declared capabilities, no list of
    combinations."""
    needed = [r for r in REQUIREMENTS if r[1](cfg)]
    if not needed:
        return
    classes = dict(zip(("weights", "rollouts"), role_classes(cfg)))
    for key, _, role, has, what, remedy in needed:
        cls = classes[role]
        if not has(cls.capabilities_for(cfg)):
            raise _error(key, f"{cls.__name__} (the {role} role of this placement, trainer.mode={cfg.trainer.mode}) "
                              f"cannot give {what}: {remedy}")


def _check_context_parallel(cfg: Any) -> None:
    """What the RL job's context parallelism (each CP rank holds a share of every sequence) cannot do."""
    cp = cfg.actor.layout.cp
    if cp == 1:
        return
    if cfg.actor.policy_loss == "gspo":
        raise _error("actor.policy_loss", f"gspo's sequence-level ratio needs a whole response on one rank; "
                                          f"at actor.layout.cp={cp} each rank holds 1/{cp} of it: use vanilla or "
                                          "cispo, or cp: 1")
    # Megatron (seconds) only when this runs: the preflight imports this module
    from hyflow.models.builder import resolve_spec

    if cfg.actor.pack_sequences and resolve_spec(cfg.actor.spec) == "te":
        raise _error("actor.pack_sequences", f"packed rows go to Transformer Engine's THD attention, which hyflow "
                                             f"does not split over context-parallel ranks (actor.layout.cp={cp}); "
                                             "set actor.pack_sequences=false or actor.spec=local")


def _check_task(data: Any) -> None:
    if not data.task:
        return
    task_info(data.task)  # ConfigError naming data.task and listing the tasks
    try:
        make_task_rows(data.task, 1, seed=data.seed, **dict(data.task_options or {}))
    except TypeError as e:
        raise _error("data.task_options", f"task {data.task!r} does not take these options ({e})") from None
    except ValueError as e:
        raise _error("data.task_options", str(e)) from None


def _check_tokenizer(cfg: Any) -> Optional[int]:
    """The tokenizer's vocabulary size when the files tell it cheaply (``tokenizer.json``), else
    None; a tokenizer path that does not exist or holds no tokenizer is an error. (Loading it
    would import transformers: seconds the ranks pay anyway.)"""
    spec = tokenizer_spec_for(cfg.data)
    if spec == "char":
        return CharTokenizer().vocab_size
    path = os.path.expanduser(spec)
    looks_like_path = spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or spec.endswith((".gguf", ".model"))
    if not os.path.exists(path):
        if looks_like_path:
            raise _error("data.tokenizer", f"tokenizer path {path} does not exist")
        return None  # a hub name: the ranks load it
    if os.path.isdir(path):
        files = set(os.listdir(path))
        if not (files & {"tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model"}
                or any(f.endswith(".gguf") for f in files)):
            raise _error("data.tokenizer", f"no tokenizer in {path} (looked for tokenizer.json, "
                                           "tokenizer_config.json, tokenizer.model or a .gguf file)")
        if "tokenizer.json" in files:
            return _tokenizer_json_vocab(os.path.join(path, "tokenizer.json"))
    return None


def _tokenizer_json_vocab(path: str) -> Optional[int]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise _error("data.tokenizer", f"{path} is not a readable tokenizer file ({e})") from None
    ids = [int(v) for v in ((data.get("model") or {}).get("vocab") or {}).values() if isinstance(v, int)]
    ids += [int(t["id"]) for t in data.get("added_tokens") or [] if isinstance(t, dict) and "id" in t]
    return max(ids) + 1 if ids else None


def _check_data_files(cfg: Any) -> None:
    needs_truth = cfg.reward.kind != "model"
    files = [] if cfg.data.task else [(f"data.train_files[{i}]", p) for i, p in enumerate(cfg.data.train_files)]
    files += [(f"data.val_files[{i}]", p) for i, p in enumerate(cfg.data.val_files)]
    tokenizer = None
    total, whole = 0, True  # training rows seen; whether every training file was read to its end
    for key, path in files:
        if not os.path.isfile(path):
            raise _error(key, f"data file {path} does not exist")
        try:
            rows = read_rows(path, limit=PREVIEW_ROWS)
        except DatasetError as e:
            raise _error(key, str(e)) from None
        if not rows:
            raise _error(key, f"{path} has no rows")
        if key.startswith("data.train_files"):
            total += len(rows)
            whole = whole and len(rows) < PREVIEW_ROWS
        prompts = []
        for row, item in enumerate(rows):
            try:
                prompts.append(validate_row(item, cfg.data.prompt_key, needs_truth)[0])
            except Exception as e:  # noqa: BLE001 - the dataset's row error: key and message
                where = f", key '{e.key}'" if getattr(e, "key", None) else ""
                raise _error(key, f"{path}: row {row}{where}: {getattr(e, 'message', e)}") from None
        if not cfg.rollout.truncate_long_prompts:
            if tokenizer is None:
                tokenizer = load_data_tokenizer(cfg.data)  # seconds here, not a launch that ends with no prompt
            _check_prompt_lengths(key, path, prompts, tokenizer, cfg.rollout.max_prompt_length)
    if not cfg.data.task and whole and total < cfg.data.train_batch_size:
        raise _error("data.train_batch_size", f"the data files hold {total} rows, fewer than one batch of "
                                              f"{cfg.data.train_batch_size} prompts: lower it or add rows")


def _check_prompt_lengths(key: str, path: str, prompts: list, tokenizer: Any, limit: int) -> None:
    """Every previewed prompt longer than ``limit`` tokens (after the chat template): the ranks would
    drop them all and stop with no data, after minutes of start-up."""
    lengths = [len(ids) for ids in tokenizer.encode_prompt_texts([tokenizer.apply_chat_template(m) for m in prompts])]
    if lengths and min(lengths) > limit:
        raise _error(key, f"{path}: all {len(lengths)} prompts read here are longer than rollout.max_prompt_length="
                          f"{limit} tokens (after the chat template; the shortest has {min(lengths)}), so every one "
                          f"would be dropped: raise rollout.max_prompt_length (verl: data.max_prompt_length) to at "
                          f"least {min(lengths)}, or set rollout.truncate_long_prompts=true")


def _check_reward(reward: Any) -> None:
    if reward.kind == "function":
        try:  # in a worker process: a file that hangs at import fails here instead of hanging the launcher
            probe_user_function(reward.function_path, reward.function_name,
                                max(DEFAULT_IMPORT_TIMEOUT_S, reward.timeout_s))
        except RewardError as e:
            text = str(e)
            in_file = text.startswith(("importing", "no reward function file", "the reward worker")) or \
                "not found" in text
            raise _error("reward.function_path" if in_file else "reward.function_name", text) from None
    if reward.model_checkpoint:
        # Megatron (seconds) only when this runs: the preflight imports this module
        from hyflow.rl.reward_model import check_reward_model_checkpoint

        check_reward_model_checkpoint(reward.model_checkpoint)  # ConfigError naming the key


def _check_model_checkpoint(key: str, path: str) -> None:
    # Megatron (seconds) only when this runs: the preflight imports this module
    from hyflow.checkpoint.model import read_checkpoint_info
    from hyflow.checkpoint.starting_weights import check_starting_weights, is_hf_model

    if is_hf_model(path):  # read directly: its config and every tensor's header
        try:
            check_starting_weights(path, key)
        except CheckpointError as e:
            raise _error(key, str(e)) from None
        return
    if not os.path.isdir(path):
        raise _error(key, f"checkpoint directory {path} does not exist; convert the model into it first: "
                          f"`hyflow convert hf2mcore --hf <HF model dir or .gguf file> --out {path}`")
    try:
        read_checkpoint_info(path)  # complete, files present with their sizes, index readable
    except CheckpointError as e:
        raise _error(key, str(e)) from None


def _check_resume(resume: str) -> None:
    if resume in ("auto", "never"):
        return
    try:
        checkpoint_candidates(resume, lambda m: None)
    except CheckpointError as e:
        raise _error("trainer.resume", f"{e} (auto | never | a checkpoint path)") from None


def _check_output_dir(output_dir: str) -> None:
    """The run directory exists and is writable, or can be created (nothing is created here)."""
    path = os.path.abspath(output_dir)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    if not os.path.isdir(path):
        raise _error("trainer.output_dir", f"{path} is a file, not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise _error("trainer.output_dir", f"{path} is not writable")
