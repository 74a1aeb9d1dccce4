"""``hyflow config --describe``: every key of a schema with its type, effective default, unit (a
size's ``field(metadata={"unit": ...})``: what it counts, over which ranks) and one line of help, and
a loaded config's values where they differ.

Help comes from a field's ``field(metadata={"help": ...})``, else from its entry in the class
docstring's ``Attributes:`` section, else (for a section) the first line of the section class's
docstring; reStructuredText markup is dropped (:func:`plain_text`).
"""
from __future__ import annotations

import dataclasses
import re
from functools import lru_cache
from typing import Any

import yaml

from hyflow.config.core import _Dumper, _hints, _is_union, _iter_keys, _section_type, _type_name, to_dict

__all__ = ["describe", "field_help", "format_changes", "plain_text"]


def _show(value: Any) -> str:
    """A default value as one line of YAML."""
    text = yaml.dump(to_dict(value), Dumper=_Dumper, default_flow_style=True, width=10**6)
    return text.strip().removesuffix("...").strip()


_RST = re.compile(r":[a-z]+:`~?([^`]+)`|``([^`]+)``")


def plain_text(text: str) -> str:
    """``text`` without reStructuredText markup (``x``, :mod:`a.b`, :func:`~a.b` -> x, a.b, b)."""
    return _RST.sub(lambda m: (m.group(1).rsplit(".", 1)[-1] if m.group(0).startswith(":") and "~" in m.group(0)
                               else m.group(1)) if m.group(1) else m.group(2), text)


@lru_cache(maxsize=None)
def _attribute_docs(cls: type) -> dict[str, str]:
    """``name -> text`` from the ``Attributes:`` section of a dataclass docstring."""
    out: dict[str, str] = {}
    lines = (cls.__doc__ or "").splitlines()
    inside, name, indent = False, None, None
    for line in lines:
        stripped = line.strip()
        if stripped == "Attributes:":
            inside = True
            continue
        if not inside:
            continue
        if not stripped:
            if out:
                break
            continue
        depth = len(line) - len(line.lstrip())
        indent = depth if indent is None else indent
        head, sep, rest = stripped.partition(":")
        if depth == indent and sep and head.replace("_", "").isalnum():
            name = head
            out[name] = rest.strip()
        elif name and depth > indent:
            out[name] += " " + stripped
        else:
            break
    return out


def field_help(cls: type, f: dataclasses.Field) -> str:
    """One line of help for field ``f`` of ``cls``: its ``help`` metadata, else its entry in the
    class docstring's ``Attributes:``, else (a section) the first line of the section's docstring."""
    text = f.metadata.get("help") or _attribute_docs(cls).get(f.name)
    if not text:
        section = _section_type(_hints(cls)[f.name])
        text = (section.__doc__ or "").strip().splitlines()[0] if section is not None and section.__doc__ else ""
    return plain_text(" ".join(text.split()))


def _lookup(obj: Any, key: str) -> tuple[bool, Any]:
    for part in key.split("."):
        if obj is None or not hasattr(obj, part):
            return False, None
        obj = getattr(obj, part)
    return True, obj


def describe(cls: type, config: Any = None) -> str:
    """One entry per dotted key: ``key: type = default`` -- the effective default, i.e. the
    value a config without the key gets -- then one line of help. With ``config`` (a loaded
    config of ``cls``), keys whose value differs from the default also show ``[config: value]``."""
    try:  # the defaults as a whole (not validated: a job may need a key set, e.g. its data)
        defaults: Any = cls()
    except Exception:  # noqa: BLE001 - required keys: fall back to each field's own default
        defaults = None
    lines = []
    for key, f, tp, is_section in _iter_keys(cls):
        parent = key.rpartition(".")[0]
        owner = _section_type(_hints_for_key(cls, parent)) if parent else cls
        found, default = _lookup(defaults, key)
        if is_section and not _is_union(tp):
            entry = f"{key}:"
        else:
            if not found:
                if f.default is not dataclasses.MISSING:
                    found, default = True, f.default
                elif f.default_factory is not dataclasses.MISSING:
                    found, default = True, f.default_factory()
            entry = f"{key}: {_type_name(tp)}" + (f" = {_show(default)}" if found else " (required)")
            if f.metadata.get("unit"):
                entry += f"  [{f.metadata['unit']}]"
            if config is not None:
                has, value = _lookup(config, key)
                if has and (not found or to_dict(value) != to_dict(default)):
                    entry += f"   [config: {_show(value)}]"
        lines.append(entry)
        help_text = field_help(owner, f) if owner is not None else ""
        lines.append(f"    {help_text}" if help_text else "    (no help)")
    return "\n".join(lines)


def _hints_for_key(cls: type, key: str) -> Any:
    """The type of the field at dotted ``key`` of schema ``cls``."""
    tp: Any = cls
    for part in key.split("."):
        section = _section_type(tp)
        tp = _hints(section)[part]
    return tp


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and data:
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else key))
        return out
    return {prefix: data}


def format_changes(config: Any) -> str:
    """The keys of ``config`` whose values differ from its schema's defaults, as YAML (what a log
    needs; the whole config goes to ``config.resolved.yaml``)."""
    try:
        defaults = _flatten(to_dict(type(config)()))
    except Exception:  # noqa: BLE001 - required keys: every key is a change
        defaults = {}
    nested: dict[str, Any] = {}
    for key, value in _flatten(to_dict(config)).items():
        if key in defaults and defaults[key] == value:
            continue
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return yaml.dump(nested, Dumper=_Dumper, sort_keys=False, default_flow_style=None, allow_unicode=True)
