"""How a deployment file's tables are checked: by pydantic, strictly, with errors that
name the file's table and key (a user reads "[router] port must be an integer", not a
pydantic trace). Unknown keys, loose types (a string for a number, 1 for true, 2.5 for
an integer) and nan or inf are refused."""

from __future__ import annotations

import functools
import json
from typing import Any, TypeVar, cast

from pydantic import ConfigDict, TypeAdapter, ValidationError

from pdd.errors import Mistake

STRICT_TABLE = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
T = TypeVar("T")


class ConfigError(Mistake, ValueError):
    """A deployment file that is not one: which file, table and key."""


_WORDS = {
    "string_type": "must be a string",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "missing": "is missing",
    "dict_type": "must be a table",
    "dataclass_type": "must be a table",
}


@functools.cache
def adapter(cls: type) -> TypeAdapter[Any]:
    return TypeAdapter(cls)


def validate(cls: type[T], raw: Any, where: str) -> T:
    """`cls` from a TOML table, checked by pydantic, through JSON: in strict mode pydantic builds
    a dataclass from a JSON object but not from a dict. TOML's values are JSON's but dates,
    which no key takes: they become an array, which none takes either, so the error names the key."""
    if not isinstance(raw, dict):
        raise ConfigError(f"[{where}] must be a table" if where else "a deployment must be a table")
    try:
        return cast(T, adapter(cast(type, cls)).validate_json(json.dumps(raw, default=lambda v: [str(v)])))
    except ValidationError as e:
        raise ConfigError(explain(e, where)) from None


def explain(err: ValidationError, where: str) -> str:
    unknown: dict[str, list[str]] = {}
    problems = []
    for e in err.errors():
        loc = [str(part) for part in e["loc"]]
        # a table's own check (__post_init__) names its keys; a deployment's first step is its table
        split = len(loc) if e["type"] == "value_error" else int(not where and len(loc) > 1)
        table, key = ".".join([where, *loc[:split]]).strip("."), ".".join(loc[split:])
        head = f"[{table}] " if table else ""
        if e["type"] == "unexpected_keyword_argument":
            unknown.setdefault(head, []).append(key)
        else:
            problems.append(
                head
                + (
                    e["msg"].removeprefix("Value error, ")
                    if e["type"] == "value_error"
                    else f"{key} {_WORDS.get(e['type'], e['msg'])}"
                )
            )
    problems += [
        f"{head}has unknown keys: {sorted(keys)}" if head else f"unknown top-level keys: {sorted(keys)}"
        for head, keys in unknown.items()
    ]
    return "; ".join(problems)
