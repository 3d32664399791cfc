"""A graph's request fields: FlagScale's two spellings, its type whitelist, and binding a JSON body to them.

    request: [{arg: prompt, type: str}, {arg: max_tokens, type: int, default: 32}]   # v1.0: a list
    request: {args: [prompt], types: [str]}                                          # older: parallel lists

A field is required unless it has a `default`, its type is Optional[...], or it says `required: false`;
an absent optional field gets its default (None when it has none). Types: str int float bool list dict
tuple set Any, Optional[T], Union[T, ...], and containers with parameters (list[int]: the container is
checked). JSON has no tuple or set: a list is accepted for them and converted.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flagscale.errors import ConfigError

_PLAIN: dict[str, type] = {
    "str": str,
    "int": int,
    "float": float,
    "bool": bool,
    "list": list,
    "dict": dict,
    "tuple": tuple,
    "set": set,
}
_ALIASES = {"List": "list", "Dict": "dict", "Tuple": "tuple", "Set": "set"}
TYPE_NAMES = (*_PLAIN, "Any", "Optional[...]", "Union[...]")
_TOKEN = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.]*|\[|\]|,)")


@dataclass(frozen=True)
class RequestField:
    name: str
    type: str  # as written in the config; "Any" when none was given
    required: bool
    default: Any = None


@dataclass(frozen=True)
class _Type:
    """A parsed type expression: which values it accepts, and how a JSON value becomes the Python one."""

    check: Callable[[Any], bool]
    convert: Callable[[Any], Any] = lambda value: value
    optional: bool = False


def parse_fields(request: Any, where: str) -> list[RequestField] | None:
    """Both spellings -> fields, every type checked against the whitelist. None: no request fields declared."""
    if request is None:
        return None
    if isinstance(request, dict):
        return _parse_columns(request, where)
    if not isinstance(request, list) or not request:
        raise ConfigError(f"request must be a list of {{arg, type}} entries, got {request!r}", where)
    fields = []
    for index, entry in enumerate(request):
        entry_where = f"{where}[{index}]"
        if not isinstance(entry, dict):
            raise ConfigError(
                f"a request entry is a mapping {{arg, type, required?, default?}}, got {entry!r}", entry_where
            )
        unknown = sorted(set(entry) - {"arg", "type", "required", "default"})
        if unknown:
            raise ConfigError(f"unknown key(s) {unknown}; an entry has arg, type, required, default", entry_where)
        name, type_name = entry.get("arg"), entry.get("type", "Any")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"`arg` must be a field name, got {name!r}", entry_where)
        parsed = parse_type(type_name, f"{entry_where}.type")
        required = entry.get("required", "default" not in entry and not parsed.optional)
        if not isinstance(required, bool):
            raise ConfigError(f"`required` must be true or false, got {required!r}", entry_where)
        if required and "default" in entry:
            raise ConfigError(f"field '{name}' is required and has a default; drop one", entry_where)
        default = entry.get("default")
        if "default" in entry and default is not None and not parsed.check(default):
            raise ConfigError(f"default {default!r} of field '{name}' is not a {type_name}", entry_where)
        fields.append(RequestField(name, str(type_name), required, default))
    _no_duplicates([f.name for f in fields], where)
    return fields


def _parse_columns(request: dict[str, Any], where: str) -> list[RequestField]:
    unknown = set(request) - {"args", "types"}
    if unknown:
        raise ConfigError(
            f"unknown key(s) {sorted(unknown)} in request; it has `args` and `types` "
            "(or is a list of {arg, type} entries)",
            where,
        )
    args, types = request.get("args"), request.get("types")
    if not isinstance(args, list) or not all(isinstance(a, str) and a for a in args):
        raise ConfigError(f"request.args must be a list of field names, got {args!r}", where)
    _no_duplicates(args, where)
    if types is None:
        types = ["Any"] * len(args)
    if not isinstance(types, list) or len(types) != len(args):
        raise ConfigError(f"request.types {types!r} does not match request.args {args}: one type per field", where)
    for arg, type_name in zip(args, types):
        parse_type(type_name, f"{where}.types (field '{arg}')")
    return [RequestField(arg, str(type_name), True) for arg, type_name in zip(args, types)]


def _no_duplicates(names: list[str], where: str) -> None:
    if len(set(names)) != len(names):
        raise ConfigError(f"request fields have duplicates: {names}", where)


def parse_type(expr: Any, where: str) -> _Type:
    """A whitelisted type expression -> its checker. Unknown names are a ConfigError listing the whitelist."""
    if not isinstance(expr, str):
        raise ConfigError(f"a type is written as a string such as 'str' or 'Optional[int]', got {expr!r}", where)
    tokens = _TOKEN.findall(expr)
    if "".join(tokens) != expr.replace(" ", ""):
        raise ConfigError(f"cannot read type {expr!r}; supported: {', '.join(TYPE_NAMES)}", where)
    parsed, rest = _parse(tokens, expr, where)
    if rest:
        raise ConfigError(f"cannot read type {expr!r} (unexpected {''.join(rest)!r})", where)
    return parsed


def _parse(tokens: list[str], expr: str, where: str) -> tuple[_Type, list[str]]:
    if not tokens or tokens[0] in "[],":
        raise ConfigError(f"cannot read type {expr!r}; supported: {', '.join(TYPE_NAMES)}", where)
    name, rest = tokens[0].removeprefix("typing."), tokens[1:]
    name = _ALIASES.get(name, name)
    params: list[_Type] = []
    if rest and rest[0] == "[":
        rest = rest[1:]
        while True:
            param, rest = _parse(rest, expr, where)
            params.append(param)
            if rest and rest[0] == ",":
                rest = rest[1:]
                continue
            if not rest or rest[0] != "]":
                raise ConfigError(f"cannot read type {expr!r} (missing ']')", where)
            rest = rest[1:]
            break
    if name == "Any" and not params:
        return _Type(lambda value: True, optional=True), rest
    if name == "None" and not params:
        return _Type(lambda value: value is None, optional=True), rest
    if name == "Optional" and len(params) == 1:
        inner = params[0]
        return _Type(lambda v: v is None or inner.check(v), lambda v: v if v is None else inner.convert(v), True), rest
    if name == "Union" and params:

        def convert(value: Any) -> Any:
            return next((p.convert(value) for p in params if p.check(value)), value)

        return _Type(lambda v: any(p.check(v) for p in params), convert, any(p.optional for p in params)), rest
    if name in _PLAIN:
        return _plain(_PLAIN[name]), rest
    raise ConfigError(f"unsupported type {expr!r}; supported: {', '.join(TYPE_NAMES)}", where)


def _plain(expected: type) -> _Type:
    if expected is float:
        return _Type(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), float)
    if expected in (tuple, set):
        return _Type(lambda v: isinstance(v, (list, tuple, set)), expected)
    if expected is int:
        return _Type(lambda v: isinstance(v, int) and not isinstance(v, bool))
    return _Type(lambda v: isinstance(v, expected))


@functools.lru_cache(maxsize=256)
def _compiled(expr: str) -> _Type:
    return parse_type(expr, "request")


def bind(fields: list[RequestField] | None, payload: Any) -> tuple[dict[str, Any] | None, str | None]:
    """A JSON body -> the keyword arguments of the graph's roots (defaults filled in), or why it does not fit."""
    if not isinstance(payload, dict):
        return None, "the request body must be a JSON object"
    if fields is None:
        return payload, None
    names = [f.name for f in fields]
    missing = [f.name for f in fields if f.required and f.name not in payload]
    if missing:
        return None, f"missing required request field(s) {missing}; the request has fields {names}"
    extra = [k for k in payload if k not in names]
    if extra:
        return None, f"unexpected request field(s) {extra}; the request has fields {names}"
    kwargs = {}
    for field in fields:
        if field.name not in payload:
            kwargs[field.name] = field.default
            continue
        value, parsed = payload[field.name], _compiled(field.type)
        if not parsed.check(value):
            return None, f"request field '{field.name}' must be {field.type}, got {type(value).__name__}"
        kwargs[field.name] = parsed.convert(value)
    return kwargs, None
