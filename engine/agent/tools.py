"""Function tools with OpenAI-style JSON schemas, and the tool YAML in verl's shape.

A tool is a :class:`Tool`: a schema (``{"type": "function", "function": {"name", "description",
"parameters"}}``) and ``execute(arguments) -> str | ToolResult``. An exception inside ``execute``
is the model's problem to see (an error observation), never the run's; a tool whose backend is
broken (not the call's fault) raises :class:`ToolFailure`, which fails the trajectory instead
(``rollout.multi_turn.failure_policy``).

The YAML (``rollout.multi_turn.tool_config_path``) is verl's::

    tools:
      - class_name: "my_tools.py:Weather"        # or module.Class / module:Class
        config: {api_key_env: WEATHER_KEY}       # passed to the constructor
        tool_schema:
          type: function
          function:
            name: get_weather
            description: "Current weather of a city"
            parameters:
              type: object
              properties: {city: {type: string, description: "city name"}}
              required: [city]

The class is constructed as ``cls(config=..., tool_schema=...)`` (verl's signature).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Union

from hyflow.agent.loading import LoadError, load_object
from hyflow.config.core import yaml_load

#: built-in tools by name (``rollout.multi_turn.tools``), loaded on use
BUILTIN_TOOLS = {"calculator": "hyflow.agent.calculator:Calculator", "python": "hyflow.agent.sandbox:PythonTool"}

_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "object": (dict,), "array": (list,), "null": (type(None),)}


class ToolFailure(RuntimeError):
    """The tool itself is broken (not the call): the trajectory fails and is retried or dropped."""


class ToolConfigError(ValueError):
    """A malformed tool YAML or schema; names the file, the entry and the key."""


@dataclass
class ToolResult:
    """What a call returns: ``text`` for the model; ``error``: the call failed (the text says why);
    ``timeout``: it ran out of time; ``failure``: the tool failed, not the call (see :class:`ToolFailure`)."""

    text: str
    error: bool = False
    timeout: bool = False
    failure: Optional[str] = None


class Tool:
    """Base of function tools: subclasses set :meth:`default_schema` and :meth:`execute`."""

    def __init__(self, config: Optional[dict] = None, tool_schema: Optional[dict] = None) -> None:
        self.config = dict(config or {})
        self.schema = check_schema(tool_schema or self.default_schema(), type(self).__name__)

    @classmethod
    def default_schema(cls) -> dict:
        raise ToolConfigError(f"{cls.__name__} has no default schema: give it a tool_schema")

    @property
    def name(self) -> str:
        return tool_name(self)

    def execute(self, arguments: dict[str, Any]) -> Union[str, ToolResult]:
        raise NotImplementedError


def tool_name(tool) -> str:
    """The name a tool is called by (its schema's; tools need not subclass :class:`Tool`)."""
    return tool.schema["function"]["name"]


def function_schema(name: str, description: str, properties: dict[str, dict], required: list[str]) -> dict:
    """An OpenAI function-tool schema."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


def check_schema(schema: Any, where: str) -> dict:
    """``schema`` if it is an OpenAI function-tool schema, else :class:`ToolConfigError` naming the key."""
    if not isinstance(schema, dict) or schema.get("type") != "function" or not isinstance(schema.get("function"), dict):
        raise ToolConfigError(f"{where}: tool_schema must be {{type: function, function: {{name, description, "
                              f"parameters}}}}, got {schema!r}")
    fn = schema["function"]
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ToolConfigError(f"{where}: tool_schema.function.name must be a non-empty string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise ToolConfigError(f"{where}: tool_schema.function.parameters must be a JSON schema of type object")
    props = params.get("properties", {})
    if not isinstance(props, dict):
        raise ToolConfigError(f"{where}: tool_schema.function.parameters.properties must be a mapping")
    for key, prop in props.items():
        kind = prop.get("type") if isinstance(prop, dict) else None
        kinds = kind if isinstance(kind, list) else [kind]
        if kind is not None and any(k not in _JSON_TYPES for k in kinds):
            raise ToolConfigError(f"{where}: parameter {key!r} has unknown type {kind!r} "
                                  f"(JSON schema types: {sorted(_JSON_TYPES)})")
    required = params.get("required", [])
    if not isinstance(required, list) or any(r not in props for r in required):
        raise ToolConfigError(f"{where}: tool_schema.function.parameters.required must list declared properties, "
                              f"got {required!r}")
    return schema


def argument_errors(schema: dict, arguments: dict[str, Any]) -> list[str]:
    """What is wrong with ``arguments`` for ``schema`` (missing required keys, unknown keys,
    top-level type mismatches); empty when they fit."""
    params = schema["function"].get("parameters", {})
    props = params.get("properties", {})
    errors = [f"missing required argument {k!r}" for k in params.get("required", []) if k not in arguments]
    for key, value in arguments.items():
        if key not in props:
            if params.get("additionalProperties", True) is False or props:
                errors.append(f"unknown argument {key!r} (expected: {', '.join(sorted(props)) or 'none'})")
            continue
        kind = props[key].get("type") if isinstance(props[key], dict) else None
        kinds = kind if isinstance(kind, list) else [kind] if kind else []
        if kinds and not any(isinstance(value, _JSON_TYPES[k]) and not (k in ("integer", "number")
                                                                         and isinstance(value, bool))
                             for k in kinds):
            errors.append(f"argument {key!r} must be of type {kind}, got {type(value).__name__}")
    return errors


def make_builtin(name: str, config: Optional[dict] = None) -> Tool:
    return load_object(BUILTIN_TOOLS[name], what=f"built-in tool {name}")(config=config)


def load_tool_config(path: str) -> list[Tool]:
    """The tools of a verl-shaped tool YAML (see the module docstring)."""
    if not os.path.isfile(path):
        raise ToolConfigError(f"tool config not found: {path} (rollout.multi_turn.tool_config_path)")
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml_load(f.read())
        except Exception as exc:  # noqa: BLE001 - yaml's errors name no file
            raise ToolConfigError(f"{path}: not valid YAML: {exc}") from None
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ToolConfigError(f"{path}: expected a non-empty list under `tools:`")
    tools = []
    for i, entry in enumerate(entries):
        where = f"{path}: tools[{i}]"
        if not isinstance(entry, dict):
            raise ToolConfigError(f"{where}: must be a mapping with class_name, config, tool_schema")
        unknown = set(entry) - {"class_name", "config", "tool_schema"}
        if unknown:
            raise ToolConfigError(f"{where}: unknown key(s) {sorted(unknown)} (expected class_name, config, "
                                  "tool_schema)")
        if "class_name" not in entry:
            raise ToolConfigError(f"{where}: missing class_name")
        schema = entry.get("tool_schema")
        if schema is not None:
            check_schema(schema, where)
        try:
            cls = load_object(entry["class_name"], what=f"{where}.class_name")
        except LoadError as exc:
            raise ToolConfigError(str(exc)) from None
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ToolConfigError(f"{where}.config: must be a mapping, got {type(config).__name__}")
        try:
            tool = cls(config=config, tool_schema=schema)
        except ToolConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's constructor
            raise ToolConfigError(f"{where}: constructing {entry['class_name']} failed: "
                                  f"{type(exc).__name__}: {exc}") from exc
        if not callable(getattr(tool, "execute", None)) or not isinstance(getattr(tool, "schema", None), dict):
            raise ToolConfigError(f"{where}: {entry['class_name']} is not a tool (needs .schema and "
                                  "execute(arguments); subclass hyflow.agent.tools.Tool)")
        check_schema(tool.schema, where)
        tools.append(tool)
    return tools
