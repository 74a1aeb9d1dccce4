"""Tool-call parsers: an assistant turn's text -> the calls it makes (and what was malformed).

A parser never raises on the model's text: a call it cannot read becomes a :class:`ToolCall`
with ``error`` set, which the tool runner turns into an error observation the model sees.

Built-in: ``hermes`` (Hermes / Qwen2.5 / Qwen3 style: ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``, several per turn). Others plug in by ``rollout.multi_turn.format``:
``module:Class`` or ``path/to/file.py:Class`` of a class with ``parse(text) -> list[ToolCall]``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from hyflow.agent.loading import load_object


@dataclass
class ToolCall:
    """One call the model wrote: ``name`` and ``arguments`` (a JSON object), or ``error``
    saying why it could not be read (``raw`` is the text it came from)."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None
    raw: str = ""


class ToolCallParser(Protocol):
    """What a parser provides."""

    def parse(self, text: str) -> list[ToolCall]:
        """The calls in ``text`` (an assistant turn), in order; an empty list when it makes none."""
        ...


def call_from_json(body: str) -> ToolCall:
    """A :class:`ToolCall` from the JSON object ``{"name": str, "arguments": object}`` (arguments
    may also be a JSON string holding an object, as OpenAI's API sends them)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall(error=f"the tool call is not valid JSON ({exc.msg} at column {exc.colno})", raw=body)
    if not isinstance(obj, dict):
        return ToolCall(error=f"a tool call must be a JSON object, got {type(obj).__name__}", raw=body)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(error='a tool call needs "name": the tool\'s name as a string', raw=body)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCall(name=name, error=f'"arguments" is a string that is not valid JSON ({exc.msg})', raw=body)
    if not isinstance(args, dict):
        return ToolCall(name=name, error=f'"arguments" must be a JSON object, got {type(args).__name__}', raw=body)
    return ToolCall(name=name, arguments=args, raw=body)


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks; an opened block that is never closed is a
    malformed call (the turn was cut, or the model forgot the closing tag)."""

    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._block = re.compile(re.escape(self.open_tag) + r"(.*?)" + re.escape(self.close_tag), re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        calls = [call_from_json(m.group(1).strip()) for m in self._block.finditer(text)]
        rest = self._block.sub("", text)
        if self.open_tag in rest:
            tail = rest[rest.index(self.open_tag) + len(self.open_tag):]
            calls.append(ToolCall(error=f"{self.open_tag} is not closed by {self.close_tag}", raw=tail.strip()))
        return calls


PARSERS = {"hermes": HermesParser}


def make_parser(spec: str) -> ToolCallParser:
    """The parser ``spec`` names: a built-in (``hermes``) or ``module:Class`` / ``file.py:Class``."""
    if spec in PARSERS:
        return PARSERS[spec]()
    cls = load_object(spec, what="tool-call parser (rollout.multi_turn.format)")
    parser = cls()
    if not callable(getattr(parser, "parse", None)):
        raise TypeError(f"rollout.multi_turn.format={spec!r}: {cls.__name__} has no parse(text) method")
    return parser
