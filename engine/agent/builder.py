"""Build a run's tools, parser and environment factory from ``rollout.multi_turn``, and check them
when the config is validated (before any rank starts): a missing tool file, a class that does not
load, a parser without ``parse`` fail there with one error naming the key."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from hyflow.agent.environment import Environment, ToolEnvironment, Toolbox
from hyflow.agent.executor import ToolRunner
from hyflow.agent.loading import LoadError, load_object
from hyflow.agent.parsers import make_parser
from hyflow.agent.tools import Tool, ToolConfigError, load_tool_config, make_builtin, tool_name
from hyflow.config import ConfigError

if TYPE_CHECKING:  # annotations only: the config imports this module to check itself
    from hyflow.agent.config import MultiTurnConfig


def build_tools(cfg: MultiTurnConfig) -> list[Tool]:
    """The built-in tools ``cfg.tools`` names, then those of ``cfg.tool_config_path``."""
    tools = []
    for name in cfg.tools:
        config = None
        if name == "python":
            config = {k: getattr(cfg.sandbox, k) for k in ("cpu_seconds", "memory_mb", "wall_seconds",
                                                            "max_output_bytes", "max_file_bytes")}
        tools.append(make_builtin(name, config))
    if cfg.tool_config_path:
        tools += load_tool_config(cfg.tool_config_path)
    return tools


def build_toolbox(cfg: MultiTurnConfig) -> Toolbox | None:
    """The parser and runner of the configured tools (None without tools)."""
    tools = build_tools(cfg)
    if not tools:
        return None
    runner = ToolRunner(tools, timeout=cfg.tool_timeout, max_chars=cfg.max_tool_response_length,
                        truncate_side=cfg.tool_response_truncate_side, workers=cfg.tool_workers,
                        max_parallel_calls=cfg.max_parallel_calls, timeout_is_failure=cfg.timeout_is_failure)
    return Toolbox(make_parser(cfg.format), runner, cfg.observation_role)


def environment_class(cfg: MultiTurnConfig) -> type:
    if not cfg.environment:
        return ToolEnvironment
    cls = load_object(cfg.environment, what="rollout.multi_turn.environment")
    if not (isinstance(cls, type) and callable(getattr(cls, "step", None)) and callable(getattr(cls, "reset", None))):
        raise LoadError(f"rollout.multi_turn.environment={cfg.environment!r} is not an environment class (it needs "
                        "reset(record) and step(turn); subclass hyflow.agent.environment.Environment)")
    return cls


def environment_factory(cfg: MultiTurnConfig, toolbox: Toolbox | None) -> Callable[[], Environment]:
    """A function making one environment per trajectory, with the toolbox attached."""
    cls = environment_class(cfg)
    kwargs = dict(cfg.environment_kwargs)

    def make() -> Environment:
        env = cls(**kwargs)
        env.tools = toolbox
        return env

    return make


def check_agent_config(cfg: MultiTurnConfig) -> None:
    """Everything that can be checked from the config alone (tools load, parser, environment)."""
    try:
        tools = build_tools(cfg)
    except (ToolConfigError, LoadError) as exc:
        raise ConfigError(str(exc), key="tool_config_path" if cfg.tool_config_path else "tools") from None
    names = [tool_name(t) for t in tools]
    if len(set(names)) != len(names):
        raise ConfigError(f"two tools share a name: {names}; tool names must be unique", key="tool_config_path")
    try:
        make_parser(cfg.format)
    except (LoadError, TypeError) as exc:
        raise ConfigError(str(exc), key="format") from None
    try:
        environment_class(cfg)
    except LoadError as exc:
        raise ConfigError(str(exc), key="environment") from None
    if not tools and not cfg.environment:
        raise ConfigError("multi-turn rollouts need tools (rollout.multi_turn.tools / tool_config_path) or an "
                          "environment (rollout.multi_turn.environment); with neither every trajectory is one turn",
                          key="tools")
