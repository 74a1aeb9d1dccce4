"""Typed configuration: dataclass schemas loaded from YAML plus ``key.sub=value`` overrides.

A schema is a (nested) dataclass. Field types may be ``int``, ``float`` (ints accepted),
``bool`` (strict: only real booleans), ``str``, ``Any``, ``Optional[X]`` / ``X | None``,
``Literal[...]``, ``list[X]``, ``dict[str, X]``, nested dataclasses and
``Optional[nested dataclass]``. Per-field documentation lives in
``field(metadata={"help": "..."})`` and is shown by :func:`describe`.

Every user-facing problem raises :class:`ConfigError` naming the dotted key path. A dataclass
may define ``validate(self)``; it runs after construction, children before parents, and any
``ConfigError`` it raises is re-raised with the section path prepended.

YAML is read with PyYAML's safe loader extended so that exponent floats without a dot
(``1e-4``) are floats, and duplicate mapping keys are an error.
"""
from __future__ import annotations

import contextvars
import copy
import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, Literal, Sequence, TypeVar, Union

import yaml

__all__ = [
    "ConfigError", "from_dict", "apply_overrides", "load_config", "to_dict", "dump_yaml",
    "format_config", "config_keys", "parse_override",
]

T = TypeVar("T")
_NoneType = type(None)


class ConfigError(ValueError):
    """The single error type for invalid configuration.

    ``key`` is the dotted key the error is about, when known. Inside a ``validate`` method,
    pass a key relative to that dataclass (``ConfigError("must be > 0", key="total_steps")``);
    the loader prefixes the section path.
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.key = key
        self.errors: list[ConfigError] = [self]  # several, when one command had several problems

    @classmethod
    def combine(cls, errors: Sequence["ConfigError"]) -> "ConfigError":
        """One error listing ``errors`` (the error itself when there is one)."""
        flat = [e for error in errors for e in error.errors]
        if len(flat) == 1:
            return flat[0]
        out = cls(f"{len(flat)} config errors:\n  " + "\n  ".join(str(e) for e in flat), flat[0].key)
        out.errors = flat
        return out


#: While a config is built, the errors found so far (every problem of one command is reported at once).
_COLLECTED: contextvars.ContextVar[list[ConfigError] | None] = contextvars.ContextVar("_COLLECTED", default=None)


class _Failed(ConfigError):
    """A section that could not be built; its errors are collected already."""


def _collect(exc: ConfigError) -> None:
    """Record ``exc`` when errors are being collected, else raise it."""
    errors = _COLLECTED.get()
    if errors is None:
        raise exc
    if not isinstance(exc, _Failed):
        errors.append(exc)


# --------------------------------------------------------------------------- YAML dialect

_EXP_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


#: Values a config may hold once its YAML aliases (``*name``) are expanded: far above any real
#: config, far below what a "billion laughs" file (aliases of aliases) would take to expand.
MAX_EXPANDED_NODES = 100_000


def _expanded_nodes(root: yaml.Node, limit: int) -> int:
    """How many values ``root`` holds with every alias expanded (counted once per node, so
    linear in the file's size; stops past ``limit``). A recursive alias counts as over the limit."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        children = node.value if isinstance(node, yaml.SequenceNode) else \
            [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else []
        if done:
            on_path.discard(id(node))
            size[id(node)] = min(limit + 1, 1 + sum(size[id(c)] for c in children))
        elif id(node) in on_path:
            return limit + 1  # an alias of its own ancestor: infinite
        elif id(node) not in size:
            on_path.add(id(node))
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in size)
    return size[id(root)]


class _Loader(yaml.SafeLoader):
    """Safe loader that reads ``1e-4`` as a float, rejects duplicate mapping keys, and refuses a
    document whose aliases expand past :data:`MAX_EXPANDED_NODES` values."""

    def construct_document(self, node: yaml.Node) -> Any:
        if _expanded_nodes(node, MAX_EXPANDED_NODES) > MAX_EXPANDED_NODES:
            raise yaml.constructor.ConstructorError(
                None, None, f"its aliases (*name) expand to more than {MAX_EXPANDED_NODES} values (a \"billion "
                "laughs\" document?): refusing it", node.start_mark)
        return super().construct_document(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[str, yaml.Node] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key_node.value!r}", key_node.start_mark)
            seen[key_node.value] = key_node
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    """Safe dumper sharing the loader's float rule, so strings like '1e-4' get quoted."""


for _cls in (_Loader, _Dumper):  # same float rule both ways, so dumps round-trip
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _EXP_FLOAT, list("-+0123456789"))
del _cls


def yaml_load(text: str) -> Any:
    """Parse YAML text as hyflow configs are parsed: safe loading, `1e-4` read as a float, a
    duplicate key an error."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader derives from SafeLoader


def _yaml_dump(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=None,
                     allow_unicode=True)


# --------------------------------------------------------------------------- schema helpers

def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"config schema must be a dataclass type, got {cls!r}")
    try:
        return typing.get_type_hints(cls)
    except Exception as exc:  # unresolved forward reference in the schema itself
        raise TypeError(f"cannot resolve field types of {cls.__qualname__}: {exc}") from exc


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _section_type(tp: Any) -> type | None:
    """The dataclass behind ``tp`` (``Cls``, ``Optional[Cls]``), else None."""
    if _is_union(tp):
        inner = [a for a in typing.get_args(tp) if a is not _NoneType]
        return _section_type(inner[0]) if len(inner) == 1 else None
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _is_dict_type(tp: Any) -> bool:
    if _is_union(tp):
        return any(_is_dict_type(a) for a in typing.get_args(tp))
    return tp is dict or typing.get_origin(tp) is dict


def _type_name(tp: Any) -> str:
    """Human-readable name of a field type, used in messages and :func:`describe`."""
    if tp is _NoneType:
        return "null"
    if tp is Any:
        return "any"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_union(tp):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is list:
        return f"list[{_type_name(args[0]) if args else 'any'}]"
    if origin is dict:
        return f"dict[str, {_type_name(args[1]) if args else 'any'}]"
    return getattr(tp, "__name__", repr(tp))


def _iter_keys(cls: type, prefix: str = "", stack: tuple = ()):
    """Yield ``(dotted_key, field, type, is_section)`` for every key of the schema, depth first."""
    hints = _hints(cls)
    for f in _fields(cls):
        key, tp = _join(prefix, f.name), hints[f.name]
        sub = _section_type(tp)
        if sub is not None and sub not in stack + (cls,):
            yield key, f, tp, True
            yield from _iter_keys(sub, key, stack + (cls,))
        else:
            yield key, f, tp, False


@lru_cache(maxsize=None)
def _all_keys(cls: type) -> tuple[str, ...]:
    return tuple(k for k, *_ in _iter_keys(cls))


def config_keys(cls: type) -> list[str]:
    """All dotted leaf keys of schema ``cls`` (sections themselves are not listed)."""
    return [k for k, _, _, is_section in _iter_keys(cls) if not is_section]


def _quote_list(items: list[str]) -> str:
    quoted = [f"'{s}'" for s in items]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


def _unknown_key(section: type, path: str, key: str, root: type, root_path: str) -> ConfigError:
    """Build the 'unknown config key' error with suggestions from siblings and the whole schema."""
    full = _join(path, key)
    siblings = [f.name for f in _fields(section)]
    found = [_join(path, m) for m in difflib.get_close_matches(key, siblings, n=3)]
    elsewhere = [k for k in (_join(root_path, k) for k in _all_keys(root))
                 if k.rpartition(".")[0] != path]  # siblings were handled above
    found += [k for k in elsewhere if k.rpartition(".")[2] == key]  # same name, other section
    leaves = [k.rpartition(".")[2] for k in elsewhere]
    close = set(difflib.get_close_matches(key, leaves, n=3, cutoff=0.8))
    found += [k for k, leaf in zip(elsewhere, leaves) if leaf in close]
    found += difflib.get_close_matches(full, elsewhere, n=3, cutoff=0.85)
    found = [k for k in dict.fromkeys(found) if k != full][:3]
    if found:
        return ConfigError(f"unknown config key '{full}'; did you mean {_quote_list(found)}?", full)
    where = f"under '{path}'" if path else "at the top level"
    return ConfigError(f"unknown config key '{full}'; valid keys {where}: {', '.join(siblings)}",
                       full)


# --------------------------------------------------------------------------- from_dict

class _Mismatch(ConfigError):
    """A value of the wrong type (internal: lets Optional[X] restate the expected type)."""

    def __init__(self, message: str, key: str, hint: str) -> None:
        super().__init__(message, key)
        self.hint = hint


def _type_error(path: str, tp: Any, value: Any, hint: str = "") -> _Mismatch:
    got = f"{_short(value)} ({type(value).__name__})"
    fix = "fix it in the config file" + ("" if "[" in path else
                                         f" or override it with {path}=<value>")
    return _Mismatch(f"config key '{path}': expected {_type_name(tp)}, got {got}{hint}; {fix}",
                     path, hint)


_SCALARS: dict[type, tuple[type, ...]] = {bool: (bool,), int: (int,), float: (int, float),
                                          str: (str,)}
_SCALAR_HINTS = {bool: " (use true or false)", str: " (quote it to pass a string)"}


def _convert(tp: Any, value: Any, path: str, root: type, root_path: str) -> Any:
    """Check ``value`` against field type ``tp`` and return the typed value."""
    if tp is Any:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_union(tp):
        if value is None and _NoneType in args:
            return None
        options = [a for a in args if a is not _NoneType]
        if len(options) == 1:
            try:
                return _convert(options[0], value, path, root, root_path)
            except _Mismatch as exc:
                if exc.key != path:  # the problem is deeper inside; keep its precise message
                    raise
                raise _type_error(path, tp, value, exc.hint) from None
        token = _COLLECTED.set(None)  # a failed option is no error of the config
        try:
            for option in options:
                try:
                    return _convert(option, value, path, root, root_path)
                except ConfigError:
                    continue
        finally:
            _COLLECTED.reset(token)
        raise _type_error(path, tp, value)
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close and isinstance(value, str) else ""
        raise ConfigError(f"config key '{path}': expected one of {', '.join(map(repr, args))}, "
                          f"got {_short(value)}{hint}", path)
    section = _section_type(tp)
    if section is not None:
        if isinstance(value, section):
            _validate_tree(value, path)
            return value
        if value is None:  # `section:` with every child commented out
            value = {}
        if not isinstance(value, Mapping):
            raise _type_error(path, tp, value, " (a section needs a mapping of keys)")
        return _build(section, value, path, root, root_path)
    if origin is list or tp is list:
        if isinstance(value, str):  # `data.train_files=x.parquet`: a list of one, as Hydra users write it
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise _type_error(path, tp, value, f" (a list: write [{_short(value)}])")
        item = args[0] if args else Any
        return [_convert(item, v, f"{path}[{i}]", root, root_path) for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise _type_error(path, tp, value)
        item = args[1] if args else Any
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"config key '{path}': keys must be strings, got {_short(k)}",
                                  path)
            out[k] = _convert(item, v, _join(path, k), root, root_path)
        return out
    if tp in _SCALARS:
        if isinstance(value, _SCALARS[tp]) and (tp is bool or not isinstance(value, bool)):
            return float(value) if tp is float else value
        raise _type_error(path, tp, value, _SCALAR_HINTS.get(tp, ""))
    raise TypeError(f"config key '{path}': unsupported field type {tp!r} in the schema")


def _run_validate(obj: Any, path: str) -> None:
    """Call ``obj.validate()`` if defined, re-raising its ConfigError with ``path`` prepended."""
    validate = getattr(obj, "validate", None)
    if callable(validate):
        _call_checked(validate, path)


def _call_checked(fn: Any, path: str, /, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``; a ConfigError it raises is re-raised with ``path`` prepended.

    Used for ``validate()`` and for constructors whose ``__post_init__`` validates.
    """
    try:
        return fn(*args, **kwargs)
    except ConfigError as exc:
        full = _join(path, exc.key) if exc.key else path
        if exc.key:
            msg = f"config key '{full}': {exc.message}"
        elif path:
            msg = f"config section '{path}': {exc.message}"
        else:
            msg = f"invalid config: {exc.message}"
        raise ConfigError(msg, full or None) from exc


def _validate_tree(obj: Any, path: str) -> None:
    """Validate an already-built section: its sub-sections first, then itself."""
    for f in _fields(type(obj)):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _validate_tree(value, _join(path, f.name))
    _run_validate(obj, path)


def _build(cls: type[T], data: Mapping, path: str, root: type, root_path: str) -> T:
    """Construct one dataclass level, recursing into sections, then run its ``validate``."""
    hints = _hints(cls)
    names = {f.name for f in _fields(cls)}
    failed = False
    for key in data:
        if key not in names:
            _collect(_unknown_key(cls, path, str(key), root, root_path))
            failed = True
    kwargs: dict[str, Any] = {}
    missing: list[str] = []
    for f in _fields(cls):
        key = _join(path, f.name)
        has_default = (f.default is not dataclasses.MISSING
                       or f.default_factory is not dataclasses.MISSING)
        try:
            if f.name in data:
                kwargs[f.name] = _convert(hints[f.name], data[f.name], key, root, root_path)
            elif not has_default:
                tp = hints[f.name]
                if _section_type(tp) is not None and not _is_union(tp):
                    kwargs[f.name] = _build(_section_type(tp), {}, key, root, root_path)
                else:
                    missing.append(key)
        except ConfigError as exc:  # the other keys are still checked (every error reported at once)
            _collect(exc)
            failed = True
    if missing:
        listed = ", ".join(f"'{k}'" for k in missing)
        _collect(ConfigError(f"missing required config key(s) {listed}; set them in the config "
                             f"file or pass e.g. {missing[0]}=<value>", missing[0]))
        failed = True
    if failed:
        raise _Failed(f"config section '{path}' has errors", path or None)
    obj = _call_checked(cls, path, **kwargs)
    for f in _fields(cls):  # sections left at their defaults are validated too
        value = getattr(obj, f.name)
        if f.name not in data and dataclasses.is_dataclass(value) and not isinstance(value, type):
            try:
                _validate_tree(value, _join(path, f.name))
            except ConfigError as exc:
                _collect(exc)
                failed = True
    if failed:
        raise _Failed(f"config section '{path}' has errors", path or None)
    _run_validate(obj, path)
    return obj


def from_dict(cls: type[T], data: Mapping, path: str = "", prior_errors: Sequence[ConfigError] = ()) -> T:
    """Build dataclass ``cls`` from ``data``; ``path`` is the dotted prefix used in messages.
    Every problem is found before one :class:`ConfigError` lists them all (with ``prior_errors``,
    e.g. the overrides' unknown keys)."""
    if not isinstance(data, Mapping):
        where = f"config section '{path}'" if path else "config"
        raise ConfigError(f"{where} must be a mapping, got {_short(data)}", path or None)
    _hints(cls)
    errors: list[ConfigError] = list(prior_errors)
    token = _COLLECTED.set(errors)
    try:
        obj = _build(cls, data, path, cls, path)
    except _Failed:
        obj = None
    except ConfigError as exc:
        errors.append(exc)
    finally:
        _COLLECTED.reset(token)
    if errors:
        raise ConfigError.combine(errors)
    return obj


# --------------------------------------------------------------------------- overrides

def _check_override_key(schema: type, key: str) -> None:
    """Walk ``key`` through ``schema``; raise on unknown keys or descending into a leaf."""
    section, path = schema, ""
    parts = key.split(".")
    for i, part in enumerate(parts):
        hints = _hints(section)
        if part not in {f.name for f in _fields(section)}:
            raise _unknown_key(section, path, part, schema, "")
        path, tp = _join(path, part), hints[part]
        if _is_dict_type(tp) or tp is Any:
            return  # free-form mapping: any sub-key is allowed
        sub = _section_type(tp)
        if sub is None and i < len(parts) - 1:
            raise ConfigError(f"cannot set '{key}': '{path}' holds a {_type_name(tp)} value, "
                              "not a section", key)
        section = sub if sub is not None else section


def parse_override(item: str) -> tuple[str, str, Any]:
    """``(op, key, value)`` of a command-line override: ``key=value`` and Hydra's ``+key=value``
    (add), ``++key=value`` (add or override) set the key (op ``set``); ``~key`` and ``~key=value``
    remove it, back to its default (op ``del``). Values are YAML; an empty value is the empty string."""
    op = "del" if item.startswith("~") else "set"
    body = item[1:] if op == "del" else item[2:] if item.startswith("++") else item[1:] if item.startswith("+") \
        else item
    key, sep, raw = body.partition("=")
    key = key.strip()
    if (not sep and op == "set") or not all(p.strip() for p in key.split(".")):
        raise ConfigError(f"malformed override {item!r}: expected key=value (or Hydra's +key=value, "
                          "++key=value, ~key), e.g. trainer.total_steps=100")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({exc}); "
                          "quote it to pass a string", key) from exc
    return op, key, value


def has_key(schema: type, key: str) -> bool:
    """Whether dotted ``key`` names a key of ``schema`` (an override of it would be accepted)."""
    try:
        _check_override_key(schema, key)
    except ConfigError:
        return False
    return True


def apply_overrides(data: Mapping, overrides: Sequence[str], schema: type | None = None,
                    errors: list[ConfigError] | None = None) -> dict:
    """Return a deep copy of ``data`` with the overrides applied (:func:`parse_override`).

    Everything after the first ``=`` is the value. When ``schema`` is given, every key is checked
    against it before anything is applied. Missing (or null) intermediate sections are created as
    empty mappings; a mapping value replaces the whole section. With ``errors``, a bad override is
    appended there and skipped (so one command reports every problem), else raised.
    """
    parsed: list[tuple[str, list[str], Any]] = []
    for item in overrides:
        try:
            op, key, value = parse_override(item)
            if schema is not None:
                _check_override_key(schema, key)
        except ConfigError as exc:
            if errors is None:
                raise
            errors.append(exc)
            continue
        parsed.append((op, [p.strip() for p in key.split(".")], value))
    out = copy.deepcopy(dict(data))
    for op, parts, value in parsed:
        node = out
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                if op == "del":
                    break
                child = node[part] = {}
            elif not isinstance(child, dict):
                prefix = ".".join(parts[: depth + 1])
                raise ConfigError(f"cannot set '{'.'.join(parts)}': '{prefix}' is "
                                  f"{_short(child)}, not a mapping", prefix)
            node = child
        else:
            if op == "del":
                node.pop(parts[-1], None)
            else:
                node[parts[-1]] = value
    return out


def _has_interpolation(data: Any) -> bool:
    if isinstance(data, str):
        return "${" in data
    if isinstance(data, Mapping):
        return any(_has_interpolation(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return any(_has_interpolation(v) for v in data)
    return False


def _overlay(base: Any, data: Any) -> Any:
    """``data`` over ``base`` (mappings merged key by key)."""
    if isinstance(base, Mapping) and isinstance(data, Mapping):
        return {**base, **{k: _overlay(base.get(k), v) for k, v in data.items()}}
    return data


def _pick(resolved: Any, data: Any) -> Any:
    """The keys of ``data`` from ``resolved``."""
    if isinstance(data, Mapping) and isinstance(resolved, Mapping):
        return {k: _pick(resolved.get(k), v) for k, v in data.items()}
    return resolved


def resolve_interpolations(cls: type, data: dict) -> dict:
    """``data`` with Hydra / OmegaConf ``${...}`` interpolations resolved (``${data.max_prompt_length}``,
    ``${oc.env:HOME}``); a reference may name any key of the schema, set or left at its default."""
    if not _has_interpolation(data):
        return data
    # OmegaConf (0.14 s): only a config with ${...} needs it
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        defaults = to_dict(cls())
    except Exception:  # noqa: BLE001 - required keys: references to what the config sets only
        defaults = {}
    try:
        resolved = OmegaConf.to_container(OmegaConf.create(_overlay(defaults, data)), resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        raise ConfigError(f"cannot resolve the interpolation of config key '{key}': "
                          f"{str(exc.msg).splitlines()[0]}", key) from None
    return _pick(resolved, data)


# --------------------------------------------------------------------------- files

def load_config(cls: type[T], yaml_path: str | None, overrides: Sequence[str] = (), *,
                finalize: Any = None, errors: Sequence[ConfigError] = ()) -> T:
    """Read ``yaml_path`` (or start empty when None), apply ``overrides``, build ``cls``.
    ``finalize(data, errors) -> data`` runs on the merged mapping before it is built (the verl keys'
    conversions); ``errors`` found earlier are reported with the config's own, in one error."""
    data: Any = {}
    if yaml_path is not None:
        try:
            with open(yaml_path, encoding="utf-8") as fh:
                data = yaml_load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file '{yaml_path}' not found; check the path") from None
        except IsADirectoryError:
            raise ConfigError(f"config file '{yaml_path}' is a directory, not a YAML file") from None
        except OSError as exc:
            raise ConfigError(f"cannot read config file '{yaml_path}': {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file '{yaml_path}' is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at "
                              f"offset {exc.start}); save it as UTF-8") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigError(f"config file '{yaml_path}' is not valid YAML{where}: {problem}"
                              ) from exc
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file '{yaml_path}' must contain a mapping of keys at the "
                              f"top level, got {type(data).__name__}")
    found: list[ConfigError] = list(errors)
    data = apply_overrides(data, list(overrides), schema=cls, errors=found)
    data = resolve_interpolations(cls, data)
    if finalize is not None:
        data = finalize(data, found)
    return from_dict(cls, data, prior_errors=found)


def to_dict(obj: Any) -> Any:
    """Plain-data form of a config object (dataclasses become dicts; init fields only)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in _fields(type(obj))}
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def format_config(obj: Any) -> str:
    """The resolved config as YAML text, for logging."""
    return _yaml_dump(to_dict(obj))


def dump_yaml(obj: Any, path: str) -> None:
    """Write the resolved config to ``path``; ``load_config(type(obj), path, [])`` equals ``obj``."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(format_config(obj))
