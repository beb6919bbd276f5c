"""Config sections that type and check themselves: ``@section`` + ``setting(default, min=..)``, the one
walker behind every key, so code-built and loaded sections fail alike, with a ConfigError naming the key."""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Callable

import yaml

BOOLS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
NONE = ("none", "null", "~", "")
hints = functools.cache(typing.get_type_hints)  # per class: sections are built often
# a setting's limits: (value, limit, owner) -> (ok, message); a rule is (predicate(value, owner), message)
LIMITS = {"choices": lambda v, c, _: (v in c, f"must be one of {c}"),
          "min": lambda v, m, _: (v >= m, f"must be >= {m}"), "gt": lambda v, m, _: (v > m, f"must be > {m}"),
          "max": lambda v, m, _: (v <= m, f"must be <= {m}"), "rule": lambda v, r, owner: (r[0](v, owner), r[1])}


class ConfigError(ValueError):
    """A config problem found before any data is read; the message starts with the dotted key."""


def require(cond: Any, key: str, msg: str) -> None:
    """Raise ConfigError naming ``key`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def setting(default: Any, **limits: Any) -> Any:
    """A field with its LIMITS: ``min``, ``gt``, ``max``, ``choices``, ``rule=(predicate(value, owner), message)``."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=limits)
    return dataclasses.field(default=default, metadata=limits)


@typing.dataclass_transform(field_specifiers=(dataclasses.field, setting))
def section(where: str) -> Callable[[type], type]:
    """``@section("model.encoder")``: a dataclass that types and checks its fields when built, + from_dict/to_dict."""
    def wrap(klass: type) -> type:
        klass.__post_init__ = lambda self: check(self, where)
        klass.from_dict = classmethod(lambda cls, d: build(cls, dict(d or {}), where))
        klass.to_dict = dataclasses.asdict
        return dataclasses.dataclass(klass)
    return wrap


def coerce(value: Any, typ: Any, key: str) -> Any:
    """``value`` (a command-line string, a YAML value, or already typed) as ``typ``, or ConfigError."""
    if typing.get_origin(typ) in (typing.Union, types.UnionType):  # Optional[X]
        if value is None or isinstance(value, str) and value.strip().lower() in NONE:
            return None
        typ = next(a for a in typing.get_args(typ) if a is not type(None))
    if dataclasses.is_dataclass(typ):  # a whole block: YAML mapping, or --model.lora "{r: 8}"
        value = yaml.safe_load(value) if isinstance(value, str) else value
        if isinstance(value, typ):
            return value
        require(isinstance(value, dict), key, f"expected a mapping of {typ.__name__} keys, got {value!r}")
        return build(typ, value, key)
    origin = typing.get_origin(typ) or typ
    try:
        if isinstance(value, str) and origin in (list, dict):  # "0.9,0.95", "[0.9, 0.95]", "{a: 1}"
            value = value.split(",") if origin is list and not value.strip().startswith("[") else yaml.safe_load(value)
        if typ is str and isinstance(value, bool):   # YAML's true/false for a key that also takes words
            return "true" if value else "false"
        if typ is bool:
            return value if isinstance(value, bool) else BOOLS[str(value).strip().lower()]
        # what a scalar must not be read from: True as 1, 1.5 as 1, a mapping or list as its text
        if isinstance(value, {int: (bool, float), float: bool, str: (dict, list)}.get(typ, ())) and not (
                typ is int and isinstance(value, float) and value.is_integer()):
            raise ValueError
        if typ in (int, float, str):
            return typ(value)
        if not isinstance(value, {list: (list, tuple), dict: dict}.get(origin, object)):
            raise ValueError
        if origin is list:
            item = (typing.get_args(typ) or (Any,))[0]
            return [coerce(v.strip() if isinstance(v, str) else v, item, key) for v in value]
    except (ValueError, TypeError, KeyError, yaml.YAMLError):
        raise ConfigError(f"{key}: cannot read {value!r} as {getattr(typ, '__name__', typ)}") from None
    return yaml.safe_load(value) if isinstance(value, str) else value  # a dict, or untyped


def build(klass: type, values: dict, where: str) -> Any:
    """An instance of dataclass ``klass`` from a mapping; an unknown key fails naming it."""
    names = [f.name for f in dataclasses.fields(klass)]
    for k in values:
        require(k in names, f"{where}.{k}".lstrip("."), f"unknown {'key' if where else 'section'} {k!r} "
                f"(known: {', '.join(names)})")
    return klass(**values)


def check(obj: Any, where: str) -> None:
    """Coerce every field of dataclass ``obj`` to its annotation, then check the declared limits."""
    fields, hint = dataclasses.fields(obj), hints(type(obj))
    for f in fields:
        setattr(obj, f.name, coerce(getattr(obj, f.name), hint[f.name], f"{where}.{f.name}".lstrip(".")))
    derive = getattr(obj, "derive", None)
    if derive is not None:  # a section whose keys fill others (model.type's preset) does it here
        derive()
    for f in fields:  # limits after coercion: a rule may read sibling fields
        v = getattr(obj, f.name)
        if v is None:
            continue
        for name, limit in f.metadata.items():
            ok, text = LIMITS[name](v, limit, obj)
            require(ok, f"{where}.{f.name}".lstrip("."), f"{text}, got {v!r}")
