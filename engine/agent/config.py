"""Configuration of multi-turn, tool-using rollouts (``rollout.multi_turn``; light: no torch).

Names follow verl's ``rollout.multi_turn`` section where a key means the same thing
(``tool_config_path``, ``max_parallel_calls``, ``max_tool_response_length``,
``tool_response_truncate_side``, ``format``); ``max_turns`` is verl's ``max_assistant_turns``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from hyflow.agent.builder import check_agent_config
from hyflow.agent.tools import BUILTIN_TOOLS
from hyflow.config import ConfigError
from hyflow.config.checks import check_finite, check_positive

#: why a trajectory ended (``multi_turn/end_reason/<reason>`` metrics; the order is the wire code)
END_REASONS = ("done", "max_turns", "token_budget", "turn_length", "context_limit", "failed")


@dataclass
class SandboxConfig:
    """Limits of the ``python`` tool's subprocess (:mod:`hyflow.agent.sandbox`)."""

    cpu_seconds: int = field(default=5, metadata={"help": "CPU seconds of one run (RLIMIT_CPU)"})
    memory_mb: int = field(default=512, metadata={"help": "address space of one run in MiB (RLIMIT_AS)"})
    wall_seconds: float = field(default=10.0, metadata={
        "help": "wall-clock limit of one run; the process group is killed past it (tool_timeout also applies)"})
    max_output_bytes: int = field(default=65536, metadata={
        "help": "stdout + stderr kept per run; the process is killed once it writes more"})
    max_file_bytes: int = field(default=1 << 20, metadata={
        "help": "largest file the code may write in its temporary directory (RLIMIT_FSIZE)"})

    def validate(self) -> None:
        check_positive(self, "cpu_seconds", "memory_mb", "max_output_bytes", "max_file_bytes")
        check_finite(self, "wall_seconds")
        if self.wall_seconds <= 0:
            raise ConfigError(f"must be > 0, got {self.wall_seconds}", key="wall_seconds")


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts: the model's turns alternate with observations (tool results,
    environment or simulated-user messages) that are in its context but never trained on."""

    enable: bool = field(default=False, metadata={
        "help": "generate multi-turn trajectories (assistant turns + observations) instead of one response"})
    max_turns: int = field(default=4, metadata={
        "help": "assistant turns per trajectory (verl's max_assistant_turns); the last one gets no observation"})
    max_response_tokens: int = field(default=512, metadata={
        "help": "token budget of a trajectory after its prompt (assistant turns and observations together); "
                "each turn samples at most min(rollout.max_new_tokens, what is left)"})
    tools: list[str] = field(default_factory=list, metadata={
        "help": "built-in tools to offer: calculator, python (the sandboxed executor)"})
    tool_config_path: Optional[str] = field(default=None, metadata={
        "help": "YAML of further tools in verl's shape: tools: [{class_name, config, tool_schema}]"})
    format: str = field(default="hermes", metadata={
        "help": "tool-call parser: hermes (<tool_call>{json}</tool_call>, Qwen / Hermes) or "
                "'module:Class' / 'file.py:Class' of your own"})
    tool_prompt: Literal["auto", "template", "system", "none"] = field(default="auto", metadata={
        "help": "how the tool schemas reach the model: template (the chat template's `tools`), system (a "
                "system message listing them), none (the prompts already describe them), auto (template when "
                "it renders tools, else system)"})
    observation_role: str = field(default="tool", metadata={
        "help": "chat role of tool results (use 'user' for templates without a tool role)"})
    max_parallel_calls: int = field(default=4, metadata={
        "help": "tool calls executed per assistant turn; further calls get an error observation"})
    tool_timeout: float = field(default=10.0, metadata={"help": "seconds one tool call may take"})
    timeout_is_failure: bool = field(default=False, metadata={
        "help": "a tool call that times out fails the trajectory (failure_policy) instead of showing the model "
                "a timeout error"})
    max_tool_response_length: int = field(default=1024, metadata={
        "unit": "characters", "help": "characters of a tool result kept in the observation"})
    tool_response_truncate_side: Literal["left", "middle", "right"] = field(default="middle", metadata={
        "help": "which part of a long tool result is cut: left keeps the start, right keeps the end, middle both"})
    tool_workers: int = field(default=16, metadata={"help": "tool calls running at once per generation replica"})
    environment: Optional[str] = field(default=None, metadata={
        "help": "'module:Class' / 'file.py:Class' of an Environment (reset(record) / step(turn)); null = "
                "the tool environment (tool calls get results, a turn without one ends the trajectory)"})
    environment_kwargs: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "keyword arguments of the environment's constructor"})
    env_timeout: float = field(default=60.0, metadata={
        "help": "seconds an environment's reset or step may take (tool calls inside it have their own "
                "timeout); past it the trajectory fails"})
    reward: Literal["final_turn", "environment", "sum"] = field(default="final_turn", metadata={
        "help": "a trajectory's score: final_turn (the reward section scores the last assistant turn's text), "
                "environment (the sum of the environment's rewards), sum (both added)"})
    failure_policy: Literal["retry", "resample_group"] = field(default="retry", metadata={
        "help": "a trajectory whose environment or tool fails is run again from its prompt (retry) or its "
                "whole group is run again (resample_group); after max_retries the group is dropped (its rows "
                "stay in the batch with no loss, counted in multi_turn/dropped_groups)"})
    max_retries: int = field(default=2, metadata={"help": "extra attempts before a failing group is dropped"})
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    def validate(self) -> None:
        check_positive(self, "max_turns", "max_response_tokens", "max_parallel_calls", "max_tool_response_length",
                       "tool_workers")
        check_finite(self, "tool_timeout", "env_timeout")
        for name in ("tool_timeout", "env_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"must be > 0, got {getattr(self, name)}", key=name)
        if self.max_retries < 0:
            raise ConfigError(f"must be >= 0, got {self.max_retries}", key="max_retries")
        unknown = [t for t in self.tools if t not in BUILTIN_TOOLS]
        if unknown:
            raise ConfigError(f"unknown built-in tool(s) {unknown}; built-in: {sorted(BUILTIN_TOOLS)} (other tools "
                              "go in tool_config_path)", key="tools")
        if len(set(self.tools)) != len(self.tools):
            raise ConfigError(f"a tool is listed twice: {self.tools}", key="tools")
        if not self.observation_role:
            raise ConfigError("must be a chat role such as tool or user", key="observation_role")
        self.sandbox.validate()
        if self.enable:  # files and classes are checked only when they will be used
            check_agent_config(self)
