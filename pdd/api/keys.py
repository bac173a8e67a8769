"""Named API keys: who is calling, for the per-key counters and the access log.

A server takes its keys from three places, all optional, all at once:
- one unnamed key (`--api-key`, `[router] api_key`, `$PDD_API_KEY`), named "default";
- a keys file (`--api-keys-file`, `[router] api_keys_file`): TOML, a `[keys]` table of
  `NAME = "KEY"`;
- `$PDD_API_KEYS`: `NAME=KEY,NAME=KEY`.
With any key, /v1/* needs `Authorization: Bearer KEY` of one of them; the name (never the
key) is what the metrics and the log show. A name or a key given twice, an empty key or a
name that is not `[A-Za-z0-9][A-Za-z0-9_.-]*` (64 at most) is a `Mistake`.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

from pdd.errors import Mistake

KEYS_ENV = "PDD_API_KEYS"
DEFAULT_NAME = "default"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def api_keys(single: str = "", keys_file: str = "", env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """name -> key, from the three places above."""
    pairs: list[tuple[str, str, str]] = []  # (name, key, where it was given)
    if single:
        pairs.append((DEFAULT_NAME, single, "--api-key"))
    if keys_file:
        pairs += [(n, k, keys_file) for n, k in _from_file(Path(keys_file))]
    if env.get(KEYS_ENV):
        pairs += [(n, k, f"${KEYS_ENV}") for n, k in _from_env(env[KEYS_ENV])]
    keys: dict[str, str] = {}
    owner: dict[str, str] = {}
    for name, key, where in pairs:
        if not _NAME.fullmatch(name):
            raise Mistake(f"{where}: key name {name[:80]!r} is not [A-Za-z0-9][A-Za-z0-9_.-]* (64 at most)")
        if not key:
            raise Mistake(f"{where}: key {name!r} is empty")
        if name in keys:
            raise Mistake(f"{where}: key name {name!r} is given twice")
        if key in owner:
            raise Mistake(f"{where}: keys {owner[key]!r} and {name!r} are the same key")
        keys[name], owner[key] = key, name
    return keys


def _from_file(path: Path) -> Iterable[tuple[str, str]]:
    try:
        table = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise Mistake(f"cannot read the keys file {path}: {e}") from None
    extra = sorted(set(table) - {"keys"})
    keys = table.get("keys")
    if extra or not isinstance(keys, dict):
        beside = f" (not {extra})" if extra else ""
        raise Mistake(f'{path}: a keys file is one [keys] table of NAME = "KEY"{beside}')
    for name, key in keys.items():
        if not isinstance(key, str):
            raise Mistake(f"{path}: [keys] {name} must be a string")
        yield name, key


def _from_env(text: str) -> Iterable[tuple[str, str]]:
    for item in text.split(","):
        name, sep, key = item.strip().partition("=")
        if not sep:
            raise Mistake(f"${KEYS_ENV}: {name[:80]!r} is not NAME=KEY")
        yield name, key
