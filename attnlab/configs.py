"""Plain-data helpers shared by every config dataclass: to/from dicts, checked Literals, overrides.

Configs are frozen dataclasses; JSON files and `--section.field=value` flags only *override* their
fields through `dataclasses.replace`, so every default is written once, in the dataclass.
"""

import dataclasses
import json
import types
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

C = TypeVar("C")


def to_dict(cfg) -> dict:
    """A dataclass (nested ones included) as plain JSON-ready data."""
    return dataclasses.asdict(cfg)


def from_dict(cls: type[C], data: dict) -> C:
    """Build `cls` from plain data, recursing into nested dataclasses; unknown keys are errors."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__} expects a mapping, got {type(data).__name__}: {data!r}")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {unknown}; valid fields: {sorted(names)}")
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in data and _required(f)]
    if missing:
        raise ValueError(f"{cls.__name__} needs fields {missing}, missing from {sorted(data)}")
    kwargs = {}
    for key, value in data.items():
        sub = _dataclass_in(hints[key])
        if sub and isinstance(value, dict):
            kwargs[key] = from_dict(sub, value)
        elif sub and isinstance(value, str):  # text is never read as a section
            raise ValueError(
                f"{cls.__name__}.{key} must be a mapping of {sub.__name__} fields, got {value!r}"
            )
        else:
            kwargs[key] = _read_text(cls, key, hints[key], value)
    return cls(**kwargs)


def merge(cfg: C, data: dict) -> C:
    """Return `cfg` with the fields in `data` replaced, recursing into nested dataclasses."""
    hints = get_type_hints(type(cfg))
    changes = {}
    for key, value in data.items():
        if key not in hints:
            raise ValueError(f"{type(cfg).__name__} has no field {key!r}; valid: {sorted(hints)}")
        current, sub = getattr(cfg, key), _dataclass_in(hints[key])
        if sub is not None and isinstance(value, dict):
            value = merge(current, value) if current is not None else from_dict(sub, value)
        else:
            value = _read_text(type(cfg), key, hints[key], value)
        changes[key] = value
    return dataclasses.replace(cfg, **changes)


def leaf_fields(cls: type, prefix: str = "") -> list[tuple[str, Any]]:
    """Dotted paths and annotations of every non-dataclass field, recursing into sections."""
    out = []
    for name, annotation in get_type_hints(cls).items():
        sub = _dataclass_in(annotation)
        if sub is not None:
            out += leaf_fields(sub, f"{prefix}{name}.")
        else:
            out.append((prefix + name, annotation))
    return out


def check_literals(cfg) -> None:
    """Raise a ValueError for any field whose value is not among its Literal's choices."""
    hints = get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        choices = _literal_choices(hints[f.name])
        value = getattr(cfg, f.name)
        if choices is not None and value not in choices:
            raise ValueError(
                f"{type(cfg).__name__}.{f.name}={value!r} is not one of {list(choices)}"
            )


def parse_value(annotation, text: str) -> Any:
    """Convert a command-line string to a field's type (int, float, bool, str, None, Literal;
    a tuple, list or dict field reads JSON: `--logit-bias '{"50256": -100}'`)."""
    args = get_args(annotation) if _is_union(annotation) else (annotation,)
    if text.lower() in ("none", "null") and type(None) in args:
        return None
    for arg in args:
        if arg is type(None):
            continue
        if get_origin(arg) in (tuple, list, dict):
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                continue
        if get_origin(arg) is Literal:
            if text in [str(c) for c in get_args(arg)]:
                return next(c for c in get_args(arg) if str(c) == text)
            continue
        if arg is bool:
            if text.lower() in ("true", "1", "yes"):
                return True
            if text.lower() in ("false", "0", "no"):
                return False
            continue
        try:
            return arg(text)
        except (TypeError, ValueError):
            continue
    raise ValueError(f"cannot read {text!r} as {type_name(annotation)}")


def override(cfg: C, path: str, text: str, _full: str | None = None) -> C:
    """Return `cfg` with the (dotted) field `path` set from the string `text`."""
    full = path if _full is None else _full  # the whole dotted path, for error messages
    head, _, rest = path.partition(".")
    hints = get_type_hints(type(cfg))
    if head not in hints:
        fields = sorted(hints)
        raise ValueError(
            f"{full!r}: {type(cfg).__name__} has no field {head!r}; valid fields: {fields}"
        )
    if rest:
        current = getattr(cfg, head)
        section = full[: len(full) - len(rest) - 1]  # e.g. "rope.scaling"
        if not dataclasses.is_dataclass(current):
            if current is None and _dataclass_in(hints[head]) is not None:
                raise ValueError(
                    f"{full!r}: section {section!r} is None; set it in a config file first"
                )
            raise ValueError(f"{section!r} is not a section, cannot set {full!r}")
        return dataclasses.replace(cfg, **{head: override(current, rest, text, full)})
    return dataclasses.replace(cfg, **{head: parse_value(hints[head], text)})


def _read_text(cls: type, key: str, annotation, value):
    """A value from a file, checked against the field's type; a string given for a non-string
    field is read as that type. YAML needs this: it reads `lr: 3e-4` as the string "3e-4" (YAML
    1.1 floats need a dot, as in 3.0e-4)."""
    args = get_args(annotation) if _is_union(annotation) else (annotation,)
    takes_text = any(a is str or get_origin(a) is Literal for a in args)  # Literals: check_literals
    if isinstance(value, str) and not takes_text:
        try:
            return parse_value(annotation, value)
        except ValueError:
            raise ValueError(
                f"{cls.__name__}.{key}: cannot read {value!r} as {type_name(annotation)}"
            ) from None
    if not _has_type(value, args):
        raise ValueError(
            f"{cls.__name__}.{key} must be {type_name(annotation)}, got {value!r} "
            f"({type(value).__name__})"
        )
    return float(value) if float in args and type(value) is int else value


def _has_type(value, args: tuple) -> bool:
    """Whether `value` fits one of a field's types. Strict where Python is lenient: a bool is
    not an int (YAML `n_layers: true` would build a 1-layer model), a float is not an int
    (`steps: 4.5`), a list is not a number; an int is a float (`lr: 1`)."""
    for arg in args:
        if arg is type(None):
            ok = value is None
        elif get_origin(arg) is Literal:
            ok = True  # check_literals names the choices
        elif arg is bool:
            ok = isinstance(value, bool)
        elif arg is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif arg is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        elif isinstance(arg, type):
            ok = isinstance(value, arg)
        else:
            ok = True  # a generic alias (tuple[int, ...]): left to the dataclass
        if ok:
            return True
    return False


def type_name(annotation) -> str:
    """A field's type as a user reads it: "an int", "a float or None", "one of ['a', 'b']"."""
    args = get_args(annotation) if _is_union(annotation) else (annotation,)
    words = {int: "an int", float: "a float", bool: "a bool (true/false)", str: "a string"}
    names = []
    for arg in args:
        if arg is type(None):
            names.append("None")
        elif get_origin(arg) is Literal:
            names.append(f"one of {list(get_args(arg))}")
        else:
            names.append(words.get(arg, getattr(arg, "__name__", str(arg))))
    return " or ".join(names)


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _is_union(annotation) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


def _literal_choices(annotation) -> tuple | None:
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    if _is_union(annotation):
        lits = [a for a in get_args(annotation) if get_origin(a) is Literal]
        if lits:
            return get_args(lits[0]) + ((None,) if type(None) in get_args(annotation) else ())
    return None


def _dataclass_in(annotation) -> type | None:
    """The dataclass type inside `X` or `X | None`, if any."""
    candidates = get_args(annotation) if _is_union(annotation) else (annotation,)
    for c in candidates:
        if dataclasses.is_dataclass(c):
            return c
    return None


__all__ = [
    "to_dict",
    "from_dict",
    "merge",
    "leaf_fields",
    "check_literals",
    "parse_value",
    "override",
    "type_name",
]
